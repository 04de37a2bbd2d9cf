"""The runtime seam: spawn a role, look it up, call its methods, kill it, shut down.

Roles never know what runs them. ``inline`` runs every role as an object in
the calling process; ``ray`` runs each as an actor. A call names the method of
the role's Protocol (``planner.call(PlannerRole.rank_plan, step, rank)``), so
mypy checks its arguments and its result at every call site, and it returns a
:class:`Ref` at once, so that several calls can be in flight together. A Ref
resolves itself: ``ref.result()`` is the value, or the role's error raised
here with the role and the method named.

A call nobody waits for is sent through :class:`OneWay`, which keeps its Ref
and raises its error at the sender's next check: no error is dropped.

A runtime whose calls cross processes counts them (:func:`count_call`), so that
a benchmark can say how many calls a step costs (:func:`calls_made`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from overlord.errors import ActorDiedError, LoaderError
from overlord.runtime.objects import ObjectStore
from overlord.runtime.threads import Builder

log = logging.getLogger("overlord.runtime")

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")


_CALLS: Counter[str] = Counter()
_CALLS_LOCK = threading.Lock()


def count_call(method: str) -> None:
    """Count one call this process sent to another (a runtime's handles call it)."""
    with _CALLS_LOCK:
        _CALLS[method] += 1


def calls_made() -> dict[str, int]:
    """Calls this process has sent to roles in other processes, by method name."""
    with _CALLS_LOCK:
        return dict(_CALLS)


class Ref(Protocol[T_co]):
    """The pending result of a call."""

    def result(self, timeout: float | None = None) -> T_co:
        """Wait for the call; its value, or the role's error raised here."""
        ...

    def done(self) -> bool:
        """Whether the call has finished (without waiting)."""
        ...


@dataclass(frozen=True)
class Done(Generic[T]):
    """A call that already ran: its value or its error."""

    value: Any = None
    error: BaseException | None = None

    def result(self, timeout: float | None = None) -> T:
        """The value, or the error raised."""
        if self.error is not None:
            raise self.error
        out: T = self.value
        return out

    def done(self) -> bool:
        """Always finished."""
        return True


class Handle(Protocol[R_co]):
    """A spawned role whose methods are those of the Protocol ``R``."""

    name: str

    def call(
        self, method: Callable[Concatenate[R_co, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> Ref[T]:
        """Start ``method(*args)`` on the role; returns at once."""
        ...


class Gone:
    """A role known to be gone (a restarted planner finds no live role by that name).

    Every call fails as a call to a dead role does, so the caller's failover
    takes over. It stands for any role on any runtime.
    """

    def __init__(self, name: str):
        self.name = name

    def call(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> Ref[T]:
        """Fail with :class:`ActorDiedError`."""
        return Done(error=ActorDiedError(f"{self.name}: no such live role ({method.__name__})"))


@dataclass(frozen=True)
class RoleOptions:
    """How a runtime places one role (``ray`` reads them all; ``inline`` only ``host``)."""

    num_cpus: float = 0.0
    max_concurrency: int = 1  # calls the role serves at once
    scheduling_strategy: str | None = None  # "SPREAD", or None for the runtime's default
    node: str | None = None  # pin the role to this node (a Ray node id)
    # the runtime restarts the role (same constructor arguments) and retries calls in flight
    restartable: bool = False
    # co-location: the role is built in the process of the host of this name, with the
    # roles spawned there before it (overlord.runtime.hosting); None: a process of its own
    host: str | None = None
    # a process started for this role tunes its allocators first (hosting.lean_allocators)
    lean: bool = False


DEFAULT_OPTIONS = RoleOptions()


class Runtime(Protocol):
    """What runs the roles.

    ``objects`` is the runtime's object store, a capability the wiring hands
    to the roles that use one (None: the runtime has none). Whether roles run
    in processes of their own is the wiring's to know (it chose the runtime),
    and it passes what follows from it to the roles; a role never asks.
    """

    name: str

    @property
    def objects(self) -> ObjectStore | None:
        """The runtime's object store, if it has one."""
        ...

    def spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """Create a role ``cls(*args)`` named ``name``."""
        ...

    def lookup(self, name: str) -> Handle[Any]:
        """The live role called ``name``, or a :class:`Gone` stand-in; never raises."""
        ...

    def lookup_or_spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """The live role called ``name`` (one that outlived its spawner), else a new one."""
        ...

    def kill(self, handle: Handle[Any]) -> None:
        """Stop a role and free what it holds."""
        ...

    def shutdown(self) -> None:
        """Stop every role this runtime spawned."""
        ...


def found_or_spawned(
    runtime: Runtime, cls: type[Any], *args: Any, name: str, options: RoleOptions
) -> Handle[Any]:
    """What every runtime's ``lookup_or_spawn`` does: the live role ``name``, else a new one."""
    found = runtime.lookup(name)
    if isinstance(found, Gone):
        return runtime.spawn(cls, *args, name=name, options=options)
    return found


_Call = tuple[Any, Callable[..., Any], tuple[Any, ...], dict[str, Any], str]


class _Failed(Exception):
    """A call of a background job failed: which one (``what``) and its error."""

    def __init__(self, what: str, error: Exception):
        super().__init__(what)
        self.what, self.error = what, error


def _queued(
    handle: Handle[Any], method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Ref[Any] | None:
    """The call queued on the role to run before its next call, where the role queues calls."""
    defer = getattr(handle, "defer", None)
    return None if defer is None else defer(method, *args, **kwargs)


class OneWay:
    """Calls whose result nobody waits for, whose errors still reach the sender.

    ``send`` starts a call and keeps its Ref; ``check`` (called by the sender
    at its next step, and by ``send`` itself) raises the first error of a
    finished call as a :class:`LoaderError` naming the sender, the role and the
    method, and logs every one. Errors of the ``ignore`` types are expected
    (a release sent to a loader that died holds nothing to release) and only
    logged at debug level. At most ``limit`` calls are kept in flight; the
    oldest is waited for beyond that, so memory stays bounded.

    With ``background``, the sender's thread only queues the calls. That
    matters where a call runs on the caller's thread (the embedded runtime),
    e.g. a trainer's consumption notice, which would otherwise wait while
    the planner plans a step. A role that queues calls (a serial role of the
    embedded runtime: ``handle.defer``) runs them in order before its next
    call, on the thread that makes it; to other roles they are made in order
    on a thread of their own, started when first needed. Calls sent while
    that thread has not started on the ones before them join those (one job,
    one wake-up): 64 ranks' notices of a step are a job or two, not 64.
    """

    def __init__(
        self,
        sender: str,
        ignore: tuple[type[BaseException], ...] = (),
        limit: int = 1024,
        background: bool = False,
    ):
        self.sender, self.ignore, self.limit = sender, ignore, limit
        self._pending: deque[tuple[Ref[Any], str]] = deque()
        self._background = background
        self._thread: Builder | None = None  # started at the first call that needs it
        self._lock = threading.RLock()  # senders on several threads (a Loader's clients)
        # background: the calls of the job queued and not started yet, which later sends join
        self._open: list[_Call] | None = None
        self._open_lock = threading.Lock()  # never held while waiting (the job takes it)

    def send(
        self,
        handle: Handle[R],
        method: Callable[Concatenate[R, P], Any],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        """Start ``method(*args)`` on ``handle`` without waiting for it."""
        ref: Ref[Any]
        what = f"{handle.name}.{method.__name__}"
        with self._lock:
            if not self._background:
                ref = handle.call(method, *args, **kwargs)
            elif (queued := _queued(handle, method, args, kwargs)) is not None:
                ref = queued
            else:
                call: _Call = (handle, method, args, kwargs, what)
                with self._open_lock:
                    waiting = self._open  # the calls of a job not started yet: it takes this too
                    if waiting is not None:
                        waiting.append(call)
                    else:
                        calls = self._open = [call]
                if waiting is not None:
                    self.check()  # as a send that starts a job does (in keep)
                    return
                if self._thread is None:
                    self._thread = Builder(f"overlord-oneway-{self.sender}")
                ref = self._thread.submit(self._run, calls)
            self.keep(ref, what)

    def _run(self, calls: list[_Call]) -> None:
        """Make a job's calls in order (on the background thread); raise the first failure.

        Every call is made even when one before it failed, as separate calls would be.
        """
        with self._open_lock:  # from now on a send starts the next job
            if self._open is calls:
                self._open = None
        failed: _Failed | None = None
        for handle, method, args, kwargs, what in calls:
            try:
                handle.call(method, *args, **kwargs).result()
            except self.ignore as e:
                log.debug("%s: one-way call %s failed (expected): %s", self.sender, what, e)
            except Exception as e:
                failed = failed or _Failed(what, e)
                if failed.error is not e:
                    log.error("%s: one-way call %s failed: %s", self.sender, what, e)
        if failed is not None:
            raise failed

    def keep(self, ref: Ref[Any], what: str) -> None:
        """Keep a call started elsewhere (``what`` names it) as one of these one-way calls."""
        self.keep_each([(ref, what)])

    def keep_each(self, calls: Iterable[tuple[Ref[Any], str]]) -> None:
        """:meth:`keep` for several calls ``(ref, what)`` at once: one lock, one check."""
        with self._lock:
            self._pending.extend(calls)
            while len(self._pending) > self.limit:
                self._settle(*self._pending.popleft(), timeout=None)
        self.check()

    def check(self) -> None:
        """Raise the error of the first finished call that failed; forget the finished ones."""
        with self._lock:
            while self._pending and self._pending[0][0].done():
                self._settle(*self._pending.popleft(), timeout=0)

    def pending(self) -> bool:
        """Whether a call is in flight."""
        return bool(self._pending)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every call in flight, raising the first error."""
        with self._lock:
            while self._pending:
                self._settle(*self._pending.popleft(), timeout=timeout)

    def close(self, raise_errors: bool = True) -> None:
        """Wait for every call in flight (raising the first error); end the thread."""
        try:
            self.flush()
        except LoaderError:
            if raise_errors:
                raise
        finally:
            if self._thread is not None:
                self._thread.shutdown()

    def _settle(self, ref: Ref[Any], what: str, timeout: float | None) -> None:
        try:
            try:
                ref.result(timeout)
            except _Failed as f:  # a call of a background job: the one that failed
                what = f.what
                raise f.error from None
        except self.ignore as e:
            log.debug("%s: one-way call %s failed (expected): %s", self.sender, what, e)
        except Exception as e:
            log.error("%s: one-way call %s failed: %s: %s", self.sender, what, type(e).__name__, e)
            raise LoaderError(
                f"{self.sender}: the one-way call {what} failed: {type(e).__name__}: {e}"
            ) from e
