"""The planner's view of one source: its loaders' blocks merged back into source order.

Items are identified by their position ``(epoch, shard_pos, index)``, which is
the source order itself: lexicographic order of positions is the order in
which the source yields them, whichever loader read them. The cursor keeps the
*pending* items (read, not yet placed in a step) in that order.

Its checkpoint is where the pending items start plus the runs of items after
that start which were already placed (a source may place a small item ahead of
a large one that did not fit, up to the plan's lookahead).

A quarantined source's cursor has a ``drop`` filter
(:mod:`overlord.roles.quarantine`): the items it names leave the pending
items, as blocks arrive and when an addition comes into force, and are kept
in ``dropped`` until the planner hands them back to their loaders.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from overlord.errors import LoaderError, SourceError
from overlord.plan.partition import Span, owner
from overlord.plan.step import TAKEN_ROWS
from overlord.roles.quarantine import Dropper

Key = tuple[int, int, int]
# the columns of the pending items, the rows of their array: an item's position (its key's
# three parts: epoch, shard_pos, index), then what take gives of it
_PENDING = TAKEN_ROWS
_KEY = _PENDING[:3]
_ROW = {c: r for r, c in enumerate(_PENDING)}
_FROM_BLOCK = ("index", "tokens", "row", "chunk", "patches")  # a block's arrays, per item
_FEW = 16  # items taken ahead of the first one left that are cut from the token list one by one


class SourceCursor:
    """Pending items of one source, fetched from its loaders on demand.

    A loader sends a shard as blocks of consecutive items (its pieces), then a
    closing block (``last``) after which the next shard is due.

    ``fetch(k)`` returns the new metadata blocks of loader slot ``k`` (waiting
    for one); ``shards(epoch)`` is how many shards that epoch of the source
    has; ``partitions()`` are the partitions of its order, whose owner (the
    loader pool) adds one when it re-partitions the source.
    """

    def __init__(
        self,
        name: str,
        shards: Callable[[int], int],
        fetch: Callable[[int], list[dict[str, Any]]],
        partitions: Callable[[], list[Span]],
        start: dict[str, Any] | None = None,
    ):
        self.name, self.shards, self.fetch = name, shards, fetch
        # partitions of the source's order: (first shard, first slot, loaders), by shard;
        # re-partitioning adds one (who reads a shard: overlord.plan.partition.owner)
        self.partitions = partitions
        self._blocks: dict[int, deque[dict[str, Any]]] = {}  # per slot
        start = start or {}
        self._expect = (int(start.get("epoch", 0)), int(start.get("shard_pos", 0)))
        # where the shard being received resumes: the end of its last piece received
        self._start_index = int(start.get("index", 0))
        self._full_epoch = self._expect[1] == 0 and int(start.get("index", 0)) == 0
        self._epoch_items = 0
        # pending items, in source order: tokens as a list (the selector reads it item by
        # item), and every column as a row of one int64 array (rows: _PENDING), a part per
        # block received, joined when taken: a take is then a slice of one array, not one
        # per column
        self.tokens: list[int] = []
        self._parts: list[np.ndarray] = []
        self._pending = np.zeros((len(_PENDING), 0), dtype=np.int64)
        # placed items that lie after the first pending one (kept for the checkpoint)
        self._placed_ahead: list[Key] = [
            (e, p, i + j) for e, p, i, c in start.get("skip", []) for j in range(c)
        ]
        # the quarantine's filter (None: nothing of this source is quarantined), and the
        # items it took out: (loader, key) arrays, until the planner collects them
        self.drop: Dropper | None = None
        self.dropped: list[tuple[np.ndarray, np.ndarray]] = []
        self._mark: CursorMark | None = None  # the last mark, while nothing moved the cursor

    def token_array(self) -> np.ndarray:
        """The pending items' tokens as an int64 array (``tokens``, without a conversion)."""
        return self._joined()[_ROW["tokens"]]

    def peek(self, i: int) -> int:
        """Tokens of the ``i``-th pending item."""
        while i >= len(self.tokens):
            self._fetch()
        return self.tokens[i]

    def _fetch(self) -> None:
        self._mark = None
        epoch, pos = self._expect
        k = self.loader_of(epoch, pos)
        queue = self._blocks.setdefault(k, deque())
        if not queue:
            queue.extend(self.fetch(k))  # never empty: a loader waits for a block or raises
        block = queue.popleft()
        got = (int(block["epoch"]), int(block["shard_pos"]))
        if got != (epoch, pos):
            raise LoaderError(
                f"loader {k} of '{self.name}' sent shard {got} where shard {(epoch, pos)} was "
                "due: the loaders and the planner disagree on the source's order"
            )
        if self.drop is not None:
            block = self._without_dropped(block, k)
        n = len(block["index"])
        self.tokens += block["tokens"].tolist()
        part = np.empty((len(_PENDING), n), dtype=np.int64)
        part[_ROW["epoch"]], part[_ROW["shard_pos"]] = epoch, pos
        part[_ROW["loader"]], part[_ROW["file_index"]] = k, int(block["file_index"])
        for c in _FROM_BLOCK:
            part[_ROW[c]] = block[c]
        self._parts.append(part)
        self._epoch_items += n
        if not block["last"]:  # a piece of the shard: more follow
            self._start_index = int(block["stop"])
            return
        pos += 1
        if pos == self.shards(epoch):
            if self._full_epoch and self._epoch_items == 0:
                raise SourceError(
                    self.name,
                    None,
                    None,
                    f"a whole epoch of its {pos} file(s) yielded no sample: every "
                    "record is bad (skipped), empty, dropped as longer than max_seq_len, "
                    "or quarantined",
                )
            epoch, pos = epoch + 1, 0
            self._full_epoch, self._epoch_items = True, 0
        self._expect = (epoch, pos)
        self._start_index = 0

    def _without_dropped(self, block: dict[str, Any], k: int) -> dict[str, Any]:
        """``block`` (of loader ``k``) without the items the quarantine drops."""
        assert self.drop is not None
        if not len(block["index"]):
            return block
        drop = self.drop(
            int(block["epoch"]), int(block["file_index"]), block["row"], block["chunk"]
        )
        if drop is None:
            return block
        index = block["index"][drop]
        at = np.array([block["epoch"], block["shard_pos"]], dtype=np.int64)
        keys = np.column_stack([np.broadcast_to(at, (len(index), 2)), index]).astype(np.int64)
        self.dropped.append((np.full(len(index), k, dtype=np.int64), keys))
        keep = ~drop
        return {
            **block,
            **{c: block[c][keep] for c in ("index", "tokens", "row", "chunk", "patches")},
        }

    def purge(self) -> None:
        """Take the items the quarantine drops out of the pending ones (an addition in force)."""
        if self.drop is None or not self.tokens:
            return
        self._mark = None
        cols = dict(zip(_PENDING, self._joined()))
        drop = np.zeros(len(self.tokens), dtype=bool)
        files = np.unique(np.stack([cols["epoch"], cols["file_index"]], axis=1), axis=0)
        for e, f in files.tolist():
            mine = (cols["epoch"] == e) & (cols["file_index"] == f)
            found = self.drop(e, f, cols["row"][mine], cols["chunk"][mine])
            if found is not None:
                drop[np.flatnonzero(mine)[found]] = True
        if not drop.any():
            return
        key = np.stack([cols[c][drop] for c in _KEY], axis=1)
        self.dropped.append((cols["loader"][drop], key))
        self._pending = self._pending[:, ~drop]
        self.tokens = self._pending[_ROW["tokens"]].tolist()
        self._behind()

    def loader_of(self, epoch: int, pos: int) -> int:
        """The loader that reads shard ``pos`` of epoch ``epoch``."""
        return owner((epoch, pos), self.partitions())

    def _joined(self) -> np.ndarray:
        """The pending items' columns (rows: :data:`_PENDING`), the blocks received joined in."""
        if self._parts:
            parts, self._parts = [self._pending, *self._parts], []
            self._pending = np.concatenate(parts, axis=1)
        return self._pending

    def take(self, indices: list[int] | np.ndarray) -> np.ndarray:
        """Remove pending items (by pending index) and return what the plan needs of them.

        One int64 array, a row per column of :data:`_PENDING` (the key's three
        parts first), its items in the order of ``indices``
        (:func:`overlord.plan.step.taken_columns` names the rows).
        """
        self._mark = None
        cols = self._joined()
        idx = np.asarray(indices, dtype=np.int64)
        asked = idx.tolist()
        n = len(self.tokens)
        # the first pending items (most takes) are read by a slice: a view, not a copy
        prefix = len(idx) <= n and asked == list(range(len(idx)))
        chosen = cols[:, : len(idx)] if prefix else cols[:, idx]
        ahead: list[int] = []  # the items taken after the first one left, in order
        if prefix:
            first_left = len(idx)
        else:  # a step takes a few of a source's items: plain Python over them
            taken = set(asked)
            first_left = 0
            while first_left in taken:  # the first pending item not taken (n: none is left)
                first_left += 1
            ahead = sorted(i for i in taken if i > first_left)
        if ahead:
            self._placed_ahead += [(e, p, i) for e, p, i in cols[: len(_KEY), ahead].T.tolist()]
            keep = np.ones(n - first_left, dtype=bool)
            keep[[i - first_left for i in ahead]] = False
            self._pending = cols[:, first_left:][:, keep]
            if len(ahead) <= _FEW:  # the pending tokens' list cut in place
                for i in reversed(ahead):
                    del self.tokens[i]
                del self.tokens[:first_left]
            else:
                self.tokens = self._pending[_ROW["tokens"]].tolist()
        else:  # every item before the first left was taken, none after it: a slice
            self._pending = cols[:, first_left:]
            del self.tokens[:first_left]  # in place: no copy of what stays pending
        self._behind()
        return chosen

    def _behind(self) -> None:
        """Forget the placed items that the first pending one has passed."""
        if not self._placed_ahead:
            return
        # placed items at or before the first pending one are behind the cursor now; with
        # nothing pending, those not yet received stay placed ahead (a cursor that starts
        # from a state holds its skip runs before the loaders send their shard again)
        ahead = self._placed_ahead
        ahead.sort()  # sorted but for the keys placed since: what is behind is a prefix
        start = self._first()
        if start is None:
            (e, p), i = self._expect, self._start_index
            del ahead[: bisect.bisect_left(ahead, (e, p, i))]
        else:
            del ahead[: bisect.bisect_right(ahead, start)]

    def _first(self) -> Key | None:
        """The key of the first pending item (None: nothing is pending)."""
        if not self.tokens:
            return None
        e, p, i = self._joined()[: len(_KEY), 0].tolist()
        return (e, p, i)

    def state(self) -> dict[str, Any]:
        """Where to restart this source: the first pending item and the runs placed after it."""
        return cursor_state(self.mark())

    def mark(self) -> CursorMark:
        """What :meth:`state` is built from, as it stands now (a few values, cheap to keep).

        The planner keeps one per source after every step; a state is built from
        it (:func:`cursor_state`) only when one is asked for. A source that gave
        no item and received no block since the last mark gives that mark again.
        """
        if self._mark is not None:
            return self._mark
        first = self._first()
        if first is None:
            (e, p), i = self._expect, self._start_index
            first = (e, p, i)
        self._mark = (first, tuple(self._placed_ahead))
        return self._mark


# a cursor's place: its first pending key (or the next it expects) and the keys placed after it
CursorMark = tuple[Key, tuple[Key, ...]]


def cursor_state(mark: CursorMark) -> dict[str, Any]:
    """The cursor state of a :meth:`SourceCursor.mark`: its first key and the runs placed after.

    >>> cursor_state(((0, 2, 5), ((0, 2, 7), (0, 2, 8), (0, 3, 0))))
    {'epoch': 0, 'shard_pos': 2, 'index': 5, 'skip': [[0, 2, 7, 2], [0, 3, 0, 1]]}
    """
    (e, p, i), placed = mark
    runs: list[list[int]] = []
    for ke, kp, ki in placed:
        if runs and runs[-1][:2] == [ke, kp] and runs[-1][2] + runs[-1][3] == ki:
            runs[-1][3] += 1
        else:
            runs.append([ke, kp, ki, 1])
    return {"epoch": e, "shard_pos": p, "index": i, "skip": runs}
