"""overlord.torch.broadcast_batch: a mesh peer on another node gets the batch byte for byte.

Images too: ``pixel_values`` stays float32 and ``image_grid`` int32; ``None`` stays ``None``.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from overlord.batch import Batch, Sample  # noqa: E402
from overlord.batch.cp import cp_slices  # noqa: E402
from overlord.batch.cp_dynamic import dynamic_slices  # noqa: E402
from overlord.batch.rows import pack  # noqa: E402
from overlord.batch.stages import stage_view  # noqa: E402
from overlord.plan.cost import CostModel  # noqa: E402
from overlord.torch import broadcast_batch  # noqa: E402
from overlord.world import CPLayout  # noqa: E402


def batches() -> list[Batch]:
    a = pack(np.arange(1, 10), np.array([5, 2, 2]), np.array([0, 0, 1]), 2, 8, 257)
    samples = [Sample("web", "a.jsonl:3", 5, 0), Sample("web", "a.jsonl:9#1", 2, 0)]
    whole = Batch(3, 1, samples=samples, cost=2.5, **a)
    sliced = cp_slices(whole, 2, CPLayout.PER_DOCUMENT, 257)[1]
    dynamic = dynamic_slices(whole, 2, 3, CostModel(1.0, 0.0), 257)[0]  # with cp_groups
    stored = replace(whole)  # as mapped from Ray's object store: read-only arrays
    for name, array in whole.arrays().items():
        setattr(stored, name, array.copy())
        getattr(stored, name).flags.writeable = False
    # a plan with images: float32 pixels (values an int32 cast would change) and an int32 grid
    rng = np.random.default_rng(3)
    grid = np.array([[2, 4], [6, 2]], dtype=np.int32)
    pixels = rng.standard_normal((20, 3 * 14 * 14)).astype(np.float32)
    pictured = replace(whole, pixel_values=pixels, image_grid=grid, cost_llm=2.0, cost_encoder=0.5)
    views = [stage_view(sliced, "middle"), stage_view(sliced, "last")]
    return [whole, sliced, *views, dynamic, stored, pictured]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("error")  # a warning (a read-only array, say) fails the worker
    dist.init_process_group("gloo", rank=rank, world_size=2)
    got = [broadcast_batch(b if rank == 0 else None, src=0) for b in batches()]
    if rank == 1:
        np.save(out, np.array([_same(g, w) for g, w in zip(got, batches())]))
    dist.destroy_process_group()


def _held(batch: Batch) -> dict[str, np.ndarray]:
    images = {"pixel_values": batch.pixel_values, "image_grid": batch.image_grid}
    return batch.arrays() | {k: v for k, v in images.items() if v is not None}


def _same(got: Batch, want: Batch) -> bool:
    g, w = _held(got), _held(want)
    arrays_equal = g.keys() == w.keys() and all(
        np.array_equal(v, w[k]) and v.dtype == w[k].dtype for k, v in g.items()
    )
    rest = replace(got, **dict.fromkeys(w, None)) == replace(want, **dict.fromkeys(w, None))
    return arrays_equal and rest


@pytest.mark.integration
def test_every_rank_receives_the_source_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "same.npy")
    mp.start_processes(_worker, args=(port, out), nprocs=2, start_method="fork")
    assert np.load(out).tolist() == [True] * len(batches())
