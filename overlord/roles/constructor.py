"""DataConstructor: pulls its ranks' payloads from the loaders and packs their batches.

One constructor serves one DP rank, or several (the ranks of a node). With
``prefetch`` it builds the next steps of each rank on a background thread, so
a trainer's request is answered from memory; built batches of the current
step are kept until the next one is asked for, so that TP/PP peers of a rank
receive the very same batch.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from overlord.batch import Batch, Sample
from overlord.errors import ActorDiedError, LoaderError
from overlord.plan.packing import pack
from overlord.plan.spec import validate_plan
from overlord.roles.loader_group import MemberHandle, replica_name
from overlord.runtime.base import Handle, Runtime
from overlord.sources.files import resolve_files
from overlord.sources.tokenizers import make_tokenizer

MAX_FAILOVERS = 8  # replacements of one batch's loaders before giving up


class DataConstructor:
    """Builds the batches of some DP ranks from their parts of each step plan."""

    def __init__(
        self,
        plan_data: dict[str, Any],
        base_dir: str,
        planner: Handle,
        loaders: dict[str, list[Handle]],
        runtime: Runtime,
        ranks: list[int],
        prefetch: int = 0,
    ):
        self.plan = validate_plan(plan_data, base_dir=base_dir)
        self.planner, self.runtime, self.ranks = planner, runtime, list(ranks)
        self.prefetch = prefetch
        self._lock = threading.Lock()
        self._built: dict[tuple[int, int], Future[Batch]] = {}
        self._pool = ThreadPoolExecutor(1, "overlord-constructor") if prefetch else None
        self.names = self.plan.source_names
        self.loaders = [list(loaders[n]) for n in self.names]  # current primaries
        self.file_names = [
            [sh.name for sh in resolve_files(s, self.plan.base_dir)] for s in self.plan.sources
        ]
        self.pad_id = make_tokenizer(self.plan.tokenizer, str(self.plan.base_dir)).pad_id

    def batch(self, step: int, rank: int) -> Batch:
        """The packed batch of ``rank`` for ``step`` (built ahead when prefetching)."""
        if rank not in self.ranks:
            raise LoaderError(f"this DataConstructor serves ranks {self.ranks}, not rank {rank}")
        if self._pool is None:
            return self._build(step, rank)
        with self._lock:
            fut = self._built.get((step, rank))
            if fut is None:
                fut = self._built[(step, rank)] = self._pool.submit(self._build, step, rank)
            for ahead in range(step + 1, step + 1 + self.prefetch):
                if (ahead, rank) not in self._built:
                    self._built[(ahead, rank)] = self._pool.submit(self._build, ahead, rank)
            # keep this step for the rank's TP/PP peers; older steps are done with
            for key in [k for k in self._built if k[1] == rank and k[0] < step]:
                del self._built[key]
        return fut.result()

    def _rank_plan(self, step: int, rank: int) -> dict[str, Any]:
        """The planner answers None while other ranks are too far behind: wait for them."""
        deadline = time.monotonic() + self.plan.loading.timeout_s
        pause = 0.001
        while True:
            rp = self.runtime.get(self.planner.call("rank_plan", step, rank))
            if rp is not None:
                return dict(rp)
            if time.monotonic() > deadline:
                raise LoaderError(
                    f"rank {rank} waited {self.plan.loading.timeout_s:.0f} s (loading.timeout_s) "
                    f"for step {step}: other DP ranks stopped consuming"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _build(self, step: int, rank: int) -> Batch:
        rp = self._rank_plan(step, rank)
        src, ldr, keys = rp["source"], rp["loader"], rp["key"]
        n = len(src)
        lengths = np.asarray(rp["tokens"], dtype=np.int64)
        starts = np.zeros(n, dtype=np.int64)
        if n:
            np.cumsum(lengths[:-1], out=starts[1:])
        tokens = np.empty(int(lengths.sum()), dtype=np.int32)
        slots = [
            (s, k, np.flatnonzero((src == s) & (ldr == k)))
            for s, k in sorted(set(zip(src.tolist(), ldr.tolist())))
        ]
        for mine, got in self._take(slots, keys):
            got_starts = np.concatenate(([0], np.cumsum(got["lengths"])[:-1]))
            for j, g0, g_len in zip(mine.tolist(), got_starts.tolist(), got["lengths"].tolist()):
                tokens[starts[j] : starts[j] + g_len] = got["tokens"][g0 : g0 + g_len]
        arrays = pack(
            tokens, lengths, rp["row"], rp["rows"], self.plan.batch.max_seq_len, self.pad_id
        )
        samples = [
            Sample(
                self.names[s],
                _sample_id(self.file_names[s][f], r, c),
                t,
                row,
            )
            for s, f, r, c, t, row in zip(
                src.tolist(),
                rp["file_index"].tolist(),
                rp["rec_row"].tolist(),
                rp["chunk"].tolist(),
                lengths.tolist(),
                rp["row"].tolist(),
            )
        ]
        return Batch(step=step, rank=rank, samples=samples, cost=rp["cost"], **arrays)

    def _take(
        self, slots: list[tuple[int, int, np.ndarray]], keys: np.ndarray
    ) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Payloads of the items of each ``(source, loader, item indexes)``, from their loaders.

        Every loader is asked at once (loaders that share a process in one
        call). A loader that died is replaced by the planner (its shadow, or a
        new loader) and asked again: takes only read, so asking twice is safe.
        """
        out = []
        todo = slots
        for _ in range(MAX_FAILOVERS):
            # each call, and the (source, loader, item indexes, group member) it answers
            calls: list[tuple[Any, list[tuple[int, int, np.ndarray, str | None]]]] = []
            grouped: dict[int, tuple[Handle, dict[str, Any], list[Any]]] = {}
            for s, k, mine in todo:
                if k >= len(self.loaders[s]):  # a partition added after this constructor started
                    got = self.runtime.get(self.planner.call("primaries", self.names[s]))
                    self.loaders[s] = list(got)
                handle = self.loaders[s][k]
                if isinstance(handle, MemberHandle):
                    group = grouped.setdefault(id(handle.group), (handle.group, {}, []))
                    group[1][handle.name] = keys[mine]
                    group[2].append((s, k, mine, handle.name))
                else:
                    calls.append((handle.call("take", keys[mine]), [(s, k, mine, None)]))
            for group_handle, asked, members in grouped.values():
                calls.append((group_handle.call("take_many", asked), members))
            todo = []
            for ref, members in calls:
                try:
                    got = self.runtime.get(ref)
                except ActorDiedError:
                    for s, k, mine, _ in members:
                        dead = replica_name(self.loaders[s][k])
                        new = self.planner.call("failover", self.names[s], k, dead)
                        self.loaders[s][k] = self.runtime.get(new)
                        todo.append((s, k, mine))
                    continue
                out += [(mine, got if m is None else got[m]) for _, _, mine, m in members]
            if not todo:
                return out
        raise LoaderError(
            f"loaders of sources {sorted({self.names[s] for s, _, _ in todo})} kept dying: "
            f"{MAX_FAILOVERS} failovers in a row"
        )

    def pid(self) -> int:
        """The process this constructor runs in (chaos tests kill it)."""
        return os.getpid()

    def close(self) -> None:
        """Stop building ahead."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _sample_id(file: str, row: int, chunk: int) -> str:
    return f"{file}:{row}" if chunk < 0 else f"{file}:{row}#{chunk}"
