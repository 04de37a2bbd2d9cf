"""The embedded runtime: every role is an object in this process.

It has no object store (a batch is handed over by reference anyway), and
leaves the allocators alone (this is the user's process). Roles asked to
share a host share one here too, so that co-location behaves alike everywhere.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from overlord.errors import ActorDiedError, LoaderError
from overlord.runtime.base import DEFAULT_OPTIONS, Done, Gone, Handle, RoleOptions, found_or_spawned
from overlord.runtime.hosting import SEP, HostedHandle, Hosts, close_role, drop, hosted


class Queued:
    """The Ref of a call queued on a role (:meth:`InlineHandle.defer`), not run yet.

    ``result`` runs the role's queued calls on the asking thread if nobody has
    yet (after the call under way on the role, if any, ends): waiting for one
    never depends on another call coming.
    """

    def __init__(self, handle: InlineHandle):
        self._handle = handle
        self._done: Done[Any] | None = None

    def settle(self, done: Done[Any]) -> None:
        """The call ran: what it returned or raised."""
        self._done = done

    def done(self) -> bool:
        """Whether the call has run."""
        return self._done is not None

    def result(self, timeout: float | None = None) -> Any:
        """Its value or its error, running the role's queued calls first if nobody has."""
        if self._done is None:
            self._handle.run_queued(timeout)
        if self._done is None:
            raise TimeoutError(
                f"{self._handle.name}: a queued call did not run within {timeout} s "
                "(a call under way on the role holds it)"
            )
        return self._done.result()


class InlineHandle:
    """A role object; calls run synchronously in the caller's thread.

    ``serial``: one call at a time, as an actor that serves one call at once
    (``RoleOptions.max_concurrency == 1``) does; the planner, for one, is
    called from the trainer's thread and from constructors' build threads.

    A serial role also takes calls that nobody waits for (:meth:`defer`):
    they are queued, and run in order before the role's next call, on the
    thread that makes it. A trainer's consumption notices reach the planner
    this way: the trainer's thread only queues them, and the build thread's
    next plan runs them, with no thread of their own to wake.
    """

    def __init__(
        self,
        obj: Any,
        name: str,
        cls: type[Any] | None = None,
        args: tuple[Any, ...] = (),
        serial: bool = False,
    ):
        self.obj = obj
        self.name = name
        self.dead = False  # killed: calls fail as calls to a dead actor do
        self._cls, self._args = cls, args  # to construct it again (restart)
        self._lock: Any = threading.RLock() if serial else contextlib.nullcontext()
        self._serial = serial
        # calls queued by defer, run before the next call from outside the role (serial only)
        self._queued: deque[tuple[Queued, Callable[..., Any], tuple[Any, ...], dict[str, Any]]]
        self._queued = deque()
        self._depth = 0  # calls under way (serial: on the one thread that holds the lock)

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Done[Any]:
        """Run the method now (after the queued calls) and keep what it returned or raised."""
        if not self._serial:  # calls at once on several threads: none is queued
            return self._run(method, args, kwargs)
        with self._lock:
            if self._queued and not self._depth:  # not within a call of the role's own
                self._run_queued()
            self._depth += 1
            try:
                return self._run(method, args, kwargs)
            finally:
                self._depth -= 1

    def _run(
        self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Done[Any]:
        if self.dead:
            return Done(error=ActorDiedError(f"{self.name}: the role was killed"))
        try:
            return Done(getattr(self.obj, method.__name__)(*args, **kwargs))
        except Exception as e:  # raised by Done.result, in the caller
            return Done(error=e)

    def defer(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Queued | None:
        """Queue ``method(*args)`` to run before the role's next call; its Ref.

        None where the role is not serial: its calls may run at once on several
        threads, so queued calls would have no next call to run before.
        """
        if not self._serial:
            return None
        ref = Queued(self)
        self._queued.append((ref, method, args, kwargs))
        return ref

    def run_queued(self, timeout: float | None = None) -> None:
        """Run the queued calls now, once the call under way (if any) ends, or ``timeout``."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return
        try:
            if not self._depth:
                self._run_queued()
        finally:
            self._lock.release()

    def _run_queued(self) -> None:
        """The queued calls, in order (the lock held)."""
        self._depth += 1
        try:
            while self._queued:
                ref, method, args, kwargs = self._queued.popleft()
                ref.settle(self._run(method, args, kwargs))
        finally:
            self._depth -= 1


class InlineRuntime:
    """Roles as plain objects. Loaders still read ahead on their own threads."""

    name = "inline"
    objects = None  # no object store: a payload is passed by reference in one process

    def __init__(self) -> None:
        self._handles: list[InlineHandle] = []
        self._closed = False
        self._hosts = Hosts(self.spawn)

    def spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """Construct the role here (``options`` place actors; here there is one process).

        After :meth:`shutdown` nothing is spawned (a failover under way when the
        job closes must not start a loader that nobody will close).
        """
        if self._closed:
            raise LoaderError(f"cannot start '{name}': the job's runtime was shut down")
        if options.host is not None:
            return self._hosts.spawn(cls, args, name, options)
        h = InlineHandle(cls(*args), name, cls, args, serial=options.max_concurrency == 1)
        self._handles.append(h)
        return h

    def lookup(self, name: str) -> Handle[Any]:
        """The live role called ``name``, or a :class:`Gone` stand-in."""
        if SEP in name:
            return hosted(name, self.lookup)
        for h in self._handles:
            if h.name == name and not h.dead:
                return h
        return Gone(name)

    def lookup_or_spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """The live role called ``name``, else a new one."""
        return found_or_spawned(self, cls, *args, name=name, options=options)

    def restart(self, handle: InlineHandle) -> None:
        """Close the role and construct it again from the same arguments, as Ray restarts one.

        Holders of ``handle`` reach the new object; what the old one held is gone.
        """
        assert handle._cls is not None, "only a spawned role can be restarted"
        with handle._lock:
            close_role(handle.obj)
            handle.obj = handle._cls(*handle._args)

    def kill(self, handle: Handle[Any]) -> None:
        """Close the role (stops its threads); later calls to it fail with ActorDiedError."""
        if isinstance(handle, HostedHandle):
            if drop(handle):  # the host's last role: the host goes too
                self._hosts.forget(handle.host.name)
                self.kill(handle.host)
            return
        if not isinstance(handle, InlineHandle):
            return  # a Gone stand-in: nothing runs
        with handle._lock:
            handle.dead = True
        close_role(handle.obj)
        if handle in self._handles:
            self._handles.remove(handle)

    def shutdown(self) -> None:
        """Close every role, newest first."""
        self._closed = True
        for h in reversed(list(self._handles)):
            self.kill(h)
