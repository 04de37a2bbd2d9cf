"""A job served on Ray, and trainer processes that connect to it.

``overlord serve PLAN --name JOB`` starts the roles as named actors and waits;
each trainer process calls :func:`connect` with its DP rank and iterates.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from overlord.errors import LoaderError
from overlord.loader import Loader
from overlord.plan.spec import Plan
from overlord.roles.client import Client
from overlord.state import checkpoint, runs
from overlord.state.checkpoint import check_state
from overlord.streams import open_stream


def _lock_path(name: str) -> str:
    """The lock file of job ``name`` for this user, in the temporary folder."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"overlord-{os.getuid()}-serve-{safe}-{digest}.lock")


@contextlib.contextmanager
def job_lock(name: str) -> Iterator[Callable[[str], None]]:
    """Hold job ``name`` on this machine while ``serve`` runs; refuse a second holder.

    Without ``--address`` each ``serve`` starts a Ray instance of its own, where
    the name is free, so Ray's named actors cannot refuse a second job of the
    same name. An exclusive ``flock`` on a file named after the job is the
    machine's own record: it holds whether or not the two serves share a Ray
    instance, it has no race (two serves starting at once: one gets it), and
    the kernel releases it when the process ends, however it ends, so a
    crashed serve never blocks the name (the file may stay; it is not the lock).
    The lock is per user (the file is in the temporary folder, named with the
    uid), as each user's serve runs a Ray of its own.

    Yields a function that writes the job's Ray address into the file, where
    :func:`job_address` finds it: trainers and ``overlord status`` on this
    machine join the job's own instance without being told its address, never
    one that Ray's address file names (another user's, or a stale one).
    """
    path = _lock_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def record(address: str | None) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "address": address}).encode(), 0)

    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd).get("pid", "unknown")
            raise LoaderError(
                f"a job named '{name}' is already served on this machine (by process {holder}; "
                f"lock {path}): stop that 'overlord serve' first (Ctrl-C), or choose another "
                "--name"
            ) from None
        record(None)
        yield record
    finally:
        os.close(fd)  # releases the lock


def _read_record(fd: int) -> dict[str, Any]:
    """A job file's record (empty if unreadable: a serve of an older version wrote its pid)."""
    data = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        found = json.loads(data)
    except ValueError:
        return {"pid": data} if data.isdigit() else {}
    return found if isinstance(found, dict) else {}


def job_address(name: str) -> str | None:
    """The Ray address of job ``name`` while this user serves it on this machine, else None."""
    try:
        fd = os.open(_lock_path(name), os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: the job is served, and its record is current
            address = _read_record(fd).get("address")
            return address if isinstance(address, str) and address else None
        return None  # nobody holds it: a serve that ended
    finally:
        os.close(fd)


def _address_of(job: str, address: str | None) -> str:
    """Where to join for job ``job``: the address given, ``RAY_ADDRESS``, the job's own, or auto."""
    return address or os.environ.get("RAY_ADDRESS") or job_address(job) or "auto"


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command (``signum`` says which).

    A KeyboardInterrupt, so that it unwinds like Ctrl-C, stopping what was started on the way.
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def serve(
    plan: Plan,
    name: str,
    address: str | None = None,
    resume: str | None = None,
    ready: Callable[[Loader], None] | None = None,
    stop: threading.Event | None = None,
    connect_timeout: float | None = None,
) -> int:
    """Run job ``name`` until ``stop`` is set or SIGINT/SIGTERM; stop every actor on the way out.

    Returns 0 when ``stop`` ended it, 128 + the signal's number when a signal did (130
    for Ctrl-C, 143 for SIGTERM). A signal while the job starts (connecting to Ray,
    starting actors) raises :class:`Stopped` at once, and what was started is stopped;
    while it serves, the job is stopped in order, and a second signal cuts that short.
    Joining the cluster at ``address`` gives up after ``connect_timeout`` seconds
    (None: ``OVERLORD_CONNECT_TIMEOUT``, else 60). A second ``serve`` of the same name on
    this machine is refused (see :func:`job_lock`).
    """
    state = checkpoint.load(resume) if resume else None
    if state is not None and resume is not None:  # a changed plan: refused fields named
        folder = Path(resume) if Path(resume).is_dir() else Path(resume).parent
        check_state(state, plan, runs.kept_plan(folder, state.get("fingerprint")))
    stop = stop or threading.Event()
    serving = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if not serving.is_set() or got:
            raise Stopped(signum)
        got.append(signum)
        stop.set()

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        with (
            job_lock(name) as record,
            Loader(
                plan, runtime="ray", state=state, job=name, address=address,
                connect_timeout=connect_timeout,
            ) as loader,
        ):  # fmt: skip
            import ray

            record(ray.get_runtime_context().gcs_address)
            # serving before it says it is ready: a signal that follows the ready line stops
            # the job in order (it raised Stopped when it came before serving was set)
            serving.set()
            if ready is not None:
                ready(loader)
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + got[0] if got else 0


def connect(
    job: str,
    rank: int | None = None,
    address: str | None = None,
    stop_step: int | None = None,
    *,
    global_rank: int | None = None,
    state: dict[str, Any] | None = None,
    connect_timeout: float | None = None,
) -> Client:
    """The batches of DP rank ``rank``, or of mesh rank ``global_rank``, from the job ``job``.

    ``rank`` (a DP rank) is a trainer process only where ``cp = tp = pp = 1``;
    in a mesh pass ``global_rank`` (see ``Loader.rank_client``). Reads
    ``RAY_ADDRESS`` when ``address`` is None, else the address of the job that
    ``overlord serve`` serves on this machine (:func:`job_address`), else
    ``auto``.

    ``state`` (a trainer's checkpoint, from ``Client.state_dict()``: any state
    the job handed out) rewinds the live job to it once every rank reconnected
    with the same state, and the steps from it are served again, exactly as
    before (see :mod:`overlord.roles.rewind`).
    Where the batches come from is :func:`overlord.streams.open_stream`'s to say.
    Joining the cluster gives up after ``connect_timeout`` seconds (None:
    ``OVERLORD_CONNECT_TIMEOUT``, else 60) with an error naming its address.
    """
    from overlord.runtime.ray_runtime import init_ray

    init_ray(_address_of(job, address), connect_timeout)
    stream = open_stream(
        job=job, rank=rank, address=address, stop_step=stop_step, global_rank=global_rank,
        state=state,
    )  # fmt: skip
    assert isinstance(stream, Client)  # a job's stream is a Client of its roles
    return stream


def wait_for_job(
    job: str,
    timeout: float = 60.0,
    address: str | None = None,
    connect_timeout: float | None = None,
) -> None:
    """Block until job ``job`` can be connected to (for scripts that start serve alongside).

    ``connect_timeout`` bounds joining the cluster, as in :func:`connect`; ``timeout``
    the wait for the job once joined.
    """
    from overlord.runtime.ray_runtime import init_ray, lookup

    init_ray(_address_of(job, address), connect_timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            lookup(job, "planner")
            return
        except LoaderError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
