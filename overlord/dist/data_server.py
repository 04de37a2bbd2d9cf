"""The data process's server: every rank's batches, step by step, into shared-memory slots.

The node's data process (started by :mod:`overlord.dist.data_process`, its
entry point :mod:`overlord.ops.data_process`) runs the plan's roles (an
embedded Loader) and one :class:`DataServer`. The server takes every rank's
batch of a step from that Loader, in step order and rank order. The Loader's
packs write each batch's rows straight into a slot of the server's
:class:`~overlord.runtime.shm_ring.SlotPool` (``SlotPool.pack_block``), so a
batch lies in its slot without a copy (a batch made otherwise, a CP rank's
slices say, is written into one). Tensor-parallel peers receive the same batch
object, so they share one slot: batch memory per node does not grow with TP.
The server sends each rank a short message naming its slot, the arrays'
layout, the names its samples refer to and the state as of the step after it
(the samples' columns are an array of the slot: their records are made in the
trainer, when it reads them). A rank's
trainer maps the slot and takes the batch as views
(:class:`~overlord.dist.data_process.ProcessStream`).

Transport: ``multiprocessing.connection`` over a Unix socket that only
holders of the job's random key may use (the standard library's
authentication); every message is bytes of JSON (``Connection.send_bytes``),
nothing pickled. Messages to a rank: a batch (``{"k": "b", ...}`` then a
newline and the state's JSON), the end (``{"k": "end"}``) or an error
(``{"k": "error", "message": ...}``). From a rank: its hello (``{"rank":
r}``), then per batch taken ``{"took": step, "free": [slots]}`` (the slots
its trainer let go of since), and ``{"bye": true}`` when it closes.

Flow: the server builds step ``s`` only once every rank still reading has
taken step ``s - ahead``, so at most ``ahead`` batches per rank wait in
slots (and in its socket). A rank whose connection ends without its bye
died: every other rank is sent an error naming it, and nothing more is
built. A rank that never connects fails the others after
``loading.timeout_s``. The server's owner (the process that started the
data process) watches nothing of it: the server watches its owner (its
control connection, and its parent's pid) and fails the ranks, naming it,
when it is gone.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from overlord.batch import Batch, samples_wire
from overlord.batch.rows import use_blocks
from overlord.errors import SourceError
from overlord.runtime.shm_ring import SlotPool, needed


def steps_ahead(prefetch_steps: int) -> int:
    """Steps a data process builds ahead of its slowest rank (``batch.prefetch_steps`` + 3).

    Enough that a step that takes longer to read than the trainer's step (a
    new window of a shard) is absorbed before a trainer waits for it.
    """
    return prefetch_steps + 3


def encode(obj: Any) -> bytes:
    """A message body: compact JSON."""
    return json.dumps(obj, separators=(",", ":")).encode()


def describe(e: BaseException) -> dict[str, Any]:
    """An error as data, for the trainer to raise again with its type (a source's: its place)."""
    info: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, SourceError):
        info["fields"] = [e.source, e.file, e.row, e.reason]
    return info


def batch_arrays(batch: Batch) -> dict[str, Any]:
    """Every array a batch carries, by field name (images included)."""
    arrays: dict[str, Any] = dict(batch.arrays())
    if batch.pixel_values is not None:
        arrays["pixel_values"] = batch.pixel_values
    if batch.image_grid is not None:
        arrays["image_grid"] = batch.image_grid
    return arrays


def batch_meta(batch: Batch) -> dict[str, Any]:
    """What a batch is besides its arrays and samples (cost, CP fields), JSON-able."""
    return {
        "step": batch.step,
        "rank": batch.rank,
        "cost": batch.cost,
        "cp": [batch.cp_layout, batch.cp_rank, batch.cp_size],
        "costs": [batch.cost_llm, batch.cost_encoder],
    }


class _Rank:
    """One rank as the server sees it: its connection, what it took, what waits for it."""

    def __init__(self, rank: int, start: int):
        self.rank = rank
        self.conn: Connection | None = None
        self.taken = start  # the step it takes next
        self.pending: deque[bytes] = deque()  # built before it connected
        self.bye = False
        self.reports = 0  # the trainer's reports handed to the planner
        self.lock = threading.Lock()  # one sender at a time


