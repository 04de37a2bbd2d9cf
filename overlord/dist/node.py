"""One node's trainer processes fed by one embedded Loader: ``torchrun`` without Ray.

``torchrun --nproc_per_node N train.py`` starts N processes, one mesh rank
each (one DP rank each where ``cp = tp = pp = 1``). Were each to run its own
Loader, every source would be read and tokenized N times. Here the node's
rank 0 runs the only Loader (the embedded runtime, on a thread of its own),
takes every rank's batch of each step in order, and sends each to its rank
over a ``torch.distributed`` gloo group the trainer already has the means
for; every other rank receives its batches on a thread of its own. So each
source is read once per node, and every rank gets exactly the batches the
single-process embedded runtime gives it (``Loader.client(dp_rank)``, or
``Loader.rank_client(global_rank)`` in a mesh: a DP rank's batch is fetched,
packed and cut for its CP ranks once, and TP peers are sent the same view;
each process holds its own copy of what it received). Multi-node jobs are
Ray's (``overlord serve``). Rank 0's process hosts every loader of the node:
it takes a Ray loader process's allocators (``lean_allocators``: glibc's
malloc arenas capped, Arrow on the system allocator); the other ranks' are
left as they were.

Messages are tensors: a header of eight int64 (kind, step, DP rank, three
unused, the lengths of the meta JSON and of the state's JSON), then two byte
tensors of JSON: the batch's samples, cost, CP fields and the shape of every
array present, and the state as of the step after it (what ``state_dict()``
returns once the batch is taken); then each array present as an int32
tensor (a pipeline stage's missing fields stay ``None``). Nothing is
pickled. An error of the Loader reaches every rank as a
:class:`~overlord.errors.LoaderError` naming where it happened.

Example (every process of ``torchrun --nproc_per_node 4 train.py``)::

    import torch.distributed as dist
    dist.init_process_group("gloo")          # or nccl: overlord adds a gloo group
    with overlord.Loader(plan) as loader:    # node mode here (overlord.streams decides)
        for batch in loader.client(dist.get_rank()):   # this process's DP rank: a NodeClient
            ...
        # in a mesh (cp, tp or pp above 1): loader.rank_client(dist.get_rank())
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overlord.batch import Batch, Sample
from overlord.errors import CheckpointError, LoaderError
from overlord.plan.spec import Plan
from overlord.runtime.hosting import lean_allocators
from overlord.state.checkpoint import check_state
from overlord.world import World

_BATCH, _END, _ERROR, _START = 0, 1, 2, 3
_ARRAYS = ("input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens", "global_positions")
_HEADER = 8
AHEAD = 2  # batches a rank holds ready beyond the one its trainer has


def _bytes(text: str) -> torch.Tensor:
    data = text.encode()
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def _text(tensor: torch.Tensor) -> str:
    return bytes(tensor.numpy().tobytes()).decode()


class _Channel:
    """Rank 0's messages to one rank, as tensors over a gloo group."""

    def __init__(self, group: Any):
        self.group = group

    def send_batch(self, batch: Batch, state: dict[str, Any], to: int) -> None:
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
        header = [_BATCH, batch.step, batch.rank, 0, 0, 0, len(meta), len(after)]
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
        dist.recv(header, src=0, group=self.group)
        kind, step, rank, _, _, _, n_meta, n_state = header.tolist()
        if kind != _BATCH:
            message = torch.empty(n_meta, dtype=torch.uint8)
            if n_meta:
                dist.recv(message, src=0, group=self.group)
            return kind, _text(message)
        meta = torch.empty(n_meta, dtype=torch.uint8)
        after = torch.empty(n_state, dtype=torch.uint8)
        for t in (meta, after):
            dist.recv(t, src=0, group=self.group)
        info = json.loads(_text(meta))
        arrays: dict[str, Any] = dict.fromkeys(_ARRAYS)
        for name, shape in info["shapes"].items():  # in the order they were sent
            t = torch.empty(shape, dtype=torch.int32)
            dist.recv(t, src=0, group=self.group)
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
                dist.recv(t, src=0, group=self.group)
            batch.pixel_values, batch.image_grid = px.numpy(), grid_i.numpy()
            batch.cost_llm, batch.cost_encoder = info["costs"]
        return kind, (batch, json.loads(_text(after)))


