"""DataConstructor: pulls its ranks' payloads from the loaders and packs their batches.

One constructor serves one DP rank, or several (the ranks of a node). With
``prefetch`` it plans (through the planner) and builds each rank's batches on
a thread of its own, ahead of the trainer, so that the trainer's request is
answered from memory; built batches of the current step are kept until the
next one is asked for, so that TP/PP peers of a rank receive the very same
batch. A build ahead that the planner refuses because other ranks lag (in one
process that consumes every rank) is not an error: the step is built when
the trainer asks for it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.batch import Batch, Sample
from overlord.errors import LoaderError, RanksApart
from overlord.plan.packing import pack
from overlord.plan.spec import Plan
from overlord.roles.api import ConstructorRole, LoaderRole, PlannerRole
from overlord.roles.loader_pool import PoolView, by_slot
from overlord.runtime.base import Handle
from overlord.runtime.threads import Builder
from overlord.sources.catalog import SourceFiles


class DataConstructor:
    """Builds the batches of some DP ranks from their parts of each step plan."""

    def __init__(
        self,
        plan: Plan,
        files: dict[str, SourceFiles],
        planner: Handle[PlannerRole],
        loaders: dict[str, list[Handle[LoaderRole] | None]],
        ranks: list[int],
        prefetch: int = 0,
        pad_id: int = 0,
    ):
        self.plan, self.files, self.pad_id = plan, files, pad_id
        self.planner, self.ranks = planner, list(ranks)
        self.prefetch = prefetch
        self._lock = threading.Lock()
        self._built: dict[tuple[int, int], Future[Batch | None]] = {}
        self._pool = Builder("overlord-constructor") if prefetch else None
        self.names = self.plan.source_names
        self.loaders = PoolView(self.names, loaders, planner)

    def batch(self, step: int, rank: int) -> Batch:
        """The packed batch of ``rank`` for ``step`` (built ahead when prefetching)."""
        if rank not in self.ranks:
            raise LoaderError(f"this DataConstructor serves ranks {self.ranks}, not rank {rank}")
        if self._pool is None:
            return self._build(step, rank)
        with self._lock:
            fut = self._built.get((step, rank))
            if fut is None or (fut.done() and (fut.exception() or fut.result() is None)):
                # none yet; refused when built ahead; or failed (a retry builds it again)
                fut = self._built[(step, rank)] = self._pool.submit(self._build, step, rank)
            for ahead in range(step + 1, step + 1 + self.prefetch):
                if (ahead, rank) not in self._built:
                    self._built[(ahead, rank)] = self._pool.submit(self._ahead, ahead, rank)
            # keep this step for the rank's TP/PP peers; older steps are done with
            for key in [k for k in self._built if k[1] == rank and k[0] < step]:
                del self._built[key]
        got = fut.result()
        if got is None:  # refused when it was built ahead: build it now, still off this thread
            return self._pool.submit(self._build, step, rank).result()
        return got

    def _ahead(self, step: int, rank: int) -> Batch | None:
        """Build ``step`` ahead of the trainer; None if the planner cannot plan it yet."""
        try:
            return self._build(step, rank)
        except RanksApart:
            return None

    def _rank_plan(self, step: int, rank: int) -> dict[str, Any]:
        """The planner answers None while other ranks are too far behind: wait for them."""
        deadline = time.monotonic() + self.plan.loading.timeout_s
        pause = 0.001
        while True:
            rp = self.planner.call(PlannerRole.rank_plan, step, rank).result()
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
        for mine, got in self.loaders.take(by_slot(src, ldr), keys):
            got_starts = np.concatenate(([0], np.cumsum(got["lengths"])[:-1]))
            for j, g0, g_len in zip(mine.tolist(), got_starts.tolist(), got["lengths"].tolist()):
                tokens[starts[j] : starts[j] + g_len] = got["tokens"][g0 : g0 + g_len]
        arrays = pack(
            tokens, lengths, rp["row"], rp["rows"], self.plan.batch.max_seq_len, self.pad_id
        )
        samples = [
            Sample(
                self.names[s],
                _sample_id(self.files[self.names[s]].at(e)[f].name, r, c),
                t,
                row,
            )
            for s, e, f, r, c, t, row in zip(
                src.tolist(),
                keys[:, 0].tolist(),
                rp["file_index"].tolist(),
                rp["rec_row"].tolist(),
                rp["chunk"].tolist(),
                lengths.tolist(),
                rp["row"].tolist(),
            )
        ]
        return Batch(step=step, rank=rank, samples=samples, cost=rp["cost"], **arrays)

    def pid(self) -> int:
        """The process this constructor runs in (chaos tests kill it)."""
        return os.getpid()

    def close(self) -> None:
        """Stop building ahead."""
        if self._pool is not None:
            self._pool.shutdown()


def _sample_id(file: str, row: int, chunk: int) -> str:
    return f"{file}:{row}" if chunk < 0 else f"{file}:{row}#{chunk}"


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[ConstructorRole] = DataConstructor
