"""A batch sent from one trainer process to its peers with ``torch.distributed``.

For mesh groups that span nodes (a TP or PP group over several machines): one
rank of the group fetches its batch from overlord and the others receive it,
instead of each fetching. Use it as ``overlord.torch.broadcast_batch``.

Messages are tensors: an int64 length, then a JSON header (step, rank, cost,
samples, the CP fields, the cost terms, and the shape of every array
present), then each array as a tensor of its dtype: int32 for the token
arrays and ``image_grid``, float32 for ``pixel_values`` (a plan with images).
Nothing is pickled. The arrays a pipeline stage does not get, and the images
of a plan without any (``None``), stay ``None`` on every receiver.
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
# the images of a plan with image sources, and the dtype each travels in
_IMAGES = {"pixel_values": np.float32, "image_grid": np.int32}
_DTYPES = {name: np.int32 for name in _ARRAYS} | _IMAGES
_TORCH = {np.float32: torch.float32, np.int32: torch.int32}


def _sent(batch: Batch) -> dict[str, np.ndarray]:
    """Every array ``batch`` holds, tokens then images, by name."""
    out = dict(batch.arrays())
    for name in _IMAGES:
        array = getattr(batch, name)
        if array is not None:
            out[name] = array
    return out


def _tensor(array: np.ndarray, dtype: type) -> torch.Tensor:
    """The tensor the source sends, sharing the array's memory where it can.

    A batch from Ray's object store is read-only; the source only reads it,
    so torch's warning about non-writable arrays does not apply.
    """
    shared: np.ndarray = np.ascontiguousarray(array, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(shared)


def _header(batch: Batch) -> bytes:
    return json.dumps(
        {
            "step": batch.step,
            "rank": batch.rank,
            "cost": batch.cost,
            "samples": [list(s) for s in batch.samples],
            "cp": [batch.cp_layout, batch.cp_rank, batch.cp_size],
            "terms": [batch.cost_llm, batch.cost_encoder],
            "shapes": {k: list(v.shape) for k, v in _sent(batch).items()},
        },
        separators=(",", ":"),
    ).encode()


def broadcast_batch(batch: Batch | None, group: Any = None, src: int = 0) -> Batch:
    """``batch`` of global rank ``src``, on every rank of ``group`` (all ranks by default).

    ``src`` passes its batch; every other rank passes ``None`` and receives an
    equal :class:`~overlord.Batch` (arrays equal byte for byte, the same
    samples and fields). A rank that only receives does not connect to
    overlord at all, so it is not waited for (see :mod:`overlord.roles.consumption`).
    """
    me = dist.get_rank()
    if me == src:
        if batch is None:
            raise ValueError(f"rank {src} is the source of broadcast_batch: pass its batch")
        data = _header(batch)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=src, group=group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=group)
        for name, array in _sent(batch).items():
            dist.broadcast(_tensor(array, _DTYPES[name]), src=src, group=group)
        return batch
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(raw, src=src, group=group)
    head = json.loads(bytes(raw.numpy().tobytes()).decode())
    arrays: dict[str, np.ndarray | None] = dict.fromkeys(_DTYPES)
    for name, dtype in _DTYPES.items():  # the order _sent sends them in
        if name in head["shapes"]:
            t = torch.empty(head["shapes"][name], dtype=_TORCH[dtype])
            dist.broadcast(t, src=src, group=group)
            arrays[name] = t.numpy()
    layout, cp_rank, cp_size = head["cp"]
    cost_llm, cost_encoder = head["terms"]
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
        pixel_values=arrays["pixel_values"],
        image_grid=arrays["image_grid"],
        cost_llm=cost_llm,
        cost_encoder=cost_encoder,
    )
