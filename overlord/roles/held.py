"""What a SourceLoader holds: its published items not released yet, and what was consumed.

And the metadata block a loader sends the planner for a piece of a shard.

Items are kept by shard, in the pieces they were tokenized in. An item is
*consumed* when it lies before the ``floor`` of the state the loader started
from (or was rewound to), in one of that state's ``skip`` runs, or was
released; a consumed item is never held, whether its release came before the
item was read (a lagging shadow) or after. Not thread-safe: the loader's lock
guards every call.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from overlord.batch.rows import scratch
from overlord.plan.compiled import copy_kernel
from overlord.sources.shard import ShardItems

Position = tuple[int, int]  # (epoch, shard_pos): the order of a source's shards
# up to this many items, plain Python over them costs less than numpy's calls would
FEW = 16
Key = tuple[int, int, int]  # (epoch, shard_pos, index): an item's place in the source's order


# metadata columns of a block: key, ShardItems field, dtype
_BLOCK_COLUMNS = (
    ("tokens", "length", np.int32),
    ("row", "row", np.int64),
    ("chunk", "chunk", np.int32),
    ("patches", "patches", np.int32),
)


def metadata_block(
    at: Position,
    file_index: int,
    base: int,
    items: ShardItems | None,
    keep: np.ndarray | None,
    last: bool = False,
) -> dict[str, Any]:
    """The planner's metadata of a piece's items in ``keep`` (a shard's closing block: ``last``).

    See :data:`overlord.roles.api.SHARD_END` for the fields.
    """
    idx = np.flatnonzero(keep) if keep is not None else np.zeros(0, dtype=np.int64)
    block: dict[str, Any] = {
        "epoch": at[0],
        "shard_pos": at[1],
        "file_index": file_index,
        "index": (idx + base).astype(np.int64),
        "stop": base + (len(items) if items is not None else 0),
        "last": last,
    }
    for key, attr, dtype in _BLOCK_COLUMNS:
        column = getattr(items, attr) if items is not None else np.zeros(0, dtype=dtype)
        block[key] = column[idx]
    return block


def by_shard(keys: np.ndarray) -> list[tuple[Position, np.ndarray]]:
    """The rows of ``keys`` (``(n, 3)``: epoch, shard position, index) shard by shard.

    >>> [(at, rows.tolist()) for at, rows in by_shard(np.array([[0, 2, 5], [0, 1, 0], [0, 2, 1]]))]
    [((0, 1), [1]), ((0, 2), [0, 2])]
    """
    if len(keys) <= FEW:
        groups: dict[Position, list[int]] = {}
        for r, (e, p) in enumerate(keys[:, :2].tolist()):
            groups.setdefault((e, p), []).append(r)
        return [(at, np.array(rows, dtype=np.int64)) for at, rows in sorted(groups.items())]
    first = keys[0, :2]
    if (keys[:, :2] == first).all():  # most often: a step's items of a loader in one shard
        return [((int(first[0]), int(first[1])), np.arange(len(keys)))]
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    shard = keys[order, :2]
    cuts = np.flatnonzero((shard[1:] != shard[:-1]).any(axis=1)) + 1
    return [((int(keys[g[0], 0]), int(keys[g[0], 1])), g) for g in np.split(order, cuts)]


def payload(picked: list[tuple[ShardItems, int]]) -> dict[str, np.ndarray]:
    """What ``take`` answers for items ``(piece items, index in the piece)``, in order.

    See :func:`payload_of_runs`, which this is for the items' runs.
    """
    return payload_of_runs(_runs(picked))


def payload_of_runs(runs: list[tuple[ShardItems, int, int]]) -> dict[str, np.ndarray]:
    """What ``take`` answers for runs of items ``(piece items, lo, hi)``, in order.

    ``tokens`` (int32, back to back) and ``lengths``; from an image source also
    ``pixels`` (uint8 patches of the items' images, back to back), ``grid``
    (int32 ``(items, 2)``, ``(0, 0)`` for an item without an image) and, from
    a tar, ``keys`` (UTF-8 bytes back to back) with ``key_lengths``.
    """
    lengths: list[int] = []
    parts: list[slice] = []
    pieces: list[ShardItems] = []  # the piece of each slice
    for items, lo, hi in runs:
        if hi - lo == 1:  # most runs of a step of many sources: no array for one item
            a, n = int(items.start[lo]), int(items.length[lo])
            lengths.append(n)
            parts.append(slice(a, a + n))
            pieces.append(items)
            continue
        length, start = items.length[lo:hi], items.start[lo:hi]
        run = length.tolist()
        lengths += run
        if _back_to_back(start, length):
            # a run of items back to back in the piece: one slice of its tokens
            parts.append(slice(int(start[0]), int(start[-1]) + run[-1]))
            pieces.append(items)
        else:
            parts += [slice(a, a + n) for a, n in zip(start.tolist(), run)]
            pieces += [items] * (hi - lo)
    out = {
        "tokens": _joined([p.tokens[s] for p, s in zip(pieces, parts)], np.int32),
        "lengths": np.array(lengths, dtype=np.int32),
    }
    if runs and runs[0][0].mask is not None:  # a chat source's: sliced as its tokens are
        out["mask"] = _joined(
            [p.mask[s] for p, s in zip(pieces, parts) if p.mask is not None], np.uint8
        )
    if runs and runs[0][0].pixels is not None:
        grids, pixels, keys = [], [], []
        for items, k in ((items, k) for items, lo, hi in runs for k in range(lo, hi)):
            assert items.pixels is not None and items.grid is not None
            assert items.patch_start is not None
            grids.append(items.grid[k])
            at, n = int(items.patch_start[k]), int(items.patches[k])
            pixels.append(items.pixels[at : at + n])
            if items.keys is not None:
                keys.append(items.keys[k].encode())
        out["grid"] = np.stack(grids).astype(np.int32)
        out["pixels"] = np.concatenate(pixels)
        if keys:
            out["keys"] = np.frombuffer(b"".join(keys), dtype=np.uint8)
            out["key_lengths"] = np.array([len(k) for k in keys], dtype=np.int32)
    return out


def _back_to_back(start: np.ndarray, length: np.ndarray) -> bool:
    """Whether items starting at ``start`` with ``length`` tokens lie back to back."""
    if len(start) <= FEW:  # a few: plain Python costs less than numpy's calls
        at = start.tolist()
        return all(a + n == b for a, n, b in zip(at, length.tolist(), at[1:]))
    return bool((np.diff(start) == length[:-1]).all())


def _joined(parts: list[Any], dtype: type) -> np.ndarray:
    """``parts`` back to back; one part as it is, read-only (a view of a held piece)."""
    if len(parts) == 1:
        view = parts[0].view()
        view.flags.writeable = False
        return view
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _runs(picked: list[tuple[ShardItems, int]]) -> list[tuple[ShardItems, int, int]]:
    """``picked`` as runs ``(items, lo, hi)``: items ``lo .. hi - 1`` of one piece, in order.

    A take asks for a source's items in its order, so most of a step's items
    of a piece are one run.
    """
    runs: list[tuple[ShardItems, int, int]] = []
    items, lo, hi = None, 0, 0
    for it, k in picked:
        if it is items and k == hi:
            hi += 1
            continue
        if items is not None:
            runs.append((items, lo, hi))
        items, lo, hi = it, k, k + 1
    if items is not None:
        runs.append((items, lo, hi))
    return runs


def _sorted_once(index: np.ndarray) -> np.ndarray:
    """``np.unique(index)`` by a sort and a comparison (its own calls cost more, here)."""
    index = np.sort(index)
    if len(index) > 1:
        index = index[np.concatenate(([True], index[1:] != index[:-1]))]
    return index


@dataclass
class Located:
    """Items of one shard found by arrays: item ``k[i]`` of ``pieces[which[i]]``, in order.

    What a take of many items of a shard finds (:meth:`HeldItems.locate`): its answer is
    then built by arrays, a few calls per piece the items lie in, not per run of them.
    """

    pieces: list[HeldPiece]
    which: np.ndarray  # int64: each item's piece
    k: np.ndarray  # int64: each item's index in its piece

    def runs(self) -> list[tuple[ShardItems, int, int]]:
        """The items as runs ``(piece items, lo, hi)`` of items next to each other."""
        which, k = self.which, self.k
        cuts = np.flatnonzero((which[1:] != which[:-1]) | (k[1:] != k[:-1] + 1)) + 1
        lo = np.concatenate(([0], cuts))
        hi = np.concatenate((cuts, [len(k)]))
        return [
            (self.pieces[q].items, a, a + n)
            for q, a, n in zip(which[lo].tolist(), k[lo].tolist(), (hi - lo).tolist())
        ]


def payload_of(taken: Located | list[tuple[ShardItems, int, int]]) -> dict[str, np.ndarray]:
    """What ``take`` answers for what :meth:`HeldItems.locate` found (see :func:`payload_of_runs`).

    Items found by arrays, of a text source, are copied by one compiled loop per piece
    they lie in (where numba imports): their lengths and starts by arrays, no object
    per item or run. Else, and for images and loss masks, by their runs.
    """
    if not isinstance(taken, Located):
        return payload_of_runs(taken)
    copy = copy_kernel()
    first = taken.pieces[0].items if taken.pieces else None
    if copy is None or first is None or first.mask is not None or first.pixels is not None:
        return payload_of_runs(taken.runs())
    which, k = taken.which, taken.k
    lengths = np.empty(len(k), dtype=np.int32)
    starts = np.empty(len(k), dtype=np.int64)
    hit = np.flatnonzero(np.bincount(which)).tolist()  # the pieces the items lie in
    # each piece's items: all of them where they lie in one piece
    parts = [
        (slice(None) if len(hit) == 1 else (which == q).nonzero()[0], taken.pieces[q].items)
        for q in hit
    ]
    for mine, items in parts:
        lengths[mine], starts[mine] = items.length[k[mine]], items.start[k[mine]]
    at = np.zeros(len(k), dtype=np.int64)
    lengths[:-1].cumsum(out=at[1:])
    tokens = scratch(int(at[-1]) + int(lengths[-1]) if len(k) else 0)  # gathered, dropped
    for mine, items in parts:
        s, n = starts[mine], lengths[mine]
        if len(s) and int(np.maximum.reduce(s + n)) > len(items.tokens):  # compiled: unchecked
            raise ValueError("a held item lies past its piece's tokens")
        copy(tokens, at[mine], items.tokens, s, n)
    return {"tokens": tokens, "lengths": lengths}


@dataclass
class HeldPiece:
    """Items ``base ..`` of a shard, held until released: one piece of a window, tokenized.

    (The piece's records, before they are tokenized, are a
    :class:`overlord.sources.window.Piece`.)
    """

    base: int
    items: ShardItems
    remaining: np.ndarray  # bool per item (one per item of the piece): not released yet
    left: int = -1  # how many are not released yet (counted from ``remaining`` when -1)

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = int(np.count_nonzero(self.remaining))


class HeldItems:
    """Published items by shard and piece, and the consumed ones (``start``: a cursor state)."""

    def __init__(self, start: dict[str, Any]):
        self.consumed_from(start)
        self.shards: dict[Position, list[HeldPiece]] = {}  # the open shards have an entry
        self.open: set[Position] = set()  # shards whose closing block is not published
        self.tokens = 0  # tokens of the items held
        self._released_ahead: dict[Position, list[int]] = {}  # releases of items not read
        # per shard: its pieces list, their number, their first indexes and sizes
        self._piece_starts: dict[Position, tuple[list[HeldPiece], int, np.ndarray, np.ndarray]] = {}

    def consumed_from(self, start: dict[str, Any]) -> None:
        """Items before ``start`` and in its ``skip`` runs are consumed."""
        self.floor: Key = (
            int(start.get("epoch", 0)),
            int(start.get("shard_pos", 0)),
            int(start.get("index", 0)),
        )
        self.skip = [tuple(int(x) for x in run) for run in start.get("skip", [])]

    def keep_mask(self, at: Position, base: int, n: int) -> np.ndarray:
        """Items ``base .. base + n`` of shard ``at`` not consumed yet."""
        keep = np.ones(n, dtype=bool)
        if at < self.floor[:2]:
            keep[:] = False
        elif at == self.floor[:2]:
            keep[: max(0, self.floor[2] - base)] = False
        for e, p, i, c in self.skip:
            if (e, p) == at:
                keep[max(0, i - base) : max(0, i + c - base)] = False
        ahead = self._released_ahead.get(at)
        if ahead:
            idx = np.asarray(ahead, dtype=np.int64)
            mine = (idx >= base) & (idx < base + n)
            keep[idx[mine] - base] = False
            if mine.all():
                del self._released_ahead[at]
            else:
                self._released_ahead[at] = idx[~mine].tolist()
        return keep

    def open_shard(self, at: Position) -> None:
        """Shard ``at`` is being published."""
        self.open.add(at)
        self.shards.setdefault(at, [])

    def close_shard(self, at: Position) -> None:
        """Shard ``at`` is published whole."""
        self.open.discard(at)
        if not self.shards.get(at):
            self.shards.pop(at, None)
            self._piece_starts.pop(at, None)

    def add(self, at: Position, base: int, items: ShardItems, keep: np.ndarray) -> int:
        """Hold the items of a piece in ``keep``; the tokens they hold."""
        tokens = int(items.length[keep].sum())
        if keep.any():
            self.shards.setdefault(at, []).append(HeldPiece(base, items, keep))
            self.tokens += tokens
        return tokens

    def take(self, keys: np.ndarray) -> tuple[list[tuple[ShardItems, int]], Key | None]:
        """The held ``(piece items, index in the piece)`` of every key (``(n, 3)``), in order.

        Or, as the second value, a key not held (released, or never read).
        """
        picked: list[tuple[ShardItems, int]] = []
        if len(keys) <= FEW:  # plain Python, the shard's pieces looked up once per shard
            at: Position | None = None
            pieces: list[HeldPiece] = []
            bases: list[int] = []
            for e, p, i in keys.tolist():
                if (e, p) != at:
                    at = (e, p)
                    pieces = self.shards.get(at) or []
                    bases = [q.base for q in pieces]
                j = bisect.bisect_right(bases, i) - 1
                k = i - bases[j] if j >= 0 else -1
                if k < 0 or k >= len(pieces[j].remaining) or not pieces[j].remaining[k]:
                    return [], (e, p, i)
                picked.append((pieces[j].items, k))
            return picked, None
        slots: list[Any] = [None] * len(keys)
        for at, rows in by_shard(keys):
            pieces, found = self.pick(at, keys[rows, 2])
            if (found < 0).any():
                return [], (*at, int(keys[rows[np.flatnonzero(found < 0)[0]], 2]))
            for r, q, i in zip(rows.tolist(), found.tolist(), keys[rows, 2].tolist()):
                slots[r] = (pieces[q].items, i - pieces[q].base)
        return slots, None

    def take_runs(self, keys: np.ndarray) -> tuple[list[tuple[ShardItems, int, int]], Key | None]:
        """:meth:`take` as runs ``(piece items, lo, hi)`` of items next to each other, in order."""
        taken, missing = self.locate(keys)
        return (taken.runs() if isinstance(taken, Located) else taken), missing

    def locate(
        self, keys: np.ndarray
    ) -> tuple[Located | list[tuple[ShardItems, int, int]], Key | None]:
        """The held items of ``keys``, in order, for :func:`payload_of`; or a key not held.

        Many keys of one shard (a step's items of a loader, most often) are found
        by arrays (:class:`Located`), without an entry per item; a few, or keys of
        several shards, as runs ``(piece items, lo, hi)`` of items next to each other.
        """
        if len(keys) > FEW:
            groups = by_shard(keys)
            if len(groups) == 1:
                at = groups[0][0]
                index = keys[:, 2]
                pieces, found = self.pick(at, index)
                if (found < 0).any():
                    return [], (*at, int(index[np.flatnonzero(found < 0)[0]]))
                return Located(pieces, found, index - self._starts(at, pieces)[0][found]), None
        picked, missing = self.take(keys)
        return _runs(picked), missing

    def _starts(self, at: Position, pieces: list[HeldPiece]) -> tuple[np.ndarray, np.ndarray]:
        """The first index and the size of each of shard ``at``'s ``pieces``, kept while they are.

        A shard's pieces only grow at its end, or are replaced by those left: the list and
        its length say whether the arrays kept are still its.
        """
        kept = self._piece_starts.get(at)
        if kept is None or kept[0] is not pieces or kept[1] != len(pieces):
            starts = np.array([p.base for p in pieces], dtype=np.int64)
            sizes = np.array([len(p.remaining) for p in pieces], dtype=np.int64)
            kept = self._piece_starts[at] = (pieces, len(pieces), starts, sizes)
        return kept[2], kept[3]

    def pick(self, at: Position, index: np.ndarray) -> tuple[list[HeldPiece], np.ndarray]:
        """The held pieces of shard ``at`` and, per item ``index``, its piece there (-1: not held).

        One search over the shard's pieces for every item of a take, not a
        search per item: a large step takes thousands.
        """
        pieces = self.shards.get(at) or []
        index = np.asarray(index, dtype=np.int64)
        if not pieces:
            return pieces, np.full(len(index), -1, dtype=np.int64)
        if len(index) <= FEW:
            bases = [p.base for p in pieces]
            found = []
            for i in index.tolist():
                q = bisect.bisect_right(bases, i) - 1
                held = q >= 0 and i - bases[q] < len(pieces[q].remaining)
                found.append(q if held and pieces[q].remaining[i - bases[q]] else -1)
            return pieces, np.array(found, dtype=np.int64)
        starts, sizes = self._starts(at, pieces)
        j = starts.searchsorted(index, side="right") - 1
        inside = (j >= 0) & (index < starts[j] + sizes[j])
        for q in np.bincount(j[inside]).nonzero()[0].tolist():  # and not released yet
            mine = (inside & (j == q)).nonzero()[0]
            inside[mine] = pieces[q].remaining[index[mine] - starts[q]]
        return pieces, np.where(inside, j, -1)

    def release(
        self, at: Position, index: list[int] | np.ndarray, read_before: int | None = None
    ) -> None:
        """Release items ``index`` of shard ``at``; those from ``read_before`` on are not read yet.

        A few items one by one; more by pieces, each piece's items with one
        numpy call whatever their number.
        """
        if len(index) <= FEW:  # plain Python over a few items, as a list
            few = index.tolist() if isinstance(index, np.ndarray) else list(index)
            if read_before is not None and any(i >= read_before for i in few):
                self._released_ahead.setdefault(at, []).extend(i for i in few if i >= read_before)
                few = [i for i in few if i < read_before]  # dropped when they are read
            pieces = self.shards.get(at) or []
            emptied = bool(pieces and few) and self._release_each(pieces, few)
        else:
            index = np.asarray(index, dtype=np.int64)
            if read_before is not None and index.max() >= read_before:
                ahead = index >= read_before
                self._released_ahead.setdefault(at, []).extend(index[ahead].tolist())
                index = index[~ahead]  # dropped when they are read
            pieces = self.shards.get(at) or []
            emptied = bool(pieces and len(index)) and self._release_by_piece(
                at, pieces, _sorted_once(index)
            )
        if emptied:
            self.shards[at] = [p for p in pieces if p.left]
            self._piece_starts.pop(at, None)  # (it holds the list it was made for)
            if not self.shards[at] and at not in self.open:
                del self.shards[at]

    def _release_each(self, pieces: list[HeldPiece], index: list[int]) -> bool:
        """Release items ``index`` of a shard's ``pieces``, one by one; whether a piece emptied."""
        bases = [p.base for p in pieces]
        emptied = False
        for i in index:
            j = bisect.bisect_right(bases, i) - 1
            if j < 0:
                continue
            piece, k = pieces[j], i - bases[j]
            if k < len(piece.remaining) and piece.remaining[k]:
                piece.remaining[k] = False
                piece.left -= 1
                self.tokens -= int(piece.items.length[k])
                emptied = emptied or not piece.left
        return emptied

    def _release_by_piece(self, at: Position, pieces: list[HeldPiece], index: np.ndarray) -> bool:
        """Release items ``index`` (sorted, unique), a piece at a time; whether a piece emptied."""
        j = self._starts(at, pieces)[0].searchsorted(index, side="right") - 1
        cuts = (j[1:] != j[:-1]).nonzero()[0] + 1  # index is sorted: so is j
        emptied = False
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(j)]):
            q = int(j[lo])
            if q < 0:
                continue
            piece = pieces[q]
            k = index[lo:hi] - piece.base
            k = k[k < len(piece.remaining)]
            k = k[piece.remaining[k]]
            if len(k):
                piece.remaining[k] = False
                piece.left -= len(k)
                self.tokens -= int(np.add.reduce(piece.items.length[k], dtype=np.int64))
                emptied = emptied or not piece.left
        return emptied

    def rewind(self, start: dict[str, Any], shards: list[Position]) -> Key | None:
        """Consume what ``start`` consumed; the first item it needs that was released, if any.

        ``shards`` are the published shards from ``start``'s on.
        """
        self.consumed_from(start)
        first = self.floor[:2]
        for at in [at for at in self.shards if at < first]:  # consumed
            for piece in list(self.shards.get(at, [])):
                self.release(at, (piece.base + np.flatnonzero(piece.remaining)).tolist())
        for at in [at for at in self._released_ahead if at < first]:
            del self._released_ahead[at]
        for at in shards:
            for piece in list(self.shards.get(at, [])):
                keep = self.keep_mask(at, piece.base, len(piece.items))
                lost = keep & ~piece.remaining
                if lost.any():
                    return (*at, piece.base + int(np.flatnonzero(lost)[0]))
                self.release(at, (piece.base + np.flatnonzero(piece.remaining & ~keep)).tolist())
        return None

    def counts(self) -> dict[str, int]:
        """Tokens, shards and pieces held."""
        return {
            "held_tokens": self.tokens,
            "held_shards": sum(bool(p) for p in self.shards.values()),
            "held_pieces": sum(len(p) for p in self.shards.values()),
        }

    def clear(self) -> None:
        """Hold nothing more."""
        self.shards.clear()
        self._piece_starts.clear()
        self.tokens = 0
