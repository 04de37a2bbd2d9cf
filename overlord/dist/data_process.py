"""The ``process`` runtime, trainer side: a data process of the node, batches in shared memory.

With ``runtime="process"`` the plan's roles (planner, source loaders,
constructors) run in a *data process* beside the trainers, not in them: its
readers, tokenizers and packing never share a GIL with a training loop. The
trainer's thread only takes a ready batch: it receives a short message (JSON)
naming a shared-memory slot that already holds the batch's arrays, and
returns numpy views on it (:class:`ProcessStream`). The server side is
:mod:`overlord.dist.data_server`; the process's entry point
:mod:`overlord.ops.data_process`.

Who starts it: ``overlord.Loader(plan, runtime="process")`` (and the
PyTorch dataset, ``OverlordIterableDataset.from_plan(..., runtime="process")``)
starts one for its own trainer; under ``torchrun`` the node's rank 0 starts
one for every rank of the node (:func:`node_stream`) and tells the others
where it listens over node mode's gloo group (once, at the start). The data
process is a child of the process that started it, in a session of its own
(a Ctrl-C reaches the trainers, which end it), and it watches its parent:
when that process is gone, it fails every rank still reading, naming it, and
exits; no data process outlives its trainer.

**Lifetime of a batch.** A batch's arrays are views on its slot. The slot is
handed back to the data process once nothing references them any more
(the batch, its arrays, tensors made from them without a copy): in a loop
``for batch in stream``, when the next batch replaces it. A trainer that
keeps a batch keeps its slot (and its memory, as a copy would); ``del batch``
releases it explicitly. Tensor-parallel peers of a node map the same slot:
a write into one's batch is seen by the others, so do not write into a
batch's arrays in place (copy first, as ``to_torch`` does for the int64 ids).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Client as connect
from multiprocessing.connection import Connection
from typing import Any

from overlord.batch import Batch, samples_of_wire
from overlord.errors import (
    ActorDiedError,
    CheckpointError,
    LoaderError,
    OutputError,
    RanksApart,
    SourceError,
)
from overlord.plan.spec import Plan
from overlord.roles.feedback import check_report
from overlord.runtime.shm_ring import SlotViews

ENTRY = "overlord.ops.data_process"  # the data process's module (python -m)


def encode(obj: Any) -> bytes:
    """A message body: compact JSON."""
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass
class Endpoint:
    """Where a data process listens, the key it takes, and the state its streams start from."""

    address: str
    authkey: bytes
    start: dict[str, Any]


class DataProcess:
    """A data process of this process's own: started, ready, closed.

    ``ranks`` streams are served (the world's DP ranks, or every mesh rank
    when the plan has CP, TP or PP); ``node``: they are other processes,
    ``owner``: this process's rank among them (named when it dies).
    ``journal_dir``: the Loader's there (``overlord.Loader``). :meth:`ask` asks
    the Loader there for its figures, or to steer its roles.
    """

    def __init__(
        self,
        plan: Plan,
        state: dict[str, Any] | None,
        node: bool,
        owner: int = 0,
        journal_dir: str | None = None,
    ):
        self.timeout_s = plan.loading.timeout_s
        self._asking = threading.Lock()  # one question at a time, and none after close
        self._asked = 0  # questions asked: each answer names its own
        here, there = _pipe()
        address = os.path.join(tempfile.gettempdir(), f"overlord-{uuid.uuid4().hex[:12]}.sock")
        authkey = secrets.token_bytes(32)
        config = {
            # the fields the plan was given, so that its defaults are chosen there as here
            "plan": plan.model_dump(mode="json", exclude_unset=True),
            "base_dir": str(plan.base_dir),
            "state": state, "address": address, "authkey": authkey.hex(), "node": node,
            "owner": owner, "journal_dir": journal_dir,
        }  # fmt: skip
        cmd = [sys.executable, "-m", ENTRY, str(there.fileno()), str(os.getpid())]
        self.proc = subprocess.Popen(cmd, pass_fds=[there.fileno()], start_new_session=True)
        there.close()
        self._control: Connection | None = here
        try:
            here.send_bytes(encode(config))
            reply = self._reply(self.timeout_s + 120)
        except BaseException:
            self.close()
            raise
        if "error" in reply:
            self.close()
            raise _error(reply["error"])
        self.endpoint = Endpoint(address, authkey, reply["ready"])

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self._control is not None
        try:
            if not self._control.poll(timeout_s):
                raise LoaderError(
                    f"overlord's data process did not start within {timeout_s:.0f} s "
                    "(loading.timeout_s + 120): see its output above"
                )
            reply: dict[str, Any] = json.loads(self._control.recv_bytes())
            return reply
        except (EOFError, OSError) as e:
            code = self.proc.poll()
            raise LoaderError(
                f"overlord's data process ended while starting (exit code {code}): see its "
                "output above"
            ) from e

    def ask(self, name: str, *args: Any, reports: dict[int, int] | None = None) -> Any:
        """The data process's Loader's ``name(*args)`` (a method of its, or a property): the answer.

        ``name`` is one of :data:`overlord.ops.data_process.ASKS`; the answer
        comes as JSON (a tuple is a list; a dict's keys are strings). The
        Loader's error is raised here with its type. ``reports``: how many
        reports each rank's stream sent; the question is answered once the
        planner has them.
        """
        with self._asking:
            control = self._control
            if control is None:
                raise LoaderError(f"Loader.{name}: overlord's data process is closed")
            self._asked += 1
            try:
                question = {"ask": name, "args": list(args), "id": self._asked}
                control.send_bytes(encode({**question, "reports": reports or {}}))
                while True:  # an answer to a question that timed out before is passed over
                    if not control.poll(self.timeout_s + 30):
                        raise LoaderError(
                            f"Loader.{name}: overlord's data process did not answer within "
                            f"{self.timeout_s + 30:.0f} s (loading.timeout_s + 30)"
                        )
                    reply: dict[str, Any] = json.loads(control.recv_bytes())
                    if reply.get("id") == self._asked:
                        break
            except (EOFError, OSError) as e:
                raise LoaderError(
                    f"Loader.{name}: overlord's data process ended (exit code "
                    f"{self.proc.poll()}): see its output above"
                ) from e
        if "error" in reply:
            raise _error(reply["error"])
        return reply["answer"]

    @property
    def pid(self) -> int:
        """The data process's pid."""
        return self.proc.pid

    def close(self) -> None:
        """End the data process once every rank closed its stream (within ``loading.timeout_s``)."""
        with self._asking:
            control, self._control = self._control, None
        if control is not None:
            with contextlib.suppress(OSError):
                control.send_bytes(encode({"close": True}))
            try:  # it answers once it unlinked its slots (after any answer still on its way)
                while control.poll(self.timeout_s + 30):
                    if "closed" in json.loads(control.recv_bytes()):
                        break
            except (EOFError, OSError):
                pass
            control.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pipe() -> tuple[Connection, Connection]:
    """A connected pair; the child's end is inheritable, passed by its descriptor number."""
    import socket

    a, b = socket.socketpair()
    here, there = Connection(a.detach()), Connection(b.detach())
    os.set_inheritable(there.fileno(), True)
    return here, there


# errors raised again here with their type: built from their message alone
_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError,
    "LoaderError": LoaderError, "RanksApart": RanksApart,
    "ActorDiedError": ActorDiedError, "CheckpointError": CheckpointError,
    "OutputError": OutputError,
}  # fmt: skip


