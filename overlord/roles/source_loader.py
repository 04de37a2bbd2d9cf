"""SourceLoader: holds one source's state once, reads ahead, serves metadata and payloads.

Loader ``k`` of ``n`` for a source owns the shards at positions ``p`` with ``p % n ==
k`` in each epoch's shard order. A shard streams: one thread reads it a *window* at a
time (:mod:`overlord.sources.shard`: a few blocks of records, permuted), and the
window's records are tokenized a *piece* at a time, ``loading.threads`` pieces at once.
The tokens are kept until a DataConstructor takes them. The planner receives metadata
only: one block per piece, with each item's position and token count, and one closing
block (``last``) per shard.

Memory is bounded whatever the shards' sizes. The pieces held and being tokenized stay
within a token budget from the plan (the steps planned ahead plus the lookahead, times
the source's peak share of the mixture), split among the source's loaders: a source
reads as far ahead with one loader as with many. A piece's tokens are estimated from its
text bytes (the source's measured tokens per byte). Besides the budget a loader holds
what is left of the window being cut (a piece's text goes once it is cut) and at most
one window ahead (see ``_room``). A caller waiting for an item not published yet (the
planner in ``metadata``, a constructor in ``take``) lets one piece at a time past the
budget, so the planner never waits on a loader full of items it planned but has not
released (:func:`overlord.plan.budget.token_budget`). A new loader reads ahead 1/32 of
its budget, or twice the tokens the planner took from it if more: at start-up every
loader does not fill its whole read-ahead at once.

Payloads live until the planner *releases* them, when every rank has consumed their
step; ``take`` only reads. So a DataConstructor that is restarted, or a call that is
retried, can take the same items again, and a *shadow* (a hot standby started with
``shadow=True``) that reads the same shards and receives the same releases holds exactly
what the primary holds. When the primary dies, the planner promotes the shadow: it
starts serving metadata after the last block the planner received, and constructors take
from it instead. A loader can also be *rewound* to a planner state (a restarted planner
resumes there): it serves again the metadata of every held item from that point on.

Messages are plain dicts of numpy arrays and ints: no pickle is needed to decode them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from overlord.errors import LoaderError, OverlordError
from overlord.plan.budget import token_budget
from overlord.plan.spec import Plan
from overlord.roles.api import SHARD_END as END
from overlord.roles.api import LoaderRole
from overlord.roles.held import HeldItems, Key, Position, metadata_block, payload
from overlord.roles.read_stats import ReadStats, rss
from overlord.runtime import in_daemon_thread
from overlord.sources.catalog import SourceFiles
from overlord.sources.shard import ShardIO, ShardItems, Window, cut_items, shard_file, shard_windows
from overlord.sources.tokenizers import source_tokenizer

MAX_QUEUED_BLOCKS = 4096  # metadata blocks waiting for the planner
CLOSE_WAIT_S = 10.0  # longest wait for reads in flight when a loader closes
RAMP = 32  # a new loader reads 1/RAMP of its budget ahead before the planner asks for more


@dataclass
class _Task:
    """What the reader publishes next, in order: a window's counts, a piece, or a shard's end."""

    at: Position
    file_index: int
    window: Window | None = None  # counts (no piece) or a piece of it
    lo: int = 0
    hi: int = 0
    piece: Future[tuple[ShardItems, float]] | None = None
    estimate: int = 0  # tokens the piece is expected to hold while it is tokenized
    end: bool = False

    def ready(self) -> bool:
        return self.piece is None or self.piece.done()


class SourceLoader:
    """Reads one source's shards ahead and holds their tokens until taken.

    ``start`` is where to begin: ``{"epoch", "shard_pos", "index"}`` of the first
    item, and ``skip``, runs ``[epoch, shard_pos, index, count]`` of items after it
    consumed already (from a checkpoint). A ``shadow`` reads and holds the same items
    but serves no metadata until promoted. ``limit`` (``[epoch, shard_pos]``) ends
    the loader's shards there: another partition of the source reads from it on.
    """

    CONCURRENCY = 16  # calls served at once: the planner (may wait for data), constructors

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
    ):
        self.keep_payloads = keep_payloads  # False: metadata only (``overlord plan``)
        self.plan, self.files = plan, files  # the job's files, listed once when it started
        self.spec = next(s for s in self.plan.sources if s.name == source)
        self.source, self.index, self.count = source, index, count
        self.tokenizer = source_tokenizer(self.plan, self.spec)
        start = start or {}
        self._start: Position = (int(start.get("epoch", 0)), int(start.get("shard_pos", 0)))
        self._budget = token_budget(self.plan, count, source)
        self._served = 0  # tokens of the metadata the planner took: the ramp grows with it
        self._asked = 0  # callers waiting for an item not published yet: lifts the budget
        self._held = HeldItems(start)  # what it holds, and what was consumed
        self._serving = not shadow  # queues metadata for the planner
        self._send_from: Key = (*self._start, 0)  # first key whose block is queued
        self._last: Key = (-1, -1, 0)  # every item of this loader before it is published
        # partitions: this loader's shards end before ``_limit`` (a re-partition set it);
        # ``_next`` is the first shard it has not started to read
        self._limit: Position | None = None if limit is None else (int(limit[0]), int(limit[1]))
        self._frozen = False
        self._next: Position | None = self._start  # None: it owns no shard from here on
        self._threads = self.plan.loading.threads
        self._cache = ShardIO(plan.loading.retries)  # line indexes (every epoch), retries

        self._lock = threading.Condition()
        self._windows: deque[Window | _Task | BaseException] = deque()  # read, not cut yet
        self._cut: tuple[Window, list[tuple[int, int]]] | None = None  # the window being cut
        self._pending: deque[_Task] = deque()  # in publishing order
        self._in_flight = 0  # estimated tokens of the pieces being tokenized
        self._queue: deque[dict[str, Any]] = deque()
        self._next_index: dict[Position, int] = {}  # index of the next item of an open shard
        self._error: BaseException | None = None
        self._closed = False
        self._reading = ""  # the shard the reader is on, for error messages
        self._waits_on: str | None = None  # what holds reading back: "budget" or "queue"
        self._read = ReadStats(self._cache.retries)
        self._threads_started = [
            threading.Thread(target=fn, name=f"overlord-{what}-{source}-{index}", daemon=True)
            for fn, what in ((self._read_windows, "window"), (self._run, "loader"))
        ]
        for t in self._threads_started:
            t.start()

    # ---- reading -------------------------------------------------------------------------

    def _read_windows(self) -> None:
        """The window thread: this loader's shards, a window at a time, one window ahead."""
        positions = self.files.owned(self._start, self.index, self.count)
        nxt = next(positions, None)
        try:
            while True:
                with self._lock:  # waits while frozen (a re-partition) or all it owns is read
                    while not self._closed and not self._may_read(nxt):
                        self._lock.wait(0.5)
                    if self._closed:
                        return
                    assert nxt is not None
                    at, nxt = nxt, next(positions, None)
                    self._next = nxt
                files = self.files.at(at[0])
                file = shard_file(self.plan, self.spec, files, *at)
                self._reading = file.name
                file_index = files.index(file)
                windows = shard_windows(self.plan, self.spec, files, *at, self._cache)
                while self._room() and (window := next(windows, None)) is not None:
                    if not self._serving:  # a standby's window waits compressed
                        window.pack()
                    self._put(window)
                if self._closed or not self._put(_Task(at, file_index, end=True)):
                    return
        except BaseException as e:  # published in order, after what was read before it
            self._put(e)

    def _room(self) -> bool:
        """Wait until the next window may be read; False once closed.

        None waits to be cut, and the window being cut started on its last half (a
        shadow's: all of it, held compressed): a loader holds about one window of text.
        """
        with self._lock:
            while not self._closed and (
                self._windows
                or (self._cut and self._cut[0].holds_over(self._cut[1], 0.5 * self._serving))
            ):
                self._lock.wait(0.5)
            return not self._closed

    def _put(self, what: Window | _Task | BaseException) -> bool:
        """Hand a window to the reader, waiting while one waits already; False once closed."""
        with self._lock:
            while self._windows and not self._closed and not isinstance(what, BaseException):
                self._lock.wait(0.5)
            self._windows.append(what)
            self._lock.notify_all()
            return not self._closed

    def _may_read(self, at: Position | None) -> bool:
        """Whether the window thread may start on shard ``at`` now (lock held)."""
        if at is None:
            return False  # this loader owns no shard from here on
        return not (self._closed or self._frozen) and (self._limit is None or at < self._limit)

    def _run(self) -> None:
        """The reader: starts pieces within the budget, publishes what is done, in order."""
        pending = self._pending
        try:
            while True:
                with self._lock:
                    task = None
                    while not self._closed:
                        if pending and pending[0].ready():
                            break
                        task = self._next_task()
                        if task is not None:
                            break
                        self._lock.wait(0.5)
                    if self._closed:
                        return
                if task is None:
                    self._publish(pending.popleft())
        except BaseException as e:  # handed to the planner by metadata()
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _next_task(self) -> _Task | None:
        """Start the next task if the budget and the threads allow it (lock held).

        A window read ahead is taken only when its first piece may start.
        """
        if self._cut is not None and not self._cut[1]:
            self._cut = None
        if self._cut is None:
            if not self._windows:
                return None
            got = self._windows[0]
            if isinstance(got, BaseException):
                if self._pending:
                    return None  # publish what came before it first
                raise got
            if isinstance(got, _Task):  # a shard's end
                self._windows.popleft()
                self._lock.notify_all()
                self._pending.append(got)
                return got
            pieces = list(got.cut)  # consumed as pieces start
            if pieces and not self._may_start(got, *pieces[0]):
                return None
            self._windows.popleft()
            self._lock.notify_all()
            self._cut = (got, pieces)
            task = _Task((got.epoch, got.shard_pos), got.file_index, got)  # its counts
            self._pending.append(task)
            return task
        window, pieces = self._cut
        lo, hi = pieces[0]
        estimate = self._may_start(window, lo, hi)
        if not estimate:
            return None
        pieces.pop(0)
        self._lock.notify_all()  # the window thread may read the next window now
        piece = in_daemon_thread(self._tokenize, window, lo, hi)
        piece.add_done_callback(self._wake)
        task = _Task((window.epoch, window.shard_pos), window.file_index, window, lo, hi, piece)
        task.estimate = estimate
        self._in_flight += estimate
        self._pending.append(task)
        return task

    def _may_start(self, window: Window, lo: int, hi: int) -> int:
        """The estimated tokens of a piece if the budget and the threads let it start, else 0."""
        estimate = max(1, int(window.text_bytes(lo, hi) * self._read.tokens_per_byte))
        pieces_in_flight = sum(t.piece is not None for t in self._pending)
        if pieces_in_flight >= self._threads:
            return 0
        held = self._held.tokens
        ramp = max(self._budget // RAMP, 2 * self._served)  # twice what the planner took
        if held + self._in_flight + estimate > min(self._budget, ramp) and not (
            (self._asked and not pieces_in_flight) or (not held and not self._in_flight)
        ):
            self._waits_on = "budget"
            return 0
        self._waits_on = None
        return estimate

    def _wake(self, _: Future[Any]) -> None:
        with self._lock:
            self._lock.notify_all()

    def _tokenize(self, window: Window, lo: int, hi: int) -> tuple[ShardItems, float]:
        """One piece's items, and the CPU seconds (this thread's) it took."""
        c0 = time.thread_time()
        items = cut_items(self.plan, self.tokenizer, window, lo, hi)
        window.release(lo, hi)  # a piece's text goes once cut: a window is held as it is left
        if window.released:  # and once all of it is gone, Arrow hands its pages back
            pa.default_memory_pool().release_unused()
        return items, time.thread_time() - c0

    def _publish(self, task: _Task) -> None:
        """Make a finished task's items (or a window's counts, or a shard's end) visible."""
        got = task.piece.result() if task.piece is not None else None
        with self._lock:
            while self._serving and len(self._queue) >= MAX_QUEUED_BLOCKS and not self._closed:
                self._waits_on = "queue"
                self._lock.wait(0.5)
            self._waits_on = None
            if self._closed:
                return
            at = task.at
            name = self.files.at(at[0])[task.file_index].name
            if task.end:
                self._end_shard(at, task.file_index)
            elif got is None:
                assert task.window is not None
                self._next_index.setdefault(at, 0)
                self._held.open_shard(at)
                self._read.window(name, task.window)
            else:
                self._in_flight -= task.estimate
                self._add_piece(at, task, got[0], got[1], name)
            self._lock.notify_all()

    def _add_piece(
        self, at: Position, task: _Task, items: ShardItems, cpu: float, name: str
    ) -> None:
        base = self._next_index.get(at, 0)
        n = len(items)
        self._next_index[at] = base + n
        keep = self._held.keep_mask(at, base, n)
        if self.keep_payloads:
            self._held.add(at, base, items, keep)
        self._last = (*at, base + n)
        if self._serving and (*at, base) >= self._send_from:
            self._queue.append(metadata_block(at, task.file_index, base, items, keep))
        assert task.window is not None
        tokens = int(items.length[keep].sum())
        self._read.piece(name, task.window.number, task.lo, items, int(keep.sum()), tokens, cpu)

    def _end_shard(self, at: Position, file_index: int) -> None:
        self._last = (*at, END)
        self._next_index.pop(at, None)
        self._held.close_shard(at)
        self._read.counts["shards"] += 1
        if self._serving and (*at, END) >= self._send_from:
            self._queue.append(metadata_block(at, file_index, 0, None, None, last=True))

    def _published(self, first: Position) -> Iterator[tuple[Position, int]]:
        """Shards of this loader from ``first`` to the last one published, with file indexes."""
        last = self._last[:2]
        for epoch in range(max(first[0], self._start[0]), last[0] + 1):
            files = self.files.at(epoch)
            lo = first[1] if epoch == first[0] else 0
            if epoch == self._start[0]:
                lo = max(lo, self._start[1])
            hi = last[1] + 1 if epoch == last[0] else len(files)
            for p in range(max(lo, 0), hi):
                if p % self.count == self.index:
                    file = shard_file(self.plan, self.spec, files, epoch, p)
                    yield (epoch, p), files.index(file)

    # ---- calls ---------------------------------------------------------------------------

    def metadata(self, timeout: float) -> list[dict[str, Any]]:
        """Blocks of item metadata read since the last call; waits up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if not self._serving:
                raise LoaderError(
                    f"SourceLoader {self.source}[{self.index}] is a shadow: it serves metadata "
                    "only once promoted"
                )
            self._wait_asking(
                lambda: not self._queue and self._error is None and not self._closed,
                deadline,
                lambda: (
                    f"SourceLoader {self.source}[{self.index}] produced no data for "
                    f"{timeout:.0f} s (loading.timeout_s) while reading {self._reading}: "
                    "check that the source's files can be read, or raise the timeout"
                ),
            )
            if self._queue:
                out = list(self._queue)
                self._queue.clear()
                self._served += sum(int(b["tokens"].sum()) for b in out)
                self._lock.notify_all()
                return out
            if self._closed and self._error is None:
                raise LoaderError(f"SourceLoader {self.source}[{self.index}] was closed")
            err = self._error
        assert err is not None
        if isinstance(err, OverlordError):
            raise err
        raise LoaderError(
            f"SourceLoader {self.source}[{self.index}] failed: {type(err).__name__}: {err}"
        ) from err

    def take(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The payloads of items ``[[epoch, shard_pos, index], ...]`` (kept until released).

        Their tokens (and, from an image source, images: :func:`~overlord.roles.held.payload`).
        """
        picked: list[tuple[ShardItems, int]] = []
        with self._lock:
            for e, p, i in np.asarray(keys, dtype=np.int64).tolist():
                if (e, p, i) >= self._last:
                    self._wait_until_read((e, p, i))
                piece = self._held.piece_of((e, p), i)
                if piece is None or not piece.remaining[i - piece.base]:
                    raise LoaderError(
                        f"SourceLoader {self.source}[{self.index}] does not hold item "
                        f"(epoch {e}, shard {p}, index {i}): it was released (its step was "
                        "consumed) or never read"
                    )
                picked.append((piece.items, i - piece.base))
        return payload(picked)

    def _wait_until_read(self, key: Key) -> None:
        """Wait (lock held) until item ``key`` is read: a promoted shadow may lag its primary."""
        timeout = self.plan.loading.timeout_s
        self._wait_asking(
            lambda: key >= self._last and not self._closed and self._error is None,
            time.monotonic() + timeout,
            lambda: (
                f"SourceLoader {self.source}[{self.index}] did not read item {key} within "
                f"{timeout:.0f} s (loading.timeout_s) while reading {self._reading}"
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
        self._asked += 1
        try:
            while waiting():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderError(timed_out())
                self._lock.notify_all()  # a reader held by the budget may read on now
                self._lock.wait(min(left, 0.5))
        finally:
            self._asked -= 1

    def release(self, keys: np.ndarray) -> None:
        """Free items whose step every rank consumed. Idempotent; early for a lagging shadow."""
        by_shard: dict[Position, list[int]] = {}
        for e, p, i in np.asarray(keys, dtype=np.int64).reshape(-1, 3).tolist():
            by_shard.setdefault((e, p), []).append(i)
        with self._lock:
            for at, index in by_shard.items():
                self._release_in(at, index)
            self._lock.notify_all()

    def _release_in(self, at: Position, index: list[int]) -> None:
        """Release items ``index`` of shard ``at`` (lock held)."""
        if at > self._last[:2]:
            self._held.release(at, index, 0)  # none read yet
        else:
            self._held.release(at, index, self._last[2] if at == self._last[:2] else None)

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
                self._send_from = (e, p, i + 1) if i == END else (e, p, i)
            self._queue = deque(self._blocks_from(self._send_from))
            self._lock.notify_all()

    def _blocks_from(self, first: Key) -> list[dict[str, Any]]:
        """The blocks of held items from key ``first`` on, and the shards' closing blocks."""
        blocks = []
        for at, f in self._published(first[:2]):
            for piece in self._held.shards.get(at, []):
                if (*at, piece.base) >= first:
                    blocks.append(metadata_block(at, f, piece.base, piece.items, piece.remaining))
            if (*at, END) >= first and (at < self._last[:2] or self._last[2] == END):
                blocks.append(metadata_block(at, f, 0, None, None, last=True))
        return blocks

    def rewind(self, start: dict[str, Any]) -> None:
        """Serve metadata again from planner state ``start`` (a source cursor's state).

        Items before ``start`` and in its ``skip`` runs were consumed: they are
        released (their releases may have been lost with a planner). Every
        other item this loader read is served again, so that a restarted
        planner re-plans the same steps.
        """
        with self._lock:
            first: Position = (int(start["epoch"]), int(start["shard_pos"]))
            lost = self._held.rewind(start, [at for at, _ in self._published(first)])
            if lost is not None:
                raise LoaderError(
                    f"SourceLoader {self.source}[{self.index}] cannot rewind to {start}: "
                    f"item {lost} was released already (the planner's journal is older than "
                    "what every rank consumed)"
                )
            self._send_from = (*first, 0)
            if self._serving:
                self._queue = deque(self._blocks_from(self._send_from))
            self._lock.notify_all()

    def freeze(self) -> list[int] | None:
        """Start no new shard; the first shard not started, ``[epoch, shard_pos]``.

        The first half of a re-partition: once every loader of the source is
        frozen, the largest of their answers is a boundary none has read past.
        None: this loader owns no shard from here on.
        """
        with self._lock:
            self._frozen = True
            return None if self._next is None else list(self._next)

    def until(self, limit: list[int]) -> None:
        """Read on, but only the shards before ``limit``; the rest is another partition's."""
        with self._lock:
            self._limit = (int(limit[0]), int(limit[1]))
            if self._next is not None and self._next > self._limit:
                raise LoaderError(
                    f"SourceLoader {self.source}[{self.index}] started shard {self._next} "
                    f"already, past the partition boundary {self._limit}"
                )
            self._frozen = False
            self._lock.notify_all()

    def set_threads(self, threads: int) -> None:
        """Tokenize ``threads`` pieces at once from now on (the autoscaler's finer knob)."""
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        with self._lock:
            self._threads = threads
            self._lock.notify_all()

    def pid(self) -> int:
        """The process this loader runs in (chaos tests kill it)."""
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        """What this loader did so far (:class:`~overlord.roles.read_stats.ReadStats`).

        ``epochs`` is how many epochs of the source it began: one is begun when its
        first shard of this loader is read, not when a trainer reaches it.
        """
        with self._lock:
            return {
                **self._read.as_dict(),
                "source": self.source,
                "loader": self.index,
                **self._held.counts(),
                "reads_in_flight": sum(t.piece is not None for t in self._pending),
                "shadow": not self._serving,
                "queued_blocks": len(self._queue),
                "waits_on": self._waits_on,
                "threads": self._threads,
                "pid": os.getpid(),
                "done_reading": self._next is None
                or (self._limit is not None and self._next >= self._limit),
                "rss_bytes": rss(),
                "budget_tokens": self._budget,
                "epochs": self._last[0] + 1,
            }

    def close(self) -> None:
        """Stop reading and free every held shard."""
        with self._lock:
            self._closed = True
            self._held.clear()
            self._queue.clear()
            self._lock.notify_all()
        # let reads in flight end (a process must not exit in the middle of Arrow's C++);
        # a read that hangs is a daemon thread and is left behind
        for thread in self._threads_started:  # a window being built ends within seconds
            thread.join(timeout=min(CLOSE_WAIT_S, self.plan.loading.timeout_s))
        wait(
            [t.piece for t in list(self._pending) if t.piece is not None],
            timeout=min(CLOSE_WAIT_S, self.plan.loading.timeout_s),
        )


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[LoaderRole] = SourceLoader
