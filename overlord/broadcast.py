"""A batch sent from one trainer process to its peers with ``torch.distributed``.

For mesh groups that span nodes (a TP or PP group over several machines): one
rank of the group fetches its batch from overlord and the others receive it,
instead of each fetching. Use it as ``overlord.torch.broadcast_batch``.

Messages are tensors: an int64 length, then a JSON header (step, rank, cost,
samples, the CP fields, and the shape of every array present), then each
array as an int32 tensor. Nothing is pickled. The arrays a pipeline stage does
not get (``None``) stay ``None`` on every receiver.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overlord.batch import Batch, Sample

_ARRAYS = (
    *("input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens", "global_positions"),
    "cp_groups",
)


def _header(batch: Batch) -> bytes:
    return json.dumps(
        {
            "step": batch.step,
            "rank": batch.rank,
            "cost": batch.cost,
            "samples": [list(s) for s in batch.samples],
            "cp": [batch.cp_layout, batch.cp_rank, batch.cp_size],
            "shapes": {k: list(v.shape) for k, v in batch.arrays().items()},
        },
        separators=(",", ":"),
    ).encode()


def _sent(array: np.ndarray) -> torch.Tensor:
    """The int32 tensor the source sends, sharing the array's memory where it can.

    A batch from Ray's object store is read-only; the source only reads it,
    so torch's warning about non-writable arrays does not apply.
    """
    shared = np.ascontiguousarray(array, dtype=np.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(shared)


def broadcast_batch(batch: Batch | None, group: Any = None, src: int = 0) -> Batch:
    """``batch`` of global rank ``src``, on every rank of ``group`` (all ranks by default).

    ``src`` passes its batch; every other rank passes ``None`` and receives an
    equal :class:`~overlord.Batch` (arrays equal byte for byte, the same
    samples and fields). A rank that only receives does not connect to
    overlord at all, so it is not waited for (see :mod:`overlord.roles.peers`).
    """
    me = dist.get_rank()
    if me == src:
        if batch is None:
            raise ValueError(f"rank {src} is the source of broadcast_batch: pass its batch")
        data = _header(batch)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=src, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group)
        for array in batch.arrays().values():
            dist.broadcast(_sent(array), src=src, group=group)
        return batch
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(raw, src=src, group=group)
    head = json.loads(bytes(raw.numpy().tobytes()).decode())
    arrays: dict[str, np.ndarray | None] = dict.fromkeys(_ARRAYS)
    for name in _ARRAYS:
        if name in head["shapes"]:
            t = torch.empty(head["shapes"][name], dtype=torch.int32)
            dist.broadcast(t, src=src, group=group)
            arrays[name] = t.numpy()
    layout, cp_rank, cp_size = head["cp"]
    position_ids, segment_ids, cu_seqlens = (
        arrays["position_ids"], arrays["segment_ids"], arrays["cu_seqlens"]
    )  # fmt: skip
    assert position_ids is not None and segment_ids is not None and cu_seqlens is not None
    return Batch(
        step=head["step"],
        rank=head["rank"],
        input_ids=arrays["input_ids"],
        labels=arrays["labels"],
        position_ids=position_ids,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        samples=[Sample(*s) for s in head["samples"]],
        cost=head["cost"],
        global_positions=arrays["global_positions"],
        cp_layout=layout,
        cp_rank=cp_rank,
        cp_size=cp_size,
        cp_groups=arrays["cp_groups"],
    )
