"""SourceLoader: holds one source's state once, reads ahead, serves metadata and payloads.

Loader ``k`` of ``n`` for a source owns the shards at positions ``p`` with
``p % n == k`` in each epoch's shard order. A background thread reads them in
that order (``loading.threads`` shards at once), tokenizes them and keeps the
tokens until a DataConstructor takes them. The planner receives metadata only:
one block per shard with each item's position and token count.

Memory is bounded: the reader waits while the tokens it holds reach a budget
derived from the plan (the steps planned ahead plus the lookahead), so at most
that budget plus the shards being read are in memory.

Messages are plain dicts of numpy arrays and ints: no pickle is needed to
decode them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from overlord.errors import LoaderError, OverlordError
from overlord.plan.spec import Plan, validate_plan
from overlord.sources.files import resolve_files
from overlord.sources.shard import ShardItems, load_shard_items, shard_order
from overlord.sources.tokenizers import make_tokenizer

MAX_QUEUED_BLOCKS = 64


def token_budget(plan: Plan) -> int:
    """Tokens one loader may hold: what the planner can ask of it before anything is taken."""
    b = plan.batch
    return (b.prefetch_steps + 2) * b.tokens_per_step + b.lookahead * b.max_seq_len


class SourceLoader:
    """Reads one source's shards ahead and holds their tokens until taken.

    ``start`` is where to begin: ``{"epoch", "shard_pos", "index"}`` of the
    first item, and ``skip``, runs ``[epoch, shard_pos, index, count]`` of
    items after it that were already consumed (from a checkpoint).
    """

    def __init__(
        self,
        plan_data: dict[str, Any],
        base_dir: str,
        source: str,
        index: int,
        count: int,
        start: dict[str, Any] | None = None,
        keep_payloads: bool = True,
    ):
        self.keep_payloads = keep_payloads  # False: metadata only (``overlord plan``)
        self.plan = validate_plan(plan_data, base_dir=base_dir)
        self.spec = next(s for s in self.plan.sources if s.name == source)
        self.source, self.index, self.count = source, index, count
        self.shards = resolve_files(self.spec, self.plan.base_dir)
        self.tokenizer = make_tokenizer(self.plan.tokenizer, str(self.plan.base_dir))
        start = start or {}
        self._start = (int(start.get("epoch", 0)), int(start.get("shard_pos", 0)))
        self._start_index = int(start.get("index", 0))
        self._skip = [tuple(int(x) for x in run) for run in start.get("skip", [])]
        self._budget = token_budget(self.plan)

        self._lock = threading.Condition()
        self._queue: deque[dict[str, Any]] = deque()
        self._held: dict[tuple[int, int], tuple[ShardItems, np.ndarray]] = {}
        self._held_tokens = 0
        self._error: BaseException | None = None
        self._closed = False
        self._reading = ""  # the shard the reader waits for, for error messages
        self._stats = {"shards": 0, "items": 0, "tokens": 0, "read_s": 0.0, "skipped": 0}
        self._skipped: list[str] = []
        self._dropped = 0
        self._counted: set[int] = set()  # files whose bad records are counted (once, not per epoch)
        self._thread = threading.Thread(
            target=self._run, name=f"overlord-loader-{source}-{index}", daemon=True
        )
        self._thread.start()

    # ---- reader thread -------------------------------------------------------------------

    def _positions(self) -> Iterator[tuple[int, int]]:
        epoch, pos = self._start
        n = len(self.shards)
        while True:
            for p in range(pos, n):
                if p % self.count == self.index:
                    yield epoch, p
            epoch, pos = epoch + 1, 0

    def _load(self, epoch: int, pos: int) -> tuple[ShardItems, float]:
        t0 = time.perf_counter()
        items = load_shard_items(self.plan, self.spec, self.shards, self.tokenizer, epoch, pos)
        # the shard's text is gone; hand Arrow's freed pages back instead of keeping them
        pa.default_memory_pool().release_unused()
        return items, time.perf_counter() - t0

    def _keep_mask(self, items: ShardItems) -> np.ndarray:
        keep = np.ones(len(items), dtype=bool)
        if (items.epoch, items.shard_pos) == self._start:
            keep[: self._start_index] = False
        for e, p, i, c in self._skip:
            if (e, p) == (items.epoch, items.shard_pos):
                keep[i : i + c] = False
        return keep

    def _run(self) -> None:
        if self.index >= len(self.shards):
            # more loaders than shards: this one owns none, and waits to be closed
            with self._lock:
                while not self._closed:
                    self._lock.wait(0.5)
            return
        positions = self._positions()
        pending: deque[tuple[tuple[int, int], Future[tuple[ShardItems, float]]]] = deque()
        with ThreadPoolExecutor(self.plan.loading.threads) as pool:
            try:
                while not self._closed:
                    while len(pending) < self.plan.loading.threads:
                        at = next(positions)
                        pending.append((at, pool.submit(self._load, *at)))
                    (epoch, pos), fut = pending.popleft()
                    order = shard_order(self.plan.seed, self.source, epoch, len(self.shards))
                    file_index = order[pos]
                    self._reading = self.shards[file_index].name
                    items, seconds = fut.result()
                    self._publish(items, seconds)
            except BaseException as e:  # handed to the planner by metadata()
                with self._lock:
                    self._error = e
                    self._lock.notify_all()
            finally:
                for _, f in pending:
                    f.cancel()

    def _publish(self, items: ShardItems, seconds: float) -> None:
        keep = self._keep_mask(items)
        idx = np.flatnonzero(keep)
        tokens = int(items.length[idx].sum())
        block = {
            "epoch": items.epoch,
            "shard_pos": items.shard_pos,
            "file_index": items.file_index,
            "index": idx.astype(np.int64),
            "tokens": items.length[idx],
            "row": items.row[idx],
            "chunk": items.chunk[idx],
            "patches": items.patches[idx],
        }
        with self._lock:
            while not self._closed and (
                self._held_tokens >= self._budget or len(self._queue) >= MAX_QUEUED_BLOCKS
            ):
                self._lock.wait(0.5)
            if self._closed:
                return
            if len(idx) and self.keep_payloads:
                remaining = np.zeros(len(items), dtype=bool)
                remaining[idx] = True
                self._held[(items.epoch, items.shard_pos)] = (items, remaining)
            self._held_tokens += tokens if self.keep_payloads else 0
            self._queue.append(block)
            s = self._stats
            s["shards"] += 1
            s["items"] += len(idx)
            s["tokens"] += tokens
            s["read_s"] += seconds
            if items.file_index not in self._counted:
                self._counted.add(items.file_index)
                s["skipped"] += len(items.skipped)
                self._skipped += [str(e) for e in items.skipped[: max(0, 20 - len(self._skipped))]]
                self._dropped += items.dropped
            self._lock.notify_all()

    # ---- calls ---------------------------------------------------------------------------

    def metadata(self, timeout: float) -> list[dict[str, Any]]:
        """Blocks of item metadata read since the last call; waits up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._queue and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LoaderError(
                        f"SourceLoader {self.source}[{self.index}] produced no data for "
                        f"{timeout:.0f} s (loading.timeout_s) while reading {self._reading}: "
                        "check that the source's files can be read, or raise the timeout"
                    )
                self._lock.wait(min(left, 0.5))
            if self._queue:
                out = list(self._queue)
                self._queue.clear()
                self._lock.notify_all()
                return out
            err = self._error
        assert err is not None
        if isinstance(err, OverlordError):
            raise err
        raise LoaderError(
            f"SourceLoader {self.source}[{self.index}] failed: {type(err).__name__}: {err}"
        ) from err

    def take(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """Hand over (and release) the tokens of items ``[[epoch, shard_pos, index], ...]``."""
        parts = []
        lengths = np.empty(len(keys), dtype=np.int32)
        with self._lock:
            for j, (e, p, i) in enumerate(np.asarray(keys, dtype=np.int64).tolist()):
                entry = self._held.get((e, p))
                if entry is None or not entry[1][i]:
                    raise LoaderError(
                        f"SourceLoader {self.source}[{self.index}] does not hold item "
                        f"(epoch {e}, shard {p}, index {i}): it was taken twice or never read"
                    )
                items, remaining = entry
                s, n = int(items.start[i]), int(items.length[i])
                parts.append(items.tokens[s : s + n])
                lengths[j] = n
                remaining[i] = False
                self._held_tokens -= n
                if not remaining.any():
                    del self._held[(e, p)]
            self._lock.notify_all()
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return {"tokens": tokens, "lengths": lengths}

    def stats(self) -> dict[str, Any]:
        """What this loader did so far: shards, items, tokens, read time, bad records."""
        with self._lock:
            return {
                **self._stats,
                "source": self.source,
                "loader": self.index,
                "held_tokens": self._held_tokens,
                "held_shards": len(self._held),
                "budget_tokens": self._budget,
                "dropped": self._dropped,
                "skipped_examples": list(self._skipped),
            }

    def close(self) -> None:
        """Stop reading and free every held shard."""
        with self._lock:
            self._closed = True
            self._held.clear()
            self._queue.clear()
            self._lock.notify_all()
        self._thread.join(timeout=10)