class NodeClient(Iterator[Batch]):
    """The batches of this process's rank; the node's one Loader serves every rank.

    This process's ``torch.distributed`` rank is its global rank in the
    plan's mesh (its DP rank where ``cp = tp = pp = 1``); the plan's
    ``world.size`` must be the number of processes, all on this node.
    ``state`` resumes the stream (the same state on every rank, as a
    synchronous checkpoint saves it); ``stop_step`` ends it. ``serve(plan,
    state)`` makes rank 0's embedded Loader (:func:`overlord.streams.open_stream`
    passes one; use it, or ``overlord.Loader``).

    It starts on first use (its first batch or :meth:`state_dict`): the
    process group, the node's Loader on rank 0 and this rank's thread. Until
    then :meth:`load_state_dict` chooses where the stream starts.
    """

    def __init__(
        self,
        plan: Plan,
        state: dict[str, Any] | None = None,
        stop_step: int | None = None,
        group: Any = None,
        serve: Callable[[Plan, dict[str, Any] | None], Any] | None = None,
    ):
        if not dist.is_available():
            raise LoaderError("overlord's node mode needs torch.distributed")
        self.plan = plan
        self._make_loader = serve
        self._group = group
        self.rank = World.launch().rank  # torchrun's RANK: the process group's rank
        self.step = int((state or {}).get("step", 0))
        self.stop_step = stop_step
        self._state = state  # as of this rank's position: before ``self.step``
        self._ready: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=AHEAD)
        self._closed = threading.Event()
        self._started = threading.Event()  # the state the stream starts from is known
        self._timeout = plan.loading.timeout_s
        self._thread: threading.Thread | None = None  # started on first use

    def _start(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # from torchrun's environment
        self.rank, size = dist.get_rank(), dist.get_world_size()
        local = World.launch().local_size or size
        if local != size:
            raise LoaderError(
                f"overlord's node mode serves the processes of one node ({local} here, "
                f"{size} in all): for several nodes, serve the plan on Ray (overlord serve) "
                "and connect every trainer to it"
            )
        world = self.plan.world
        if world.size != size:
            mesh = f"dp*cp*tp*pp = {world.dp}*{world.cp}*{world.tp}*{world.pp}"
            raise LoaderError(
                f"the plan's world has {world.size} processes ({mesh}) but {size} run: one "
                f"process per mesh rank (plan.with_dp({size // world.peers}) for "
                f"cp*tp*pp = {world.peers}, or world.dp in the plan)"
            )
        self.dp_rank = world.coords(self.rank).dp  # the rank batches name
        # a group of our own, so the trainer's collectives and ours never interleave
        group = self._group if self._group is not None else dist.new_group(backend="gloo")
        self._channel = _Channel(group)
        target = self._serve if self.rank == 0 else self._receive
        self._thread = threading.Thread(target=target, args=(self.plan, self._state), daemon=True)
        self._thread.name = f"overlord-node-{self.rank}"
        self._thread.start()

    # ---- rank 0: the node's Loader ---------------------------------------------------------

    def _serve(self, plan: Plan, state: dict[str, Any] | None) -> None:
        world = plan.world
        others = range(1, world.size)
        ending, message = _END, ""  # every way out tells the other ranks, who wait for it
        try:
            if self._make_loader is None:
                raise LoaderError("NodeClient needs serve= on rank 0: use overlord.Loader(plan)")
            # this process hosts every loader of the node, as a Ray design's loader process
            # does: rank 0 held 806 MiB above a bare trainer without it, 131 with it in the
            # same sweep (32 sources at index, benchmarks/memory.py --designs overlord-node)
            lean_allocators()
            with self._make_loader(plan, state) as loader:
                self.loader = loader
                # a DP rank's batch is built once, its views cut once for all its peers
                serve = loader.client if world.peers == 1 else loader.rank_client
                clients = [serve(r, stop_step=self.stop_step) for r in range(world.size)]
                start = loader.state_dict()
                for r in others:
                    self._channel.send_text(_START, json.dumps(start), r)
                self._begin(start)
                while not self._closed.is_set():
                    for r, client in enumerate(clients):
                        batch = next(client)  # StopIteration at the stop step, for every rank
                        after = client.state_dict()
                        if r == 0:
                            self._put((_BATCH, (batch, after)))
                        else:
                            self._channel.send_batch(batch, after, r)
        except StopIteration:
            pass
        except Exception as e:
            ending = _ERROR
            message = f"the node's Loader (rank 0) failed: {type(e).__name__}: {e}"
        for r in others:
            self._channel.send_text(ending, message, r)
        self._put((ending, message))

    # ---- the other ranks -------------------------------------------------------------------

    def _receive(self, plan: Plan, state: dict[str, Any] | None) -> None:
        while True:  # until rank 0's end of the stream: a recv must not be left pending
            try:
                kind, got = self._channel.receive()
            except Exception as e:  # the transport failed (rank 0 gone, a timeout)
                message = f"rank {self.rank} lost the node's Loader: {type(e).__name__}: {e}"
                self._put((_ERROR, message))
                return
            if kind == _START:
                self._begin(json.loads(got))
                continue
            self._put((kind, got))
            if kind != _BATCH:
                return

    def _begin(self, state: dict[str, Any]) -> None:
        if self._state is None:
            self._state = state
        self._started.set()

    def _put(self, item: tuple[int, Any]) -> None:
        while not self._closed.is_set():
            try:
                self._ready.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        # closed: nobody takes batches any more; the item is dropped, not waited on

    # ---- the trainer's side ----------------------------------------------------------------

    def __next__(self) -> Batch:
        """The next step's batch, built ahead on another thread (rank 0) or received."""
        if self.stop_step is not None and self.step >= self.stop_step:
            raise StopIteration
        if self._thread is None:
            self._start()
        kind, got = self._ready.get()
        if kind == _END:
            self._ready.put((kind, got))  # every later call ends too
            raise StopIteration
        if kind == _ERROR:
            self._ready.put((kind, got))
            raise LoaderError(got)
        batch, after = got
        if (batch.step, batch.rank) != (self.step, self.dp_rank):
            raise LoaderError(
                f"rank {self.rank} expected step {self.step} of DP rank {self.dp_rank} and "
                f"received step {batch.step} of DP rank {batch.rank} from the node's Loader"
            )
        self.step += 1
        self._state = after
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The stream's state as of this rank's position (the same on every rank in step)."""
        if self._state is None and self._thread is None:
            self._start()  # the state it starts from is rank 0's Loader's
        if self._state is None and not self._started.wait(self._timeout):
            raise LoaderError(
                f"rank {self.rank}: the node's Loader (rank 0) sent no state within "
                f"{self._timeout:.0f} s (loading.timeout_s)"
            )
        assert self._state is not None
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the stream from ``state`` instead (only before its first use).

        Every rank shares the node's Loader, which starts once: a stream that
        has started is resumed by a new one on every rank.
        """
        check_state(state, self.plan)
        if self._thread is not None:
            raise CheckpointError(
                "load_state_dict after iterating under torchrun: every rank shares the node's "
                "Loader, so a resume starts a new stream on every rank (open_stream(plan, "
                "state=...), OverlordIterableDataset.from_plan(state=...) or "
                "overlord.Loader(plan, state=...))"
            )
        self._state = state
        self.step = int(state.get("step", 0))

    def close(self) -> None:
        """Stop, and wait for this rank's thread to end (before the process group goes).

        Rank 0 stops its Loader; another rank's thread ends when rank 0's end
        of the stream reaches it, which it does once every rank has taken its
        batches up to the stop step (so call it on every rank, as synchronous
        training ends them together). A thread still waiting after
        ``loading.timeout_s`` is left behind.
        """
        self._closed.set()
        if self._thread is None:
            return  # never started: nothing runs
        if self.rank != 0:
            # let the receiver take the end of the stream: it may wait on a full queue
            while self._thread.is_alive() and not self._ready.empty():
                self._ready.get_nowait()
        self._thread.join(self._timeout)
