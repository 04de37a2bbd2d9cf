"""Several roles in one process, and what a process that hosts loaders tunes when it starts.

A process costs tens of MB before it holds any data (a Ray actor with numpy and
pyarrow imported: about 60 MB), so a job with many small sources spends more
on processes than on source state. ``placement.loader_processes`` caps how
many processes hold the job's SourceLoaders. Co-location is the runtime's
business, asked for with :class:`~overlord.runtime.base.RoleOptions`: a role
spawned with ``host="NAME"`` is built inside the :class:`RoleHost` called
NAME (started with that first role's options), and its handle, a
:class:`HostedHandle`, takes the same typed ``call(Role.method, ...)`` as any
other. Its name is ``NAME/member``, which :meth:`Runtime.lookup` finds again.
The host builds whatever class it is given, so this module knows no role.

:func:`call_each` makes one call per process where several handles share one
(a constructor asking every loader of a step for its payloads: one round trip
per host, not per source).

``RoleOptions(lean=True)`` asks the runtime to tune the allocators of the
process it starts for the role (:func:`lean_allocators`) before the role is
built; node mode's rank 0, which hosts a node's loaders itself, calls it too.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from overlord.errors import ActorDiedError
from overlord.runtime.base import Gone, Handle, Ref, RoleOptions

A = TypeVar("A")
R = TypeVar("R")
T = TypeVar("T")

SEP = "/"  # between a host's name and a member's, in a hosted role's name
# a call waits this long for its member to be added and built (a loader's construction
# loads a tokenizer); a member never spawned is an error after it
MEMBER_WAIT_S = 600.0


class HostRole(Protocol):
    """A process that holds several roles, by member name."""

    def add(self, member: str, cls: type[Any], args: tuple[Any, ...]) -> None:
        """Build ``cls(*args)`` here as ``member``."""
        ...

    def call(self, member: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``method(*args, **kwargs)`` on ``member``."""
        ...

    def call_each(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """``method(arg)`` on each member named in ``args``, in one call."""
        ...

    def drop(self, member: str) -> int:
        """Close ``member`` and forget it; how many members are left."""
        ...

    def pid(self) -> int:
        """The host's process."""
        ...

    def close(self) -> None:
        """Close every member."""
        ...


class RoleHost:
    """Hosts roles by member name, and forwards calls to them.

    A member is added by a call of its own that nobody waits for, and a call
    to it waits until it was added: on a runtime that serves several calls at
    once, the add may still be on its way. The error of a member's
    construction is raised by every call to it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: dict[str, Future[Any]] = {}
        self._dropped: set[str] = set()  # calls to these fail as calls to a dead role do

    def _slot(self, member: str) -> Future[Any]:
        with self._lock:
            if member in self._dropped:
                raise ActorDiedError(f"{member}: the role was killed")
            fut = self._members.get(member)
            if fut is None:
                fut = self._members[member] = Future()
            return fut

    def _member(self, member: str) -> Any:
        return self._slot(member).result(timeout=MEMBER_WAIT_S)

    def add(self, member: str, cls: type[Any], args: tuple[Any, ...]) -> None:
        """Build ``cls(*args)`` as ``member`` (its error is raised by the calls to it)."""
        with self._lock:
            self._dropped.discard(member)
        fut = self._slot(member)
        try:
            fut.set_result(cls(*args))
        except Exception as e:
            fut.set_exception(e)

    def call(self, member: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``method(*args, **kwargs)`` on ``member``."""
        return getattr(self._member(member), method)(*args, **kwargs)

    def call_each(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """``method(arg)`` on each member named in ``args``: one round trip for them all."""
        return {m: getattr(self._member(m), method)(a) for m, a in args.items()}

    def drop(self, member: str) -> int:
        """Close ``member`` and forget it; how many members are left."""
        with self._lock:
            fut = self._members.pop(member, None)
            self._dropped.add(member)
            left = len(self._members)
        if fut is not None and fut.done() and fut.exception() is None:
            close_role(fut.result())
        return left

    def pid(self) -> int:
        """The process the host runs in."""
        return os.getpid()

    def close(self) -> None:
        """Close every member that was built."""
        with self._lock:
            members = list(self._members.values())
        for fut in members:
            if fut.done() and fut.exception() is None:
                close_role(fut.result())


class HostedHandle:
    """A role inside a :class:`RoleHost`: calls go through the host, by the method's name.

    Picklable, as every handle is (the planner sends them to constructors).
    """

    def __init__(self, host: Handle[HostRole], member: str):
        self.host, self.member = host, member
        self.name = f"{host.name}{SEP}{member}"

    def call(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> Ref[T]:
        """Start ``method(*args)`` on the member."""
        return self.host.call(HostRole.call, self.member, method.__name__, args, kwargs)


class Hosts:
    """The hosts one runtime started, by name; spawns a role into one, starting it if new.

    ``spawn`` is the runtime's own (a host is a role like any other).
    """

    def __init__(self, spawn: Callable[..., Handle[Any]]):
        self._spawn = spawn
        self._hosts: dict[str, Handle[HostRole]] = {}

    def spawn(
        self, cls: type[Any], args: tuple[Any, ...], name: str, options: RoleOptions
    ) -> HostedHandle:
        """``cls(*args)`` as member ``name`` of host ``options.host``."""
        assert options.host is not None
        host = self._hosts.get(options.host)
        if host is None:
            host = self._spawn(RoleHost, name=options.host, options=replace(options, host=None))
            self._hosts[options.host] = host
        # not waited for: the host's calls to the member wait for it (see RoleHost)
        host.call(HostRole.add, name, cls, args)
        return HostedHandle(host, name)

    def forget(self, host: str) -> None:
        """A host that was killed: a later role of that name starts a new one."""
        self._hosts.pop(host, None)


def hosted(name: str, lookup: Callable[[str], Handle[Any]]) -> Handle[Any]:
    """The role called ``host/member`` (``lookup`` finds the host), or a :class:`Gone`."""
    host_name, _, member = name.partition(SEP)
    host = lookup(host_name)
    return Gone(name) if isinstance(host, Gone) else HostedHandle(host, member)


def drop(handle: HostedHandle) -> bool:
    """Close a hosted role; whether its host is left empty (or dead: the runtime stops it)."""
    try:
        return handle.host.call(HostRole.drop, handle.member).result() == 0
    except ActorDiedError:
        return True


class _Picked:
    """One member's share of a call that answered for several members."""

    def __init__(self, ref: Ref[dict[str, Any]], member: str):
        self.ref, self.member = ref, member

    def result(self, timeout: float | None = None) -> Any:
        return self.ref.result(timeout)[self.member]

    def done(self) -> bool:
        return self.ref.done()


def call_each(method: Callable[[R, A], T], calls: Sequence[tuple[Handle[R], A]]) -> list[Ref[T]]:
    """``method(arg)`` on each handle, one call per process; each call's Ref, in order.

    Handles to roles of one host are answered by one call to the host (the
    host's calls are merged by its name: handles to one process may be
    copies); a host's death fails each of its members' Refs.
    """
    out: dict[int, Ref[T]] = {}
    batches: dict[str, list[tuple[int, HostedHandle, A]]] = {}
    for i, (handle, arg) in enumerate(calls):
        if isinstance(handle, HostedHandle):
            batches.setdefault(handle.host.name, []).append((i, handle, arg))
        else:
            out[i] = handle.call(method, arg)
    for batch in batches.values():
        while batch:  # a member asked twice: a second call for the second ask
            once: dict[str, tuple[int, A]] = {}
            later = []
            for i, handle, arg in batch:
                if handle.member in once:
                    later.append((i, handle, arg))
                else:
                    once[handle.member] = (i, arg)
            host = batch[0][1].host
            asked = {m: arg for m, (_, arg) in once.items()}
            ref = host.call(HostRole.call_each, method.__name__, asked)
            for m, (i, _) in once.items():
                out[i] = _Picked(ref, m)
            batch = later
    return [out[i] for i in range(len(calls))]


def spread(members: list[A], hosts: int) -> list[list[A]]:
    """Spread ``members`` over ``hosts`` hosts (fewer if there are fewer), round robin.

    >>> spread([("a", 0), ("a", 1), ("b", 0)], 2)
    [[('a', 0), ('b', 0)], [('a', 1)]]
    """
    groups: list[list[A]] = [[] for _ in range(min(hosts, len(members)))]
    for i, member in enumerate(members):
        groups[i % len(groups)].append(member)
    return groups


M_ARENA_MAX = -8  # glibc's mallopt parameter: how many malloc arenas the process may have
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: blocks from this size are mapped apart
LOADER_ARENAS = 2
LOADER_MMAP_BYTES = 128 << 10  # glibc's default, held there (glibc raises it as blocks are freed)


def lean_allocators(arenas: int = LOADER_ARENAS) -> None:
    """In a process hosting loaders: few glibc arenas, Arrow on the system allocator.

    A loader runs two threads per source and tokenizes each piece on a thread of its
    own. glibc gives threads arenas of their own (up to 8 per core) and Arrow's default
    pool (mimalloc) heaps of their own, each keeping what was freed in it: a process
    serving 32 sources at small windows grew by 519 MiB with both, 445 MiB with the
    arenas capped and 92 MiB with Arrow on the system allocator as well (2 cores;
    ``benchmarks/memory.py``, README *Loader memory*). Blocks of 128 KiB and more (a
    window's pieces) are mapped apart and handed back when freed: glibc would otherwise
    raise that threshold to the size of each mapped block freed, up to 32 MiB, and keep
    freed pieces in its heap. Called by a host for a process it starts for loaders
    (``RoleOptions(lean=True)``, through :func:`leaned`) and by node mode's rank 0
    (``overlord.dist.node``: the node's only loader process); never in a plain embedded
    Loader (the user's process, whose allocators are the user's business). The arena
    cap only with glibc.
    """
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, arenas)
        libc.mallopt(M_MMAP_THRESHOLD, LOADER_MMAP_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): no per-thread arenas to cap


def leaned(cls: type[T]) -> type[T]:
    """``cls``, whose construction first makes its process's allocators lean.

    For a runtime that starts a process of its own for the role: the tuning
    must come before the role starts threads and allocates. The class keeps
    ``cls``'s name (process titles show it), under a module of its own, so
    that it is sent by value and never mistaken for ``cls`` itself. Made once
    per class.
    """
    made = _LEANED.get(cls)
    if made is None:

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            lean_allocators()
            cls.__init__(self, *args, **kwargs)

        made = type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})
        made.__qualname__ = cls.__qualname__
        made.__module__ = f"{__name__}.leaned"
        _LEANED[cls] = made
    return made


_LEANED: dict[type[Any], type[Any]] = {}


def close_role(obj: Any) -> None:
    """Close a role object, if it has anything to close."""
    close = getattr(obj, "close", None)
    if close is not None:
        close()