class DataServer:
    """Serves ``streams`` (every rank's batches, in rank order) to the ranks that connect.

    ``streams[r]`` is rank ``r``'s iterator of batches (an embedded Loader's
    client); ``after()`` the state as of the step after the last one taken
    from every stream (the same for every rank of a step). ``start`` is the
    state the streams start from. ``node``: the ranks are processes that
    connect at their own pace (a rank that never connects fails the others
    after ``timeout_s``).
    """

    def __init__(
        self,
        streams: list[Iterator[Batch]],
        after: Callable[[], dict[str, Any]],
        start: dict[str, Any],
        listener: Listener,
        ahead: int,
        timeout_s: float,
        node: bool,
    ):
        self.streams, self._after, self.listener = streams, after, listener
        self.start_state = start
        self.step = int(start.get("step", 0))
        self.ranks = [_Rank(r, self.step) for r in range(len(streams))]
        self.ahead, self.timeout_s, self.node = ahead, timeout_s, node
        self.pool = SlotPool("batches")
        self._cv = threading.Condition()
        self._pool_lock = threading.Lock()
        use_blocks(self._pack_block)  # this process's packs write into slots
        self._finishing = threading.Lock()  # held while an ending is sent to every rank
        self.ending: bytes | None = None  # the end or error every rank receives
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def _pack_block(self, shape: tuple[int, ...]) -> np.ndarray:
        with self._pool_lock:
            return self.pool.pack_block(shape)

    # ---- threads -------------------------------------------------------------------------

    def start(self) -> None:
        """Accept ranks and build batches, each on a daemon thread."""
        for target, name in ((self._accept, "accept"), (self._serve, "serve")):
            t = threading.Thread(target=target, name=f"overlord-data-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn = self.listener.accept()
            except Exception:  # the listener closed (shutdown), or a peer without the key
                if self.stopping.is_set():
                    return
                continue
            threading.Thread(target=self._reader, args=(conn,), daemon=True).start()

    def _reader(self, conn: Connection) -> None:
        """One rank's messages: its hello, then what it took and let go of, then its bye."""
        try:
            if not conn.poll(self.timeout_s):
                conn.close()
                return
            hello = json.loads(conn.recv_bytes())
            r = int(hello["rank"])
            if not 0 <= r < len(self.ranks) or self.ranks[r].conn is not None:
                why = "outside the world" if not 0 <= r < len(self.ranks) else "taken already"
                conn.send_bytes(encode({"k": "error", "message": f"rank {r} is {why}"}))
                conn.close()
                return
        except (EOFError, OSError, ValueError, KeyError):
            conn.close()
            return
        rank = self.ranks[r]
        with rank.lock:
            rank.conn = conn
            try:
                while rank.pending:
                    conn.send_bytes(rank.pending.popleft())
                if self.ending is not None:
                    conn.send_bytes(self.ending)
            except OSError:
                pass  # the reads below see it gone
        with self._cv:
            self._cv.notify_all()
        while True:
            try:
                message = json.loads(conn.recv_bytes())
            except (EOFError, OSError, ValueError):
                if not rank.bye and self.ending is None:
                    self.fail(
                        f"rank {r} of the node is gone: its process died or closed its "
                        "connection to the data process without closing its stream, so "
                        "every rank stops"
                    )
                with self._cv:
                    rank.bye = True
                    self._cv.notify_all()
                return
            with self._pool_lock:
                for index in message.get("free", ()):
                    self.pool.release(int(index))
            if "report" in message:  # a trainer's step time: its client here sends it on
                self._report(r, message["report"])
                with self._cv:
                    rank.reports += 1
                    self._cv.notify_all()
            if message.get("failed"):
                self.fail(f"rank {r}'s trainer failed ({message['failed']}), so every rank stops")
            with self._cv:
                if "took" in message:
                    rank.taken = max(rank.taken, int(message["took"]) + 1)
                if message.get("bye") or message.get("failed"):
                    rank.bye = True
                self._cv.notify_all()

    def _report(self, r: int, report: list[Any]) -> None:
        """Rank ``r``'s report, to the planner through its client (checked at the trainer)."""
        send = getattr(self.streams[r], "report", None)
        if send is None:
            return
        step, seconds, losses = report
        # a source name the trainer could not check: the planner's count
        with contextlib.suppress(ValueError):
            send(int(step), float(seconds), losses)

    def _ready(self) -> bool:
        """Whether step ``self.step`` may be built: every rank reading is within ``ahead``."""
        reading = [x for x in self.ranks if not x.bye]
        return bool(reading) and all(self.step - x.taken < self.ahead for x in reading)

    def _wait(self) -> bool:
        """Wait until the next step may be built; False when the server stops instead."""
        since = time.monotonic()
        with self._cv:
            while not self._ready():
                if self.stopping.is_set() or self.ending is not None:
                    return False
                late = [x.rank for x in self.ranks if x.conn is None and not x.bye]
                if self.node and late and time.monotonic() - since > self.timeout_s:
                    names = ", ".join(str(r) for r in late)
                    self.fail(
                        f"rank(s) {names} of the node never connected to the data process "
                        f"within loading.timeout_s ({self.timeout_s:.0f} s)"
                    )
                    return False
                self._cv.wait(0.5)
            return not self.stopping.is_set() and self.ending is None

    def _serve(self) -> None:
        try:
            while self._wait():
                batches = [next(s) for s in self.streams]
                after = json.dumps(self._after(), separators=(",", ":")).encode()
                self._send_step(batches, after)
                self.step += 1
        except StopIteration:
            self.finish(encode({"k": "end"}))
        except Exception as e:
            if not self.stopping.is_set():
                self.fail(f"overlord's data process failed: {type(e).__name__}: {e}", e)

    def _send_step(self, batches: list[Batch], after: bytes) -> None:
        """Each distinct batch of the step into one slot; each rank its message."""
        written: dict[int, tuple[int, bytes]] = {}  # id(batch) -> slot index, message
        holders: dict[int, int] = {}
        tails: dict[int, int] = {}  # where the batches' other arrays go in slots packed into
        for batch in batches:
            if id(batch) in written:
                holders[written[id(batch)][0]] += 1
                continue
            arrays = batch_arrays(batch)
            names, columns = samples_wire(batch)  # the records' columns go as an array
            if columns is not None:
                arrays["samples"] = columns
            with self._pool_lock:  # packed into a slot (the pack's block): sent as it lies
                placed = self.pool.place(arrays, tails)
                slot = placed[0] if placed is not None else self.pool.acquire(needed(arrays))
            layout = placed[1] if placed is not None else slot.write(arrays)
            meta = batch_meta(batch) | {
                "k": "b", "slot": slot.index, "shm": slot.name, "size": slot.size,
                "layout": layout, "samples": names,
            }  # fmt: skip
            written[id(batch)] = (slot.index, encode(meta) + b"\n" + after)
            holders[slot.index] = holders.get(slot.index, 0) + 1
        with self._pool_lock:
            for index, count in holders.items():
                self.pool.hold(self.pool.slots[index], count)
        for rank, batch in zip(self.ranks, batches, strict=True):
            index, message = written[id(batch)]
            if not self._send(rank, message):
                with self._pool_lock:
                    self.pool.release(index)  # nobody will take it

    def _send(self, rank: _Rank, message: bytes) -> bool:
        """``message`` to ``rank`` (queued until it connects); False where it is not taken."""
        with rank.lock:
            if rank.bye:
                return False
            if rank.conn is None:
                rank.pending.append(message)
                return True
            try:
                rank.conn.send_bytes(message)
                return True
            except OSError:
                return False  # its reader sees it gone and fails the others

    # ---- the end ---------------------------------------------------------------------------

    def fail(self, message: str, error: BaseException | None = None) -> None:
        """Stop building; every rank receives ``message`` as an error (the first one wins).

        ``error``: the exception behind it, which the trainers raise again with its type.
        """
        what = {"k": "error", "message": message}
        self.finish(encode(what if error is None else what | {"error": describe(error)}))

    def finish(self, ending: bytes) -> None:
        """Send ``ending`` to every rank (and to any that connects later); build no more.

        A second caller (a rank's reader and the parent's watch can both see the
        end) returns once the first has told every rank: what follows, closing the
        connections and unlinking the slots, must not overtake the ending.
        """
        with self._finishing:
            with self._cv:
                if self.ending is not None:
                    return
                self.ending = ending
                self._cv.notify_all()
            for rank in self.ranks:
                with rank.lock:
                    if rank.conn is not None and not rank.bye:
                        with contextlib.suppress(OSError):
                            rank.conn.send_bytes(ending)

    def wait_for_reports(self, sent: dict[int, int], timeout_s: float) -> None:
        """Wait until the planner has rank ``r``'s first ``sent[r]`` reports, at most ``timeout_s``.

        A rank's reports come on its connection and a question of the starter's on
        another: what a rank sent before the question is answered first.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while any(self.ranks[r].reports < n and not self.ranks[r].bye for r, n in sent.items()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(min(left, 0.5))

    def wait_for_byes(self, timeout_s: float) -> None:
        """Wait until every connected rank closed its stream (or died), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while any(x.conn is not None and not x.bye for x in self.ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(min(left, 0.5))

    def close(self) -> None:
        """Stop every thread's work, close every connection and unlink the slots."""
        with self._finishing:  # an ending on its way to the ranks goes first
            self.stopping.set()
        with self._cv:
            self._cv.notify_all()
        with contextlib.suppress(OSError):
            self.listener.close()
        for rank in self.ranks:
            if rank.conn is not None:
                with contextlib.suppress(OSError):
                    rank.conn.close()
        use_blocks(None)
        with self._pool_lock:
            self.pool.close()
