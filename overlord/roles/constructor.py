"""DataConstructor: pulls one rank's payloads from the loaders and packs its batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from overlord.batch import Batch, Sample
from overlord.plan.packing import pack
from overlord.plan.spec import validate_plan
from overlord.runtime.base import Handle, Runtime
from overlord.sources.files import resolve_files
from overlord.sources.tokenizers import make_tokenizer


class DataConstructor:
    """Builds the batches of one DP rank from its part of each step plan."""

    def __init__(
        self,
        plan_data: dict[str, Any],
        base_dir: str,
        planner: Handle,
        loaders: dict[str, list[Handle]],
        runtime: Runtime,
        rank: int,
    ):
        self.plan = validate_plan(plan_data, base_dir=base_dir)
        self.planner, self.runtime, self.rank = planner, runtime, rank
        self.names = self.plan.source_names
        self.loaders = [loaders[n] for n in self.names]
        self.file_names = [
            [sh.name for sh in resolve_files(s, self.plan.base_dir)] for s in self.plan.sources
        ]
        self.pad_id = make_tokenizer(self.plan.tokenizer, str(self.plan.base_dir)).pad_id

    def batch(self, step: int) -> Batch:
        """The packed batch of this rank for ``step``."""
        rp = self.runtime.get(self.planner.call("rank_plan", step, self.rank))
        src, ldr, keys = rp["source"], rp["loader"], rp["key"]
        n = len(src)
        # ask every (source, loader) that holds some of the items at once, then gather
        groups = {}
        for s, k in sorted(set(zip(src.tolist(), ldr.tolist()))):
            mine = np.flatnonzero((src == s) & (ldr == k))
            groups[(s, k)] = (mine, self.loaders[s][k].call("take", keys[mine]))
        lengths = np.asarray(rp["tokens"], dtype=np.int64)
        starts = np.zeros(n, dtype=np.int64)
        if n:
            np.cumsum(lengths[:-1], out=starts[1:])
        tokens = np.empty(int(lengths.sum()), dtype=np.int32)
        for mine, ref in groups.values():
            got = self.runtime.get(ref)
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
        return Batch(step=step, rank=self.rank, samples=samples, cost=rp["cost"], **arrays)


def _sample_id(file: str, row: int, chunk: int) -> str:
    return f"{file}:{row}" if chunk < 0 else f"{file}:{row}#{chunk}"
