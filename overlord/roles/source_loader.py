"""SourceLoader: holds one source's state once, reads ahead, serves metadata and payloads.

Loader ``k`` of ``n`` for a source owns the shards at positions ``p`` with
``p % n == k`` in each epoch's shard order (:func:`overlord.plan.partition.owner`).
A shard streams: one thread reads it a *window* at a time
(:mod:`overlord.sources.shard`: a few blocks of records, permuted), and the
window's records are tokenized a *piece* at a time, ``loading.threads``
pieces at once (:mod:`overlord.roles.read_ahead`). The tokens are kept until a
DataConstructor takes them. The planner receives metadata only: one block per
piece, with each item's position and token count, and one closing block
(``last``) per shard.

Memory is bounded whatever the shards' sizes. The pieces held and those being
tokenized stay within a token budget derived from the plan (the steps planned
ahead plus the lookahead, times the source's peak share of the mixture),
divided among the loaders of the source's partition, so a source reads the
same distance ahead with one loader or many, and more threads add
throughput, not read-ahead. A piece's tokens are estimated from its text
bytes before it is tokenized (the source's measured tokens per byte).
Besides the budget a loader holds what is left of the window being cut (a
piece's text goes once it is cut) and at most one window read ahead, read
once the window being cut started on its last half (a shadow's: once all of
it started). A caller that waits for an item not published yet (the planner
in ``metadata``, a constructor in ``take``) lets one piece at a time past the
budget: the planner can never wait on a loader whose budget is full of items
it has planned but not released (see
:func:`overlord.plan.budget.token_budget`). A new loader reads ahead 1/32 of
its budget, or twice the tokens the planner took from it if more: at
start-up the pieces the first steps need are not slowed by every loader
filling its whole read-ahead at once. The rule is
:class:`~overlord.roles.read_ahead.ReadAhead`.

Payloads live until the planner *releases* them, when every rank has consumed
their step; ``take`` only reads. So a DataConstructor that is restarted, or a
call that is retried, can take the same items again, and a *shadow* (a hot
standby started with ``shadow=True``) that reads the same shards and receives
the same releases (a few steps later, in one call) holds what the primary
holds, and at most those few consumed steps' items more. When the primary dies,
the planner promotes the shadow: it starts serving metadata after the last
block the planner received, and constructors take from it instead. A loader
can also be *rewound* to a planner state (a restarted planner resumes there,
trainers rewind the job there): it serves again the metadata of every held
item from that point on; where an item the state needs was released already
(or never read: the loader started after it), it *seeks* in place: its
reader starts again at the state's shard, as a loader started at that state
would (the shard's consumed items are read and dropped), and what it held
goes. The process, its line indexes and its place in the pool stay.

Messages are plain dicts of numpy arrays and ints: no pickle is needed to
decode them.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.errors import LoaderError, OverlordError
from overlord.plan.budget import token_budget
from overlord.plan.partition import group_rows, owner
from overlord.plan.spec import Plan
from overlord.roles.api import SHARD_END as END
from overlord.roles.api import LoaderRole
from overlord.roles.held import (
    FEW,
    HeldItems,
    Key,
    Position,
    by_shard,
    metadata_block,
    payload_of,
)
from overlord.roles.read_ahead import LoaderSide, Outlet, ReadAhead, Reader, Task, Tokenized
from overlord.roles.read_stats import ReadStats, rss
from overlord.runtime import in_daemon_thread
from overlord.sources.catalog import SourceFiles
from overlord.sources.shard import ShardItems, shard_file
from overlord.sources.tokenizers import source_tokenizer

MAX_QUEUED_BLOCKS = 4096  # metadata blocks waiting for the planner
_NO_TOKENS = np.zeros(0, dtype=np.int32)


def _metadata_only(items: ShardItems) -> ShardItems:
    """``items`` without their payloads (tokens, pixels): what a loader of a dry run holds."""
    return dataclasses.replace(items, tokens=_NO_TOKENS, pixels=None)


@dataclass
class Progress:
    """How far a loader got in its source's order (guarded by the loader's lock).

    Keys are ``(epoch, shard_pos, index)``, in the source's order; an index of
    :data:`END` stands for a shard's closing block. The first shard the window
    thread has not started is the reader's
    (:attr:`overlord.roles.read_ahead.Reader.next`).
    """

    start: Position  # the shard it started from: its start state's
    send_from: Key  # the first key whose block is queued for the planner
    last: Key = (-1, -1, 0)  # every item of this loader before it is published
    # per open shard, the index its next published item has
    next_index: dict[Position, int] = field(default_factory=dict)
    served: int = 0  # tokens of the metadata the planner took: the ramp grows with it
    asked: int = 0  # callers waiting for an item not published yet: they lift the budget


def _last(keys: np.ndarray) -> tuple[int, int, int]:
    """The last of keys ``(n, 3)`` (epoch, shard position, index) in source order.

    >>> _last(np.array([[0, 2, 9], [1, 0, 3], [1, 0, 1]]))
    (1, 0, 3)
    """
    if len(keys) <= FEW:  # plain Python over a few
        e, p, i = max(keys.tolist())
    else:  # a step's many items of one loader: one sort of the keys, not a tuple each
        e, p, i = keys[np.lexsort(keys.T[::-1])[-1]].tolist()
    return e, p, i


class SourceLoader:
    """Reads one source's shards ahead and holds their tokens until taken.

    ``start`` is where to begin: ``{"epoch", "shard_pos", "index"}`` of the
    first item, and ``skip``, runs ``[epoch, shard_pos, index, count]`` of
    items after it that were already consumed (from a checkpoint). A
    ``shadow`` reads and holds the same items but serves no metadata until it
    is promoted. ``limit`` (``[epoch, shard_pos]``) ends the loader's shards
    there: another partition of the source reads from it on; ``first`` is
    where its partition begins (a seek goes no earlier).

    Its :attr:`reader` (:class:`~overlord.roles.read_ahead.Reader`) reads
    ahead; its :attr:`progress` says how far it got.
    """

    # calls served at once: the planner (which may wait for data) and constructors
    CONCURRENCY = 16

    def __init__(
        self,
        plan: Plan,
        files: SourceFiles,
        source: str,
        index: int,
        count: int,
        start: dict[str, Any] | None = None,
        keep_payloads: bool = True,
        shadow: bool = False,
        limit: list[int] | None = None,
        first: list[int] | None = None,
    ):
        self.keep_payloads = keep_payloads  # False: metadata only (``overlord plan``)
        self.plan = plan
        self.files = files  # the job's files, listed once when it started
        self.spec = next(s for s in self.plan.sources if s.name == source)
        self.source, self.index, self.count = source, index, count
        self.tokenizer = source_tokenizer(self.plan, self.spec)
        start = start or {}
        at: Position = (int(start.get("epoch", 0)), int(start.get("shard_pos", 0)))
        self._first: Position = (0, 0) if first is None else (int(first[0]), int(first[1]))
        self.progress = Progress(start=at, send_from=(*at, 0))
        self._held = HeldItems(start)  # what it holds, and what was consumed
        self._origin = start  # the state its reader started from: items it consumed were not read
        self._serving = not shadow  # queues metadata for the planner
        self._queue: deque[dict[str, Any]] = deque()
        self._lock = threading.Condition()
        self.reader = self._reader(at, threads=plan.loading.threads)
        if limit is not None:  # a partition's end: a re-partition started the next one there
            self.reader.limit = (int(limit[0]), int(limit[1]))
        self._read = ReadStats(self.reader.cache.retries)
        self.reader.start()

    def _reader(self, at: Position, threads: int) -> Reader:
        """A reader of this loader's shards from shard ``at`` on (not started)."""
        return Reader(
            self.plan,
            self.spec,
            self.files,
            self.tokenizer,
            at,
            self.files.owned(at, self.index, self.count),
            self._lock,
            ReadAhead(budget=token_budget(self.plan, self.count, self.source), threads=threads),
            Outlet(state=self._state, backlogged=self._backlogged, publish=self._publish),
            name=f"{self.source}-{self.index}",
        )

    # ---- the reader's outlet (lock held) ---------------------------------------------------

    def _state(self) -> LoaderSide:
        return LoaderSide(
            held=self._held.tokens,
            served=self.progress.served,
            asked=self.progress.asked,
            primary=self._serving,
            tokens_per_byte=self._read.tokens_per_byte,
        )

    def _backlogged(self) -> bool:
        return self._serving and len(self._queue) >= MAX_QUEUED_BLOCKS

    def _publish(self, task: Task, got: Tokenized | None) -> None:
        """Make a finished task's items (or a window's counts, or a shard's end) visible."""
        at = task.at
        name = self.files.at(at[0])[task.file_index].name
        if task.end:
            self._end_shard(at, task.file_index)
        elif got is None:
            assert task.window is not None
            self.progress.next_index.setdefault(at, 0)
            self._held.open_shard(at)
            self._read.window(name, task.window)
        else:
            self._add_piece(at, task, got[0], got[1], name)

    def _add_piece(
        self, at: Position, task: Task, items: ShardItems, cpu: float, name: str
    ) -> None:
        progress = self.progress
        base = progress.next_index.get(at, 0)
        n = len(items)
        progress.next_index[at] = base + n
        keep = self._held.keep_mask(at, base, n)
        # without payloads (a dry run) the items' metadata is held all the same: the
        # read-ahead budget counts it, and the planner's releases let it go
        self._held.add(at, base, items if self.keep_payloads else _metadata_only(items), keep)
        progress.last = (*at, base + n)
        if self._serving and (*at, base) >= progress.send_from:
            self._queue.append(metadata_block(at, task.file_index, base, items, keep))
        assert task.window is not None
        tokens = int(items.length[keep].sum())
        self._read.piece(name, task.window.number, task.lo, items, int(keep.sum()), tokens, cpu)

    def _end_shard(self, at: Position, file_index: int) -> None:
        progress = self.progress
        progress.last = (*at, END)
        progress.next_index.pop(at, None)
        self._held.close_shard(at)
        self._read.counts["shards"] += 1
        if self._serving and (*at, END) >= progress.send_from:
            self._queue.append(metadata_block(at, file_index, 0, None, None, last=True))

    def _published(self, first: Position) -> Iterator[tuple[Position, int]]:
        """Shards of this loader from ``first`` to the last one published, with file indexes."""
        start, last = self.progress.start, self.progress.last[:2]
        alone = [((0, 0), 0, self.count)]  # this loader's partition, as the only one
        for epoch in range(max(first[0], start[0]), last[0] + 1):
            files = self.files.at(epoch)
            lo = first[1] if epoch == first[0] else 0
            if epoch == start[0]:
                lo = max(lo, start[1])
            hi = last[1] + 1 if epoch == last[0] else len(files)
            for p in range(max(lo, 0), hi):
                if owner((epoch, p), alone) == self.index:
                    file = shard_file(self.plan, self.spec, files, epoch, p)
                    yield (epoch, p), files.index(file)

    # ---- calls ---------------------------------------------------------------------------

    def metadata(self, timeout: float) -> list[dict[str, Any]]:
        """Blocks of item metadata read since the last call; waits up to ``timeout`` for one.

        ``timeout`` 0: at once, what is queued, maybe nothing, and never an error (the
        pool asks a process's other loaders so, with the one it waits for; the error
        of a loader is raised when it is waited for).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            if timeout <= 0:
                return self._hand_over() if self._serving else []
            if not self._serving:
                raise LoaderError(
                    f"SourceLoader {self.source}[{self.index}] is a shadow: it serves metadata "
                    "only once promoted"
                )
            self._wait_asking(
                lambda: not self._queue and self.reader.error is None and not self.reader.closed,
                deadline,
                lambda: (
                    f"SourceLoader {self.source}[{self.index}] produced no data for "
                    f"{timeout:.0f} s (loading.timeout_s) while reading {self.reader.reading}: "
                    "check that the source's files can be read, or raise the timeout"
                ),
            )
            if self._queue:
                return self._hand_over()
            if self.reader.closed and self.reader.error is None:
                raise LoaderError(f"SourceLoader {self.source}[{self.index}] was closed")
            err = self.reader.error
        assert err is not None
        if isinstance(err, OverlordError):
            raise err
        raise LoaderError(
            f"SourceLoader {self.source}[{self.index}] failed: {type(err).__name__}: {err}"
        ) from err

    def _hand_over(self) -> list[dict[str, Any]]:
        """The queued blocks, now sent (lock held)."""
        out = list(self._queue)
        self._queue.clear()
        self.progress.served += sum(int(b["tokens"].sum()) for b in out)
        # the reader waits on room in the queue, or on a budget that grows with what the
        # planner took (while a new loader ramps up): else nothing changed for it
        if self.reader.waits_on == "queue" or self.reader.released_enough():
            self._lock.notify_all()
        return out

    def take(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The payloads of items ``[[epoch, shard_pos, index], ...]`` (kept until released).

        Their tokens (and, from an image source, images: :func:`~overlord.roles.held.payload`).
        """
        keys = np.asarray(keys, dtype=np.int64).reshape(-1, 3)
        with self._lock:
            if len(keys):  # the last key in source order read means every key is read
                e, p, i = _last(keys)
                if (e, p, i) >= self.progress.last:
                    self._wait_until_read((e, p, i))
            taken, missing = self._held.locate(keys)
            if missing is not None:
                e, p, i = missing
                raise LoaderError(
                    f"SourceLoader {self.source}[{self.index}] does not hold item "
                    f"(epoch {e}, shard {p}, index {i}): it was released (its step was "
                    "consumed) or never read"
                )
        return payload_of(taken)

    def _wait_until_read(self, key: Key) -> None:
        """Wait (lock held) until item ``key`` is read: a promoted shadow may lag its primary."""
        timeout = self.plan.loading.timeout_s
        self._wait_asking(
            lambda: (
                key >= self.progress.last and not self.reader.closed and self.reader.error is None
            ),
            time.monotonic() + timeout,
            lambda: (
                f"SourceLoader {self.source}[{self.index}] did not read item {key} within "
                f"{timeout:.0f} s (loading.timeout_s) while reading {self.reader.reading}"
            ),
        )

    def _wait_asking(
        self, waiting: Callable[[], bool], deadline: float, timed_out: Callable[[], str]
    ) -> None:
        """Wait (lock held) while ``waiting()``; past ``deadline`` raise ``timed_out()``.

        The caller needs an item this loader has not published: while it
        waits the reader may read past its budget (see
        :func:`overlord.plan.budget.token_budget`).
        """
        self.progress.asked += 1
        try:
            while waiting():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderError(timed_out())
                self._lock.notify_all()  # a reader held by the budget may read on now
                self._lock.wait(min(left, 0.5))
        finally:
            self.progress.asked -= 1

    def release(self, keys: np.ndarray) -> None:
        """Free items whose step every rank consumed. Idempotent; early for a lagging shadow."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1, 3)
        shards: list[tuple[Position, list[int] | np.ndarray]]
        if len(keys) <= FEW:  # a few items (a step of many sources): plain Python over them
            few: dict[Position, list[int]] = {}
            for e, p, i in keys.tolist():
                few.setdefault((e, p), []).append(i)
            shards = list(few.items())
        else:  # a step's items of a loader lie in a shard or two: grouped by arrays
            shards = [(at, group_rows(keys, rows)[:, 2]) for at, rows in by_shard(keys)]
        with self._lock:
            for at, index in shards:
                self._release_in(at, index)
            if self.reader.released_enough():  # else nothing waits on what was released
                self._lock.notify_all()

    def _release_in(self, at: Position, index: list[int] | np.ndarray) -> None:
        """Release items ``index`` of shard ``at`` (lock held)."""
        last = self.progress.last
        if at > last[:2]:
            self._held.release(at, index, 0)  # none read yet
        else:
            self._held.release(at, index, last[2] if at == last[:2] else None)

    def promote(self, after: list[int] | None) -> None:
        """Start serving metadata: every block after key ``after`` (``[epoch, shard_pos, i]``).

        Called on a shadow when its primary died; ``after`` is the end of the
        last block of this loader the planner received (``i`` is the block's
        ``stop``, or :data:`END` for a shard's closing block). None: none since
        the planner started, which is this loader's start (or the point it was
        rewound to).
        """
        with self._lock:
            self._serving = True
            if after is not None:
                e, p, i = (int(x) for x in after)
                self.progress.send_from = (e, p, i + 1) if i == END else (e, p, i)
            self._queue = deque(self._blocks_from(self.progress.send_from))
            self._lock.notify_all()
            self.reader.primary_changed()

    def _blocks_from(self, first: Key) -> list[dict[str, Any]]:
        """The blocks of held items from key ``first`` on, and the shards' closing blocks."""
        blocks = []
        last = self.progress.last
        for at, f in self._published(first[:2]):
            for piece in self._held.shards.get(at, []):
                if (*at, piece.base) >= first:
                    blocks.append(metadata_block(at, f, piece.base, piece.items, piece.remaining))
            if (*at, END) >= first and (at < last[:2] or last[2] == END):
                blocks.append(metadata_block(at, f, 0, None, None, last=True))
        return blocks

    def rewind(self, start: dict[str, Any], seek: bool = False) -> None:
        """Serve metadata again from planner state ``start`` (a source cursor's state).

        Items before ``start`` and in its ``skip`` runs were consumed: they are
        released (their releases may have been lost with a planner). Every
        other item this loader read is served again, so that the planner
        plans the same steps again. Where one of them was released already
        (``seek``: the planner released items the state needs; or found
        here), or was never read (the loader started after it), the loader
        seeks to the state instead (:meth:`_seek`).
        """
        with self._lock:
            first: Position = (int(start["epoch"]), int(start["shard_pos"]))
            lost = None
            if not seek and self._read_from(start):
                lost = self._held.rewind(start, [at for at, _ in self._published(first)])
            if seek or lost is not None or not self._read_from(start):
                self._seek(start)
                return
            self.progress.send_from = (*first, 0)
            if self._serving:
                self._queue = deque(self._blocks_from(self.progress.send_from))
            self._lock.notify_all()

    def _read_from(self, start: dict[str, Any]) -> bool:
        """Whether this loader read every item of its own that ``start`` needs (lock held).

        Its reader started from :attr:`_origin`: the items that state had
        consumed were never read, so each must be consumed in ``start`` too
        (or lie before this loader's partition).
        """
        origin = self._origin
        floor = tuple(int(origin.get(k, 0)) for k in ("epoch", "shard_pos", "index"))
        wanted = tuple(int(start[k]) for k in ("epoch", "shard_pos", "index"))
        if wanted < floor and floor > (*self._first, 0):
            return False
        runs = [[int(x) for x in run] for run in start.get("skip", [])]
        for e, p, i, c in ([int(x) for x in run] for run in origin.get("skip", [])):
            if (e, p, i + c) <= wanted:
                continue  # before the state's first item: consumed there too
            if not any([e, p] == r[:2] and r[2] <= i and i + c <= r[2] + r[3] for r in runs):
                return False
        return True

    def _seek(self, start: dict[str, Any]) -> None:
        """Read again from state ``start``'s shard: a new reader, what was held dropped (lock held).

        As a loader started at ``start`` would: the reader starts at the
        state's shard (or its partition's first, if later), and the items the
        state consumed are dropped as they are read. The old reader's threads
        end at their next wait; what they publish meanwhile is dropped, and
        its windows go once they end. Line indexes are kept: only the shards
        from the state's on are read again.
        """
        at = max((int(start["epoch"]), int(start["shard_pos"])), self._first)
        old = self.reader
        old.stop()
        self._held.clear()
        self._held = HeldItems(start)
        self._origin = start
        self._queue.clear()
        progress = self.progress
        progress.start, progress.send_from, progress.last = at, (*at, 0), (-1, -1, 0)
        progress.next_index = {}
        self.reader = self._reader(at, threads=old.policy.threads)
        self.reader.cache = old.cache  # line indexes of every epoch, and the retry count
        self.reader.limit, self.reader.frozen = old.limit, old.frozen
        self.reader.start()
        in_daemon_thread(old.join, self.plan.loading.timeout_s)  # it takes the lock to end
        self._lock.notify_all()

    def freeze(self) -> list[int] | None:
        """Start no new shard; the first shard not started, ``[epoch, shard_pos]``.

        The first half of a re-partition: once every loader of the source is
        frozen, the largest of their answers is a boundary none has read past.
        None: this loader owns no shard from here on.
        """
        nxt = self.reader.freeze()
        return None if nxt is None else list(nxt)

    def until(self, limit: list[int]) -> None:
        """Read on, but only the shards before ``limit``; the rest is another partition's."""
        boundary = (int(limit[0]), int(limit[1]))
        past = self.reader.until(boundary)
        if past is not None:
            raise LoaderError(
                f"SourceLoader {self.source}[{self.index}] started shard {past} "
                f"already, past the partition boundary {boundary}"
            )

    def set_threads(self, threads: int) -> None:
        """Tokenize ``threads`` pieces at once from now on (the autoscaler's finer knob)."""
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.reader.set_threads(threads)

    def pid(self) -> int:
        """The process this loader runs in (chaos tests kill it)."""
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        """What this loader did so far: shards, items, tokens, read time, records.

        The counts are :class:`~overlord.roles.read_stats.ReadStats`'s. ``epochs``
        is how many epochs of the source it has begun (from epoch 0: the epoch
        of the last shard it read, plus 1; an epoch is begun when its first
        shard of this loader is read, not when a trainer reaches it).
        """
        with self._lock:
            return {
                **self._read.as_dict(),
                "source": self.source,
                "loader": self.index,
                **self._held.counts(),
                "reads_in_flight": self.reader.reads_in_flight(),
                "shadow": not self._serving,
                "queued_blocks": len(self._queue),
                "waits_on": self.reader.waits_on,
                "threads": self.reader.policy.threads,
                "pid": os.getpid(),
                "done_reading": self.reader.done_reading(),
                "rss_bytes": rss(),
                "budget_tokens": self.reader.policy.budget,
                "epochs": self.progress.last[0] + 1,
            }

    def close(self) -> None:
        """Stop reading and free every held shard."""
        with self._lock:
            self.reader.stop()
            self._held.clear()
            self._queue.clear()
        self.reader.join(self.plan.loading.timeout_s)


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[LoaderRole] = SourceLoader
