"""One node's trainer processes fed by one embedded Loader: ``torchrun`` without Ray.

Node mode with ``runtime="inline"``, rank 0 as the node's host (the default
is the data process: :mod:`overlord.dist.data_process`).
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

The protocol (its messages: :mod:`overlord.dist.channel`, tensors and JSON,
nothing pickled): rank 0 sends each other rank ``START`` (the state the
stream starts from), then its batch of every step, each with the state as of
the step after it, in step order and rank order; then ``END`` (the stop
step, or rank 0 closed) or ``ERROR`` (the Loader failed, or a rank died: the
message names the place or the rank). Every way out of rank 0's thread
sends the end to every rank still alive (a send that fails, to a dead rank,
does not stop the others) and then ends, so no message is left pending when
rank 0's process ends. A rank that closes keeps receiving (and dropping)
batches until rank 0's end reaches it, so rank 0 is never left waiting on a
send. The end of the stream closes it, and so does the process's exit (an
``atexit`` hook), so a script that never calls ``close()`` ends cleanly, as
long as every rank consumes up to the same stop step (synchronous training
does); a process that dies of an uncaught exception skips that wait, so its
peers fail at once, naming it, instead of being fed on.

Dead ranks: a rank whose process died fails rank 0's next send to it at
once (its sockets close), and rank 0 sends every other rank an error
naming it; a dead rank 0 fails every other rank's receive at once. Every
wait in the group is bounded: rank 0's sends by ``loading.timeout_s`` (the
group's timeout), the other ranks' receives by twice that. So a rank that
stops taking batches without dying (a hung process) fails rank 0 within
``loading.timeout_s``, naming it, as the embedded runtime fails a rank whose
peers stop consuming; gloo then closes every connection of rank 0's in the
group, so the other ranks' errors name rank 0's lost connection instead.

Example (every process of ``torchrun --nproc_per_node 4 train.py``)::

    import torch.distributed as dist
    dist.init_process_group("gloo")          # or nccl: overlord adds a gloo group
    with overlord.Loader(plan, runtime="inline") as loader:  # node mode (overlord.streams)
        for batch in loader.client(dist.get_rank()):   # this process's DP rank: a NodeClient
            ...
        # in a mesh (cp, tp or pp above 1): loader.rank_client(dist.get_rank())
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from overlord.batch import Batch
from overlord.dist.channel import BATCH, END, ERROR, START, Channel, node_group
from overlord.dist.reports import ReportReceiver, ReportSender
from overlord.errors import CheckpointError, LoaderError
from overlord.plan.spec import Plan
from overlord.roles.feedback import check_report
from overlord.runtime.hosting import lean_allocators
from overlord.state.checkpoint import check_state
from overlord.world import World

log = logging.getLogger("overlord.node")

AHEAD = 2  # batches a rank holds ready beyond the one its trainer has


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
        self._failure: str | None = None  # why this process stops mid-stream, if it fails
        self._started = threading.Event()  # the state the stream starts from is known
        self._timeout = plan.loading.timeout_s
        self._thread: threading.Thread | None = None  # started on first use
        self.loader: Any = None  # rank 0's: the node's Loader, from its first use to close()
        self._clients: list[Any] = []  # rank 0's: its Loader's client of every rank
        self._reports: ReportSender | None = None  # another rank's: its reports to rank 0
        self._in_order = False  # another rank's: rank 0 ended the stream in order (its END)

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
        group = self._group if self._group is not None else node_group(self._timeout)
        self._channel = Channel(group, receive_s=2 * self._timeout)
        if self.rank != 0:
            self._reports = ReportSender(group, self.plan.source_names, self._timeout)
        target = self._serve if self.rank == 0 else self._receive
        self._thread = threading.Thread(target=target, args=(self.plan, self._state), daemon=True)
        self._thread.name = f"overlord-node-{self.rank}"
        self._thread.start()
        # a script that never closes its stream still ends node mode in order: a process
        # that exits while this thread waits in gloo aborts, and its peers see it crash
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- rank 0: the node's Loader ---------------------------------------------------------

    def _serve(self, plan: Plan, state: dict[str, Any] | None) -> None:
        world = plan.world
        live = set(range(1, world.size))  # the ranks the end must reach
        ending, message = END, ""  # every way out tells the other ranks, who wait for it
        reports: ReportReceiver | None = None  # the other ranks' reports, once the stream starts
        try:
            if self._make_loader is None:
                raise LoaderError(
                    "NodeClient needs serve= on rank 0: use overlord.Loader(plan, runtime='inline')"
                )
            # this process hosts every loader of the node, as a Ray design's loader process
            # does: rank 0 held 806 MiB above a bare trainer without it, 131 with it in the
            # same sweep (32 sources at index, benchmarks/memory.py --designs overlord-node)
            lean_allocators()
            # open until close(): its stats() and state_dict() outlive the stream's end
            self.loader = loader = self._make_loader(plan, state)
            # a DP rank's batch is built once, its views cut once for all its peers
            serve = loader.client if world.peers == 1 else loader.rank_client
            clients = [serve(r, stop_step=self.stop_step) for r in range(world.size)]
            self._clients = clients
            start = loader.state_dict()
            for r in sorted(live):
                text = json.dumps(start)
                self._send(live, r, "the start", self._channel.send_text, START, text)
            group, names = self._channel.group, plan.source_names
            reports = ReportReceiver(group, names, sorted(live), self._forward)
            self._begin(start)
            while not self._closed.is_set():
                reports.poll()  # the other ranks' reports to the planner, between batches
                for r, client in enumerate(clients):
                    batch = next(client)  # StopIteration at the stop step, for every rank
                    after = client.state_dict()
                    if r == 0:
                        self._put((BATCH, (batch, after)))
                    else:
                        what = f"step {batch.step}'s batch"
                        self._send(live, r, what, self._channel.send_batch, batch, after)
        except StopIteration:
            pass
        except _RankLost as e:
            ending, message = ERROR, str(e)
        except Exception as e:
            ending = ERROR
            message = f"the node's Loader (rank 0) failed: {type(e).__name__}: {e}"
        if ending == END and self._failure is not None:
            ending, message = ERROR, self._failure  # rank 0's trainer failed: not an end
        for r in sorted(live):
            try:  # an end that cannot reach one rank must still reach the others
                self._channel.send_text(ending, message, r)
            except Exception:
                live.discard(r)
        if ending == END and reports is not None:
            reports.drain(sorted(live), self._timeout)  # up to each rank's last message
        self._put((ending, message))

    def _forward(self, rank: int, step: int, seconds: float, losses: Any) -> None:
        """Rank ``rank``'s report, through the Loader's client of that rank (rank 0's thread)."""
        try:
            self._clients[rank].report(step, seconds, losses)
        except ValueError as e:  # checked where it was made: a report of another plan's
            log.warning("node mode: a report of rank %d was refused: %s", rank, e)

    def _send(
        self, live: set[int], to: int, what: str, send: Callable[..., None], *args: Any
    ) -> None:
        """``send(*args, to)``; a rank that cannot take it is gone: the stream stops, naming it."""
        try:
            send(*args, to)
        except Exception as e:
            live.discard(to)
            raise _RankLost(
                f"rank {to} of the node is gone: rank 0 could not send it {what} "
                f"({type(e).__name__}: {e}); its process died or stopped taking batches for "
                f"loading.timeout_s ({self._timeout:.0f} s), so every rank stops"
            ) from e

    # ---- the other ranks -------------------------------------------------------------------

    def _receive(self, plan: Plan, state: dict[str, Any] | None) -> None:
        while True:  # until rank 0's end of the stream: a recv must not be left pending
            try:
                kind, got = self._channel.receive()
            except Exception as e:  # the transport failed (rank 0 gone, a timeout)
                message = (
                    f"rank {self.rank} lost the node's Loader (rank 0): {type(e).__name__}: {e}; "
                    f"rank 0's process died, or sent nothing for twice loading.timeout_s "
                    f"({2 * self._timeout:.0f} s)"
                )
                self._put((ERROR, message))
                return
            if kind == START:
                self._begin(json.loads(got))
                continue
            self._put((kind, got))
            self._in_order = kind == END
            if kind != BATCH or self._failure is not None:
                # the stream's end; or this process fails: it posts no more receives, so rank
                # 0's next send to it fails when its process ends (at once) or after the timeout
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
        """The next step's batch, built ahead on another thread (rank 0) or received.

        At the end of the stream it first waits for this rank's thread to end
        (:meth:`close`): rank 0's, once every rank has received its batches and
        the end; another rank's, once that end has reached it. So nothing of
        node mode is pending after the loop, and the trainer may destroy its
        process groups or exit.
        """
        if self.stop_step is not None and self.step >= self.stop_step:
            self._end(None, release=False)
            raise StopIteration
        if self._thread is None:
            self._start()
        kind, got = self._take()
        if kind == END:
            self._ready.put((kind, got))  # every later call ends too
            self._end(None, release=False)
            raise StopIteration
        if kind == ERROR:
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

    def _take(self) -> tuple[int, Any]:
        """The next message of this rank's thread, which ends with one (bounded waits only)."""
        while True:
            try:
                return self._ready.get(timeout=1.0)
            except queue.Empty:
                assert self._thread is not None
                if not self._thread.is_alive() and self._ready.empty():
                    return ERROR, f"rank {self.rank}: node mode's thread ended without an end"

    def report(
        self, step: int, seconds: float, loss_by_source: dict[str, float] | None = None
    ) -> None:
        """:meth:`overlord.roles.client.Client.report` of this rank, through rank 0.

        Rank 0 hands it to its Loader; another rank sends it to rank 0 without
        waiting (:mod:`overlord.dist.reports`). Call it after the step's batch.
        """
        losses = check_report(step, seconds, loss_by_source, self.plan.source_names)
        if self._thread is None:
            raise LoaderError(f"rank {self.rank}: report of step {step} before the first batch")
        if self._reports is not None:
            self._reports.send(step, seconds, losses)
        elif self._clients:
            self._clients[self.rank].report(step, seconds, losses)

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

        Rank 0 stops its Loader and sends every rank the end of the stream;
        another rank keeps receiving (dropping what comes) until that end
        reaches it. So call it on every rank, after consuming up to the same
        step (as synchronous training ends them together); a process that
        exits without calling it calls it then, and so does the end of the
        stream. A thread still waiting after ``loading.timeout_s`` (rank 0's:
        that for each send it has left) is left behind. Called while an
        exception unwinds (``with`` a Loader whose body raised), it stops at
        once instead, as this process fails (:meth:`_end`).
        """
        failed = sys.exc_info()[1]  # closing while an exception unwinds: a failure
        self._end(None if failed is None else f"{type(failed).__name__}: {failed}")

    def _end(self, failure: str | None, release: bool = True) -> None:
        """Close: in order (``failure`` None), or at once, as this process fails.

        ``release`` closes rank 0's Loader too, once its thread has ended (the
        end of the stream leaves it open, so its stats can still be read).

        A failing process does not wait for the others: rank 0 sends every
        rank an error naming it instead of the end, another rank stops
        receiving; its exit then closes its sockets, which fails the rest
        at once (a wait in order would feed it on until ``loading.timeout_s``).
        """
        if failure is not None and self._thread is not None and self._thread.is_alive():
            self._failure = f"rank {self.rank}'s trainer failed ({failure}), so every rank stops"
            self._closed.set()
            return
        self._closed.set()
        if self._thread is None:
            return  # never started: nothing runs
        if self.rank != 0:
            # let the receiver take the end of the stream: it may wait on a full queue
            while self._thread.is_alive() and not self._ready.empty():
                self._ready.get_nowait()
        # rank 0's thread ends after its sends, each waiting at most the group's timeout
        sends = self.plan.world.size + 1 if self.rank == 0 else 1
        self._thread.join(self._timeout * sends)
        if self._reports is not None and self._in_order and not self._thread.is_alive():
            self._reports.end()  # rank 0, alive and past the end, stops waiting for reports
        if release and self.loader is not None and not self._thread.is_alive():
            self.loader.close()


class _RankLost(LoaderError):
    """A rank of the node that rank 0 can no longer send to (its process died, or hung)."""


def _close_at_exit(ref: weakref.ref[NodeClient]) -> None:
    client = ref()
    if client is None:
        return
    # the process dies of an uncaught exception: no orderly end (see NodeClient._end)
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    client._end(None if failed is None else f"{type(failed).__name__}: {failed}")