def _error(info: dict[str, Any], message: str | None = None) -> Exception:
    """An error of the data process (:func:`~overlord.dist.data_server.describe`), raised here.

    A source's error is rebuilt from its fields (its message names source,
    file and row); a known type from ``message`` (default: its own); any
    other is a LoaderError that names it.
    """
    if "fields" in info:
        return SourceError(*info["fields"])
    kind = _ERRORS.get(info["type"])
    if kind is not None:
        return kind(message or info["message"])
    return LoaderError(f"overlord's data process failed: {info['type']}: {info['message']}")


class ProcessStream(Iterator[Batch]):
    """One rank's batches from a data process: views on shared memory, taken by this thread.

    ``open_()`` reaches the data process (on first use) and gives its
    :class:`Endpoint`; ``rank`` is the stream's id there (the DP rank, or the
    global rank in a mesh) and ``dp_rank`` the rank its batches name.
    ``check(stream)``, called before each batch, may refuse one that could
    never come (ranks of one process too far apart). ``owned``: a data process
    this stream ends with it. ``startable``: ``open_`` starts the data process
    from this stream's state (see :meth:`load_state_dict`).
    """

    def __init__(
        self,
        open_: Callable[[dict[str, Any] | None], Endpoint],
        rank: int,
        dp_rank: int,
        stop_step: int | None = None,
        state: dict[str, Any] | None = None,
        check: Callable[[ProcessStream], None] | None = None,
        startable: bool = False,
    ):
        self._open, self.rank, self.dp_rank = open_, rank, dp_rank
        self._startable = startable  # whether the data process starts from this stream's state
        self.stop_step, self._check = stop_step, check
        self._state = state  # the state as of this stream's position, parsed
        self._after: bytes | None = None  # ... or as received, parsed when asked for
        self.step = int((state or {}).get("step", 0))
        self._conn: Connection | None = None
        self._views = SlotViews()
        self._ending: str | None = None  # "end", or the error every later call raises
        self._error: dict[str, Any] | None = None  # the error behind it, where one is
        self.owned: DataProcess | None = None
        self.closed = False
        self.reports = 0  # sent to the data process
        self.slot: str | None = None  # the segment of the last batch (peers': the same)
        self._names: list[str] | None = None  # the plan's sources, for checking reports

    def _connect(self) -> Connection:
        if self._conn is None:
            end = self._open(self._state)
            if self._state is None:
                self._state = end.start
                self.step = int(end.start.get("step", 0))
            conn = connect(end.address, family="AF_UNIX", authkey=end.authkey)
            conn.send_bytes(encode({"rank": self.rank}))
            self._conn = conn
            atexit.register(_close_at_exit, weakref.ref(self))
        return self._conn

    def __next__(self) -> Batch:
        """The next step's batch: views on its slot (see the module docstring for how long)."""
        if self.stop_step is not None and self.step >= self.stop_step:
            raise StopIteration
        if self._ending is not None:
            if self._ending == "end":
                raise StopIteration
            raise LoaderError(self._ending) if self._error is None else _error(self._error)
        if self._check is not None:
            self._check(self)
        conn = self._connect()
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError) as e:
            self._ending = (
                f"rank {self.rank} lost overlord's data process: {type(e).__name__}: {e}; its "
                "process died (see its output)"
            )
            raise LoaderError(self._ending) from e
        head, _, after = data.partition(b"\n")
        info = json.loads(head)
        if info["k"] != "b":
            self._ending = "end" if info["k"] == "end" else str(info["message"])
            self._error = info.get("error")
            return self.__next__()
        try:
            batch = self._batch(info)
        except OSError as e:  # its slot is gone: the data process ended with an error queued
            self._ending = self._last_word(conn, e)
            return self.__next__()
        self.slot = info["shm"]
        if (batch.step, batch.rank) != (self.step, self.dp_rank):
            raise LoaderError(
                f"rank {self.rank} expected step {self.step} of DP rank {self.dp_rank} and "
                f"received step {batch.step} of DP rank {batch.rank} from the data process"
            )
        with contextlib.suppress(OSError):  # the data process is gone: the next receive says so
            conn.send_bytes(encode({"took": batch.step, "free": self._views.released()}))
        self.step += 1
        self._after, self._state = after, None
        return batch

    def _last_word(self, conn: Connection, e: OSError) -> str:
        """Why the data process ended: the error it queued behind the batches, or its exit."""
        try:
            while True:
                head = conn.recv_bytes().partition(b"\n")[0]
                info = json.loads(head)
                if info["k"] != "b":
                    self._error = info.get("error")
                    return "end" if info["k"] == "end" else str(info["message"])
        except (EOFError, OSError):
            return (
                f"rank {self.rank} lost overlord's data process: a batch's shared memory is "
                f"gone ({type(e).__name__}: {e}): the data process ended (see its output)"
            )

    def _batch(self, info: dict[str, Any]) -> Batch:
        arrays, _ = self._views.arrays(info["shm"], info["size"], info["layout"], info["slot"])
        layout, cp_rank, cp_size = info["cp"]
        cost_llm, cost_encoder = info["costs"]
        return Batch(
            info["step"], info["rank"], arrays.get("input_ids"), arrays.get("labels"),
            arrays["position_ids"], arrays["segment_ids"], arrays["cu_seqlens"],
            samples_of_wire(info["samples"], arrays.get("samples")), info["cost"],
            global_positions=arrays.get("global_positions"), cp_layout=layout,
            cp_rank=cp_rank, cp_size=cp_size, cp_groups=arrays.get("cp_groups"),
            pixel_values=arrays.get("pixel_values"), image_grid=arrays.get("image_grid"),
            cost_llm=cost_llm, cost_encoder=cost_encoder,
        )  # fmt: skip

    def report(
        self, step: int, seconds: float, loss_by_source: dict[str, float] | None = None
    ) -> None:
        """Tell the planner this rank trained ``step`` in ``seconds`` (see ``Client.report``).

        One message to the data process, which hands it to the rank's client there;
        the trainer does not wait for the planner. A malformed report raises
        ``ValueError`` here, naming the field.
        """
        if self._names is None:  # the plan's sources, from the state (read once)
            self._names = list(self.state_dict().get("sources", {}))
        losses = check_report(step, seconds, loss_by_source, self._names)
        conn = self._connect()
        conn.send_bytes(encode({"report": [int(step), float(seconds), losses]}))
        self.reports += 1

    def flush(self) -> None:
        """Nothing to wait for: the Loader's next question is answered after the reports sent.

        (``Client.flush`` waits for its one-way calls; a stream's reports are
        messages in order, and the data process answers ``Loader.stats``,
        ``monitor`` and ``feedback`` once the planner has every report its
        Loader's streams sent.)
        """

    def state_dict(self) -> dict[str, Any]:
        """The stream's state as of this rank's position (what a resume starts from)."""
        if self._state is None and self._after is None:
            self._connect()
        if self._state is None:
            assert self._after is not None
            self._state = json.loads(self._after)
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that the stream is at ``state``; where it starts the data process, start there.

        A stream of a node (:func:`node_stream`) starts the data process on
        first use: before then ``state`` is where it starts. Otherwise (and
        after the first use) the data process started from a state of its
        own, and a checkpoint that is not this rank's position is refused.
        """
        if self._conn is None and self._startable:
            self._state, self._after = state, None
            self.step = int(state.get("step", 0))
            return
        here = self.state_dict()
        if state.get("fingerprint") != here.get("fingerprint") or state.get("step") != self.step:
            raise CheckpointError(
                f"the running stream is not where the checkpoint resumes (rank {self.rank}): "
                f"expected step {state.get('step')} of fingerprint {state.get('fingerprint')} "
                f"(checkpoint), found step {self.step} of {here.get('fingerprint')} (running); "
                "a data process starts from a state once: start a new Loader from it "
                "(Loader(plan, state=..., runtime='process'))"
            )

    def close(self, failure: str | None = None) -> None:
        """Tell the data process this rank is done (or failed, naming why); end an owned one.

        Called while an exception unwinds (``with`` a Loader whose body
        raised), it is this rank's failure: the data process fails every
        other rank, naming it, instead of feeding them on.
        """
        if self.closed:
            return
        self.closed = True
        unwinding = sys.exc_info()[1]
        if failure is None and unwinding is not None:
            failure = f"{type(unwinding).__name__}: {unwinding}"
        conn, self._conn = self._conn, None
        if conn is not None:
            message: dict[str, Any] = {"free": self._views.released(), "bye": failure is None}
            if failure is not None:
                message["failed"] = failure
            with contextlib.suppress(OSError):
                conn.send_bytes(encode(message))
            conn.close()
        if self.owned is not None:
            self.owned.close()

    def __enter__(self) -> ProcessStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_at_exit(ref: weakref.ref[ProcessStream]) -> None:
    stream = ref()
    if stream is None or stream.closed:
        return
    # the process dies of an uncaught exception: the data process fails the others, naming it
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    stream.close(None if failed is None else f"{type(failed).__name__}: {failed}")


def node_stream(
    plan: Plan,
    state: dict[str, Any] | None,
    stop_step: int | None,
    rank: int,
    dp_rank: int,
) -> ProcessStream:
    """The stream of this torchrun process; the node's rank 0 starts the data process for all.

    On first use every rank joins node mode's gloo group (as the gloo node
    mode does), rank 0 starts the data process from ``state`` (the same on
    every rank) and broadcasts where it listens; every rank then connects.
    """
    stream: ProcessStream

    def open_(start: dict[str, Any] | None) -> Endpoint:
        import torch
        import torch.distributed as dist

        from overlord.dist.channel import node_group

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # from torchrun's environment
        group = node_group(plan.loading.timeout_s)
        payload = b""
        if dist.get_rank() == 0:
            try:
                stream.owned = owned = DataProcess(plan, start, node=True, owner=0)
                e = owned.endpoint
                payload = encode({"address": e.address, "key": e.authkey.hex(), "start": e.start})
            except Exception as e:
                payload = encode({"error": f"{type(e).__name__}: {e}"})
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        data = torch.zeros(int(size.item()), dtype=torch.uint8)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=group)
        info = json.loads(bytes(data.numpy().tobytes()))
        if "error" in info:
            raise LoaderError(f"the node's data process (rank 0) did not start: {info['error']}")
        return Endpoint(info["address"], bytes.fromhex(info["key"]), info["start"])

    stream = ProcessStream(open_, rank, dp_rank, stop_step, state, startable=True)
    return stream
