"""SourceLoader: holds one source's state once, reads ahead, serves metadata and payloads.

Loader ``k`` of ``n`` for a source owns the shards at positions ``p`` with
``p % n == k`` in each epoch's shard order. A background thread reads them in
that order (``loading.threads`` shards at once), tokenizes them and keeps the
tokens until a DataConstructor takes them. The planner receives metadata only:
one block per shard with each item's position and token count.

Memory is bounded: the reader waits while the tokens it holds reach a budget
derived from the plan (the steps planned ahead plus the lookahead), divided
among the loaders of the source's partition, so a source reads the same
distance ahead with one loader or many. A caller that waits for this loader's
next shard (the planner in ``metadata``, a constructor in ``take``) lifts the
budget while it waits: the planner can never wait on a loader whose budget is
full of items it has planned but not released (see :func:`overlord.plan.budget.token_budget`).

Payloads live until the planner *releases* them, when every rank has consumed
their step; ``take`` only reads. So a DataConstructor that is restarted, or a
call that is retried, can take the same items again, and a *shadow* (a hot
standby started with ``shadow=True``) that reads the same shards and receives
the same releases holds exactly what the primary holds. When the primary dies,
the planner promotes the shadow: it starts serving metadata after the last
shard the planner received, and constructors take from it instead. A loader
can also be *rewound* to a planner state (a restarted planner resumes there):
it serves again the metadata of every held item from that point on.

Messages are plain dicts of numpy arrays and ints: no pickle is needed to
decode them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from overlord.errors import LoaderError, OverlordError
from overlord.plan.budget import token_budget
from overlord.plan.spec import Plan
from overlord.roles.api import LoaderRole
from overlord.roles.threads import in_daemon_thread
from overlord.sources.catalog import SourceFiles
from overlord.sources.shard import ShardItems, load_shard_items, shard_order
from overlord.sources.tokenizers import make_tokenizer

MAX_QUEUED_BLOCKS = 64
COST_EMA = 0.2  # weight of the newest shard in the per-token cost's moving average
CLOSE_WAIT_S = 10.0  # longest wait for reads in flight when a loader closes
# metadata columns of a block: key, ShardItems field, dtype
_BLOCK_COLUMNS = (
    ("tokens", "length", np.int32),
    ("row", "row", np.int64),
    ("chunk", "chunk", np.int32),
    ("patches", "patches", np.int32),
)


Position = tuple[int, int]  # (epoch, shard_pos): the order of a source's shards


class SourceLoader:
    """Reads one source's shards ahead and holds their tokens until taken.

    ``start`` is where to begin: ``{"epoch", "shard_pos", "index"}`` of the
    first item, and ``skip``, runs ``[epoch, shard_pos, index, count]`` of
    items after it that were already consumed (from a checkpoint). A
    ``shadow`` reads and holds the same items but serves no metadata until it
    is promoted. ``limit`` (``[epoch, shard_pos]``) ends the loader's shards
    there: another partition of the source reads from it on.
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
    ):
        self.keep_payloads = keep_payloads  # False: metadata only (``overlord plan``)
        self.plan, self.files = plan, files  # the job's files, listed once when it started
        self.spec = next(s for s in self.plan.sources if s.name == source)
        self.source, self.index, self.count = source, index, count
        self.tokenizer = make_tokenizer(self.plan.tokenizer, str(self.plan.base_dir))
        start = start or {}
        self._start: Position = (int(start.get("epoch", 0)), int(start.get("shard_pos", 0)))
        self._budget = token_budget(self.plan, count)
        self._asked = 0  # callers waiting for a shard not published yet: lifts the budget
        # items consumed already, dropped when their shard is read: before ``_floor``,
        # and the runs of ``_skip`` after it
        self._floor = (*self._start, int(start.get("index", 0)))
        self._skip = [tuple(int(x) for x in run) for run in start.get("skip", [])]
        self._released_ahead: dict[Position, list[int]] = {}  # a lagging shadow's releases
        self._serving = not shadow  # queues metadata for the planner
        self._send_from: Position = self._start  # first shard whose metadata is queued
        self._last: Position = (-1, -1)  # the last shard published
        # partitions: this loader's shards end before ``_limit`` (a re-partition set it);
        # ``_next`` is the first shard it has not started to read
        self._limit: Position | None = None if limit is None else (int(limit[0]), int(limit[1]))
        self._frozen = False
        self._next: Position | None = self._start  # None: it owns no shard from here on
        self._threads = self.plan.loading.threads
        self._pending: deque[tuple[Position, Future[tuple[ShardItems, float, float]]]] = deque()

        self._lock = threading.Condition()
        self._queue: deque[dict[str, Any]] = deque()
        self._held: dict[tuple[int, int], tuple[ShardItems, np.ndarray]] = {}
        self._held_tokens = 0
        self._error: BaseException | None = None
        self._closed = False
        self._reading = ""  # the shard the reader waits for, for error messages
        self._waits_on: str | None = None  # what holds a read shard back: "budget" or "queue"
        # records, empty, skipped and dropped count each file once (the first time this loader
        # reads it), not once per epoch: how many of the source's records are what
        self._stats = {
            "shards": 0,
            "items": 0,
            "tokens": 0,
            "read_s": 0.0,
            "records": 0,
            "empty": 0,
            "skipped": 0,
        }
        self._cost: dict[str, float] = {}
        self._skipped: list[str] = []
        self._dropped = 0
        self._counted: set[str] = set()  # files whose records are counted (once, not per epoch)
        self._thread = threading.Thread(
            target=self._run, name=f"overlord-loader-{source}-{index}", daemon=True
        )
        self._thread.start()

    # ---- reader thread -------------------------------------------------------------------

    def _positions(self) -> Iterator[Position]:
        """The shards this loader reads, in source order; ends if no later epoch has one."""
        epoch, pos = self._start
        last_list = self.files.lists[-1][0]
        while True:
            n = len(self.files.at(epoch))
            for p in range(pos, n):
                if p % self.count == self.index:
                    yield epoch, p
            if epoch >= last_list and self.index >= n:
                return  # more loaders than shards: this one owns none from here on
            epoch, pos = epoch + 1, 0

    def _load(self, epoch: int, pos: int) -> tuple[ShardItems, float, float]:
        """One shard's items, the wall seconds and the CPU seconds (this thread's) it took."""
        t0, c0 = time.perf_counter(), time.thread_time()
        files = self.files.at(epoch)
        items = load_shard_items(self.plan, self.spec, files, self.tokenizer, epoch, pos)
        # the shard's text is gone; hand Arrow's freed pages back instead of keeping them
        pa.default_memory_pool().release_unused()
        return items, time.perf_counter() - t0, time.thread_time() - c0

    def _keep_mask(self, at: Position, n: int) -> np.ndarray:
        """Items of shard ``at`` not consumed yet (per the floor, skip runs, releases)."""
        keep = np.ones(n, dtype=bool)
        floor_at, floor_index = self._floor[:2], self._floor[2]
        if at < floor_at:
            keep[:] = False
        elif at == floor_at:
            keep[:floor_index] = False
        for e, p, i, c in self._skip:
            if (e, p) == at:
                keep[i : i + c] = False
        ahead = self._released_ahead.pop(at, None)
        if ahead:
            keep[np.asarray(ahead, dtype=np.int64)] = False
        return keep

    def _run(self) -> None:
        positions = self._positions()
        nxt = next(positions, None)
        pending = self._pending
        try:
            while not self._closed:
                with self._lock:
                    # frozen (a re-partition is choosing its boundary), or every shard it
                    # owns is read: wait for until() or close()
                    while not self._closed and not pending and not self._may_read(nxt):
                        self._lock.wait(0.5)
                nxt = self._submit(pending, positions, nxt)
                if not pending:
                    continue
                (epoch, pos), fut = pending.popleft()
                files = self.files.at(epoch)
                self._reading = files[
                    shard_order(self.plan.seed, self.source, epoch, len(files))[pos]
                ].name
                items, seconds, cpu = fut.result()
                self._publish(items, seconds, cpu)
        except BaseException as e:  # handed to the planner by metadata()
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _submit(
        self,
        pending: deque[tuple[Position, Future[tuple[ShardItems, float, float]]]],
        positions: Iterator[Position],
        nxt: Position | None,
    ) -> Position | None:
        """Start reading shards until ``threads`` are in flight; the next shard to start."""
        with self._lock:
            while nxt is not None and self._may_read(nxt) and len(pending) < self._threads:
                pending.append((nxt, in_daemon_thread(self._load, *nxt)))
                nxt = next(positions, None)
            self._next = nxt
        return nxt

    def _may_read(self, at: Position | None) -> bool:
        """Whether the reader may start on shard ``at`` now (lock held)."""
        if at is None:
            return False  # this loader owns no shard from here on
        return not (self._closed or self._frozen) and (self._limit is None or at < self._limit)

    def _publish(self, items: ShardItems, seconds: float, cpu: float) -> None:
        at = (items.epoch, items.shard_pos)
        with self._lock:
            while not self._closed:
                if self._held_tokens >= self._budget and not self._asked:
                    self._waits_on = "budget"
                elif self._serving and len(self._queue) >= MAX_QUEUED_BLOCKS:
                    self._waits_on = "queue"
                else:
                    break
                self._lock.wait(0.5)
            self._waits_on = None
            if self._closed:
                return
            keep = self._keep_mask(at, len(items))
            idx = np.flatnonzero(keep)
            tokens = int(items.length[idx].sum())
            if len(idx) and self.keep_payloads:
                self._held[at] = (items, keep)
                self._held_tokens += tokens
            self._last = at
            if self._serving and at >= self._send_from:
                self._queue.append(self._block(at, items.file_index, items, keep))
            s = self._stats
            s["shards"] += 1
            s["items"] += len(idx)
            s["tokens"] += tokens
            s["read_s"] += seconds
            # moving averages of what a token and a sample cost to read, decode and tokenize
            # (the autoscaler's measure); over every item of the shard, kept or not
            n_tok, n_items = max(1, int(items.length.sum())), max(1, len(items))
            for key, value in (
                ("s_per_token", cpu / n_tok),
                ("s_per_sample", cpu / n_items),
            ):
                old = self._cost.get(key)
                self._cost[key] = value if old is None else old + COST_EMA * (value - old)
            # by name: a file's index in the list can change when a later epoch lists more files
            name = self.files.at(items.epoch)[items.file_index].name
            if name not in self._counted:
                self._counted.add(name)
                s["records"] += items.records
                s["empty"] += items.empty
                s["skipped"] += len(items.skipped)
                self._skipped += [str(e) for e in items.skipped[: max(0, 20 - len(self._skipped))]]
                self._dropped += items.dropped
            self._lock.notify_all()

    @staticmethod
    def _block(
        at: Position, file_index: int, items: ShardItems | None, keep: np.ndarray | None
    ) -> dict[str, Any]:
        """The metadata of shard ``at``'s items in ``keep`` (none without items)."""
        idx = np.flatnonzero(keep) if keep is not None else np.zeros(0, dtype=np.int64)
        block: dict[str, Any] = {
            "epoch": at[0],
            "shard_pos": at[1],
            "file_index": file_index,
            "index": idx.astype(np.int64),
        }
        for key, attr, dtype in _BLOCK_COLUMNS:
            column = getattr(items, attr) if items is not None else np.zeros(0, dtype=dtype)
            block[key] = column[idx]
        return block

    def _published(self, first: Position) -> Iterator[tuple[Position, int]]:
        """Shards of this loader from ``first`` to the last one published, with file indexes."""
        for epoch in range(max(first[0], self._start[0]), self._last[0] + 1):
            n = len(self.files.at(epoch))
            order = shard_order(self.plan.seed, self.source, epoch, n)
            lo = first[1] if epoch == first[0] else 0
            if epoch == self._start[0]:
                lo = max(lo, self._start[1])
            hi = self._last[1] + 1 if epoch == self._last[0] else n
            for p in range(max(lo, 0), hi):
                if p % self.count == self.index:
                    yield (epoch, p), int(order[p])

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
        """The tokens of items ``[[epoch, shard_pos, index], ...]`` (kept until released)."""
        parts = []
        lengths = np.empty(len(keys), dtype=np.int32)
        with self._lock:
            for j, (e, p, i) in enumerate(np.asarray(keys, dtype=np.int64).tolist()):
                if (e, p) > self._last:
                    self._wait_until_read((e, p))
                entry = self._held.get((e, p))
                if entry is None or not entry[1][i]:
                    raise LoaderError(
                        f"SourceLoader {self.source}[{self.index}] does not hold item "
                        f"(epoch {e}, shard {p}, index {i}): it was released (its step was "
                        "consumed) or never read"
                    )
                items = entry[0]
                s, n = int(items.start[i]), int(items.length[i])
                parts.append(items.tokens[s : s + n])
                lengths[j] = n
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return {"tokens": tokens, "lengths": lengths}

    def _wait_until_read(self, at: Position) -> None:
        """Wait (lock held) until shard ``at`` is read: a promoted shadow may lag its primary."""
        timeout = self.plan.loading.timeout_s
        self._wait_asking(
            lambda: at > self._last and not self._closed and self._error is None,
            time.monotonic() + timeout,
            lambda: (
                f"SourceLoader {self.source}[{self.index}] did not read shard {at} within "
                f"{timeout:.0f} s (loading.timeout_s) while reading {self._reading}"
            ),
        )

    def _wait_asking(
        self, waiting: Callable[[], bool], deadline: float, timed_out: Callable[[], str]
    ) -> None:
        """Wait (lock held) while ``waiting()``; past ``deadline`` raise ``timed_out()``.

        The caller needs a shard this loader has not published: while it waits
        the reader may publish past its budget (see :func:`overlord.plan.budget.token_budget`).
        """
        self._asked += 1
        try:
            while waiting():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderError(timed_out())
                self._lock.notify_all()  # a reader held by the budget may publish now
                self._lock.wait(min(left, 0.5))
        finally:
            self._asked -= 1

    def release(self, keys: np.ndarray) -> None:
        """Free items whose step every rank consumed. Idempotent; early for a lagging shadow."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1, 3)
        with self._lock:
            if len(keys):
                order = np.lexsort((keys[:, 1], keys[:, 0]))  # by shard, one pass per shard
                keys = keys[order]
                cut = np.flatnonzero(np.any(np.diff(keys[:, :2], axis=0) != 0, axis=1)) + 1
                for part in np.split(keys, cut):
                    self._release_in((int(part[0, 0]), int(part[0, 1])), part[:, 2])
            self._lock.notify_all()

    def _release_in(self, at: Position, index: np.ndarray) -> None:
        """Release items ``index`` of shard ``at`` (lock held)."""
        entry = self._held.get(at)
        if entry is None:
            if at > self._last:  # not read yet: dropped when it is
                self._released_ahead.setdefault(at, []).extend(index.tolist())
            return
        items, remaining = entry
        freed = index[remaining[index]]
        remaining[freed] = False
        self._held_tokens -= int(items.length[freed].sum())
        if not remaining.any():
            del self._held[at]

    def promote(self, after: list[int] | None) -> None:
        """Start serving metadata: every shard after ``after`` (``[epoch, shard_pos]``).

        Called on a shadow when its primary died; ``after`` is the last shard of
        this loader the planner received. None: none since the planner started,
        which is this loader's start (or the point it was rewound to).
        """
        with self._lock:
            self._serving = True
            if after is not None:
                self._send_from = (int(after[0]), int(after[1]) + 1)
            self._queue = deque(
                self._block(at, f, *self._held.get(at, (None, None)))
                for at, f in self._published(self._send_from)
            )
            self._lock.notify_all()

    def rewind(self, start: dict[str, Any]) -> None:
        """Serve metadata again from planner state ``start`` (a source cursor's state).

        Items before ``start`` and in its ``skip`` runs were consumed: they are
        released (their releases may have been lost with a planner). Every
        other item this loader read is served again, so that a restarted
        planner re-plans the same steps.
        """
        with self._lock:
            self._floor = (int(start["epoch"]), int(start["shard_pos"]), int(start["index"]))
            self._skip = [tuple(int(x) for x in run) for run in start.get("skip", [])]
            first: Position = self._floor[:2]
            for at in [at for at in self._held if at < first]:  # consumed
                self._release_in(at, np.flatnonzero(self._held[at][1]))
            for at in [at for at in self._released_ahead if at < first]:
                del self._released_ahead[at]
            blocks = []
            for at, f in self._published(first):
                entry = self._held.get(at)
                if entry is None:  # every item consumed (or none kept)
                    blocks.append(self._block(at, f, None, None))
                    continue
                items, remaining = entry
                keep = self._keep_mask(at, len(items))
                lost = keep & ~remaining
                if lost.any():
                    raise LoaderError(
                        f"SourceLoader {self.source}[{self.index}] cannot rewind to {start}: "
                        f"item {(*at, int(np.flatnonzero(lost)[0]))} was released already "
                        "(the planner's journal is older than what every rank consumed)"
                    )
                self._release_in(at, np.flatnonzero(remaining & ~keep))
                blocks.append(self._block(at, f, items, keep))
            self._send_from = first
            if self._serving:
                self._queue = deque(blocks)
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
        """Read ``threads`` shards at once from now on (the autoscaler's finer knob)."""
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        with self._lock:
            self._threads = threads
            self._lock.notify_all()

    def pid(self) -> int:
        """The process this loader runs in (chaos tests kill it)."""
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        """What this loader did so far: shards, items, tokens, read time, records.

        ``records`` (every record of the files it read: good, empty and bad),
        ``empty`` (blank texts, not samples), ``skipped`` (bad records, under
        ``on_error: skip``) and ``dropped`` (too long, ``long_docs: drop``)
        count each file once, the first time this loader reads it, whatever
        the epochs; ``epochs`` is how many epochs of the source it has begun
        (counted from the source's epoch 0: the epoch of the last shard it
        read, plus 1; read-ahead included, so an epoch is begun when its first
        shard of this loader is read, not when a trainer reaches it).
        """
        with self._lock:
            return {
                **self._stats,
                "source": self.source,
                "loader": self.index,
                "held_tokens": self._held_tokens,
                "held_shards": len(self._held),
                "shadow": not self._serving,
                "queued_blocks": len(self._queue),
                "waits_on": self._waits_on,
                "threads": self._threads,
                "pid": os.getpid(),
                "done_reading": self._next is None
                or (self._limit is not None and self._next >= self._limit),
                "cpu_s_per_token": self._cost.get("s_per_token", float("nan")),
                "cpu_s_per_sample": self._cost.get("s_per_sample", float("nan")),
                "rss_bytes": _rss(),
                "budget_tokens": self._budget,
                "dropped": self._dropped,
                "epochs": self._last[0] + 1,
                "skipped_examples": list(self._skipped),
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
        self._thread.join(timeout=2)
        wait(
            [f for _, f in list(self._pending)],
            timeout=min(CLOSE_WAIT_S, self.plan.loading.timeout_s),
        )


def _rss() -> int:
    """Resident memory of this process (the loader's, when it has a process of its own)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[LoaderRole] = SourceLoader
