"""The messages of node mode (:mod:`overlord.dist.node`) and the gloo group they travel in.

Rank 0 sends, every other rank receives, over a gloo group of node mode's
own (:func:`node_group`), so the trainer's collectives and these messages
never interleave. Messages are tensors: a header of eight int64 (kind,
step, DP rank, three unused, the lengths of the meta JSON and of the
state's JSON), then two byte tensors of JSON: the batch's samples, cost, CP
fields and the shape of every array present, and the state as of the step
after it; then each array present as an int32 tensor (a pipeline stage's
missing fields stay ``None``). Nothing is pickled. The kinds:

- ``START`` (rank 0 to each rank, once): the state the stream starts from;
- ``BATCH``: one step's batch of the receiving rank, with the state after it;
- ``END``: no more batches (the stop step, or rank 0 closed): the receiver
  stops receiving, so that no receive is left pending when its process ends;
- ``ERROR``: the stream failed; the message says where (a source's file and
  row, or the rank that died).

A gloo send completes only once the receiver has taken the message, so a
rank whose process died fails rank 0's next send to it within moments (its
sockets close), and a receive from a dead rank 0 fails as fast. A wait
longer than the group's timeout (``loading.timeout_s``) fails too, and
closes that pair of ranks' connection.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overlord.batch import Batch, Sample
from overlord.runtime.ray_connect import is_loopback

BATCH, END, ERROR, START = 0, 1, 2, 3
_ARRAYS = ("input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens", "global_positions")
_HEADER = 8


def _bytes(text: str) -> torch.Tensor:
    data = text.encode()
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def _text(tensor: torch.Tensor) -> str:
    return bytes(tensor.numpy().tobytes()).decode()


class Channel:
    """Rank 0's messages to one rank, as tensors over a gloo group."""

    def __init__(self, group: Any, receive_s: float | None = None):
        self.group = group
        # a receiver waits longer than rank 0's sends do, so that when a hung rank holds
        # rank 0 up, rank 0's send to it fails first and the error that reaches every
        # other rank names that rank, not rank 0
        self.receive_wait = None if receive_s is None else datetime.timedelta(seconds=receive_s)

    def _recv(self, tensor: torch.Tensor) -> None:
        work = dist.irecv(tensor, src=0, group=self.group)
        if work is None:
            raise RuntimeError("this process is not in node mode's group")
        if self.receive_wait is None:
            work.wait()
        else:
            work.wait(timeout=self.receive_wait)

    def send_batch(self, batch: Batch, state: dict[str, Any], to: int) -> None:
        """``batch`` to rank ``to``, with ``state``: the stream's state as of the step after it."""
        samples = [[s.source, s.id, s.tokens, s.row] for s in batch.samples]
        px, grid_i = batch.pixel_values, batch.image_grid  # a plan with images
        images = None if px is None or grid_i is None else [*px.shape, len(grid_i)]
        arrays = batch.arrays()  # a mesh rank's: its CP slice, its stage's fields
        meta = _bytes(json.dumps({
            "samples": samples, "cost": batch.cost, "images": images,
            "costs": [batch.cost_llm, batch.cost_encoder],
            "cp": [batch.cp_layout, batch.cp_rank, batch.cp_size],
            "shapes": {k: list(a.shape) for k, a in arrays.items()},
        }))  # fmt: skip
        after = _bytes(json.dumps(state, separators=(",", ":")))
        header = [BATCH, batch.step, batch.rank, 0, 0, 0, len(meta), len(after)]
        for t in (torch.tensor(header, dtype=torch.int64), meta, after):
            dist.send(t.contiguous(), dst=to, group=self.group)
        for a in arrays.values():
            dist.send(torch.from_numpy(np.ascontiguousarray(a, np.int32)), dst=to, group=self.group)
        if px is not None and grid_i is not None:
            for image in (px, grid_i):
                dist.send(torch.from_numpy(np.ascontiguousarray(image)), dst=to, group=self.group)

    def send_text(self, kind: int, text: str, to: int) -> None:
        """An end, an error (its message) or the start (the state the stream starts from)."""
        message = _bytes(text)
        header = [kind, 0, 0, 0, 0, 0, len(message), 0]
        dist.send(torch.tensor(header, dtype=torch.int64), dst=to, group=self.group)
        if len(message):
            dist.send(message, dst=to, group=self.group)

    def receive(self) -> tuple[int, Any]:
        """``(kind, (batch, state))`` for a batch, ``(kind, message)`` otherwise."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._recv(header)
        kind, step, rank, _, _, _, n_meta, n_state = header.tolist()
        if kind != BATCH:
            message = torch.empty(n_meta, dtype=torch.uint8)
            if n_meta:
                self._recv(message)
            return kind, _text(message)
        meta = torch.empty(n_meta, dtype=torch.uint8)
        after = torch.empty(n_state, dtype=torch.uint8)
        for t in (meta, after):
            self._recv(t)
        info = json.loads(_text(meta))
        arrays: dict[str, Any] = dict.fromkeys(_ARRAYS)
        for name, shape in info["shapes"].items():  # in the order they were sent
            t = torch.empty(shape, dtype=torch.int32)
            self._recv(t)
            arrays[name] = t.numpy()
        layout, cp_rank, cp_size = info["cp"]
        batch = Batch(
            step, rank, samples=[Sample(*s) for s in info["samples"]], cost=info["cost"],
            cp_layout=layout, cp_rank=cp_rank, cp_size=cp_size, **arrays,
        )  # fmt: skip
        images = info.get("images")
        if images is not None:
            px = torch.empty(images[:2], dtype=torch.float32)
            grid_i = torch.empty((images[2], 2), dtype=torch.int32)
            for t in (px, grid_i):
                self._recv(t)
            batch.pixel_values, batch.image_grid = px.numpy(), grid_i.numpy()
            batch.cost_llm, batch.cost_encoder = info["costs"]
        return kind, (batch, json.loads(_text(after)))


@contextlib.contextmanager
def _loopback_gloo(master: str | None) -> Iterator[None]:
    """The loopback interface for gloo while a group is made, where the master is loopback.

    gloo binds the address the host name resolves to (often the machine's
    network address) unless ``GLOO_SOCKET_IFNAME`` names an interface; torch
    reads that variable when a gloo group is created. A job whose master
    address is loopback (``--master_addr 127.0.0.1``, ``--standalone``) is one
    machine's, so its group needs no other interface. A variable the user set
    is left alone.
    """
    names = {name for _, name in socket.if_nameindex()}
    if "GLOO_SOCKET_IFNAME" in os.environ or "lo" not in names or not is_loopback(master):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def node_group(timeout_s: float) -> Any:
    """A gloo group of every rank, for node mode's messages alone (made on every rank).

    Each wait in it (a send until the receiver takes the message, a receive)
    fails after ``timeout_s``. With a loopback master address (torchrun's
    ``MASTER_ADDR``, read here because torch reads it there) its sockets
    listen on 127.0.0.1 only.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    with _loopback_gloo(os.environ.get("MASTER_ADDR")):
        return dist.new_group(backend="gloo", timeout=timeout)
