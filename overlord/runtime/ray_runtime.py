"""The Ray runtime: every role is a named Ray actor; payloads travel through Ray's object store.

Actors are named ``<job>.<role>`` in the ``overlord`` namespace, so that trainer
processes started elsewhere (``torchrun``) find them with :func:`overlord.connect`.
overlord adds no RPC layer of its own: a call is ``actor.method.remote()``, a
wait is ``ray.get``.

Security: anyone who can reach a Ray cluster can run code on it. The local
instance overlord starts has its dashboard off and listens on 127.0.0.1 only
(:mod:`overlord.runtime.ray_connect` says how); other users of the machine can
still reach loopback, so keep Ray's token authentication on (its default), or
run the job in a network namespace of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from overlord.errors import ActorDiedError, LoaderError, OverlordError
from overlord.runtime.base import (
    DEFAULT_OPTIONS,
    Done,
    Gone,
    Handle,
    Ref,
    RoleOptions,
    count_call,
    found_or_spawned,
)
from overlord.runtime.hosting import SEP, HostedHandle, Hosts, drop, hosted, leaned
from overlord.runtime.ray_connect import NAMESPACE, _ray, init_ray, stop_watching

__all__ = ["NAMESPACE", "RayHandle", "RayObjects", "RayRef", "RayRuntime", "init_ray", "lookup"]


class RayRef:
    """The pending result of a call to an actor; resolves itself with ``ray.get``."""

    def __init__(self, ref: Any, what: str):
        self.ref, self.what = ref, what

    def result(self, timeout: float | None = None) -> Any:
        """The value, or the role's own error raised here, naming the role and the method."""
        ray = _ray()
        try:
            return ray.get(self.ref, timeout=timeout)
        except ray.exceptions.RayError as e:
            raise _unwrap(e, self.what) from None

    def done(self) -> bool:
        """Whether the call has finished."""
        ready, _ = _ray().wait([self.ref], timeout=0)
        return bool(ready)


class RayHandle:
    """A role running as a Ray actor."""

    def __init__(self, actor: Any, name: str):
        self.actor = actor
        self.name = name

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Ref[Any]:
        """Start ``method(*args)`` on the actor.

        Arguments that do not fit the method fail here, before anything is
        sent; the error is the Ref's, as the role's own would be.
        """
        what = f"{self.name}.{method.__name__}"
        count_call(_counted_as(method.__name__, args))
        try:
            return RayRef(getattr(self.actor, method.__name__).remote(*args, **kwargs), what)
        except TypeError as e:
            return Done(error=LoaderError(f"{what} failed: TypeError: {e}"))


def _counted_as(method: str, args: tuple[Any, ...]) -> str:
    """A call's name in the counts: a call to a host (hosting.HostRole) names its member's method.

    ``HostRole.call(member, method, ...)`` counts as ``call:method``,
    ``HostRole.call_each(method, ...)`` as ``call_each:method``.
    """
    if method == "call" and len(args) > 1:
        return f"call:{args[1]}"
    if method == "call_each" and len(args) > 1:
        return f"call_each:{args[0]}"
    return method


class RayObjects:
    """Ray's object store (:class:`overlord.runtime.objects.ObjectStore`): one object per put.

    Stateless, so it is sent to the actors that use it with their arguments.
    """

    def put(self, value: Any) -> Any:
        """``value`` put once in this node's object store; its ObjectRef (numpy: zero-copy)."""
        return _ray().put(value)

    def get(self, ref: Any, what: str) -> Any:
        """The value of ObjectRef ``ref``; None if it was lost (its owner died).

        On the node that holds it, numpy arrays in it are mapped from the store
        without a copy, read-only.
        """
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.ObjectLostError:  # the owner died: ask its successor again
            return None
        except ray.exceptions.RayError as e:
            raise _unwrap(e, what) from None


def _unwrap(err: BaseException, what: str) -> BaseException:
    """Turn Ray's wrappers back into the error the role raised, or say which actor died."""
    ray = _ray()
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, OverlordError):
            return cause
        return LoaderError(f"{what} failed: {cause!r}" if cause else f"{what} failed: {err}")
    if isinstance(err, ray.exceptions.RayActorError):
        return ActorDiedError(f"{what}: the actor died ({type(err).__name__}); see the Ray logs")
    if isinstance(err, ray.exceptions.GetTimeoutError):
        return LoaderError(f"{what}: no answer within the timeout")
    return err


class RayRuntime:
    """Spawns roles as named actors of job ``job``.

    ``address`` is a Ray cluster address (``auto``, ``ray://host:10001``); None
    starts a local instance (bound to 127.0.0.1, dashboard off) unless Ray is
    already initialized in this process. Joining a cluster gives up after
    ``connect_timeout`` seconds (None: ``OVERLORD_CONNECT_TIMEOUT``, else 60).
    With ``connect=False`` (inside an actor) it only uses the Ray this process
    already runs in.
    """

    name = "ray"
    objects = RayObjects()

    def __init__(
        self,
        job: str,
        address: str | None = None,
        connect: bool = True,
        connect_timeout: float | None = None,
    ):
        self.job = job
        self._handles: list[RayHandle] = []
        self._hosts = Hosts(self.spawn)
        self._started_ray = False
        # inside an actor (the planner spawning a loader) an actor must not be owned by the
        # caller, or it dies with it: it is detached, and removed by the job's name prefix
        self._detached = not connect
        if connect:
            self._started_ray = init_ray(address, connect_timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        # sent into an actor (the planner), the runtime spawns there without owning Ray
        return (RayRuntime, (self.job, None, False))

    def actor_name(self, role: str) -> str:
        """The name of a role's actor in Ray."""
        return f"{self.job}.{role}"

    def spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """Create ``cls(*args)`` as a named actor; fails if the name is taken.

        With ``options.host`` the role is built in that host's actor instead
        (started with these options if it is new); with ``options.lean`` the
        actor's process tunes its allocators before it builds the role.
        """
        if options.host is not None:
            return self._hosts.spawn(cls, args, name, options)
        if options.lean:
            cls = leaned(cls)
        ray = _ray()
        kwargs: dict[str, Any] = {
            "name": self.actor_name(name),
            "namespace": NAMESPACE,
            "num_cpus": options.num_cpus,
            "max_concurrency": options.max_concurrency,
        }
        if options.scheduling_strategy:
            kwargs["scheduling_strategy"] = options.scheduling_strategy
        if options.restartable:
            kwargs["max_restarts"] = -1
            kwargs["max_task_retries"] = -1
        if self._detached:
            kwargs["lifetime"] = "detached"
        if options.node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if options.node not in alive:
                raise LoaderError(
                    f"placement.loader_nodes puts '{name}' on node {options.node}, which is not "
                    f"an alive node of this Ray cluster (alive: {sorted(alive)})"
                )
            kwargs["scheduling_strategy"] = NodeAffinitySchedulingStrategy(options.node, soft=False)
        try:
            ray.get_actor(kwargs["name"], namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise LoaderError(
                f"a job named '{self.job}' is already running (actor '{kwargs['name']}' exists): "
                "stop it first, or choose another --name"
            )
        actor = ray.remote(cls).options(**kwargs).remote(*args)
        handle = RayHandle(actor, name)
        self._handles.append(handle)
        return handle

    def lookup(self, name: str) -> Handle[Any]:
        """The running actor of role ``name`` of this job, or a :class:`Gone` stand-in."""
        if SEP in name:
            return hosted(name, self.lookup)
        try:
            actor = _ray().get_actor(self.actor_name(name), namespace=NAMESPACE)
        except ValueError:
            return Gone(name)
        return RayHandle(actor, name)

    def lookup_or_spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """The running actor called ``name`` (it outlived a planner), else a new one."""
        return found_or_spawned(self, cls, *args, name=name, options=options)

    def kill(self, handle: Handle[Any]) -> None:
        """Stop one actor; a hosted role is closed, and its host stopped once it holds none."""
        if isinstance(handle, HostedHandle):
            if drop(handle):
                self._hosts.forget(handle.host.name)
                self.kill(handle.host)
            return
        if not isinstance(handle, RayHandle):
            return  # a Gone stand-in
        _ray().kill(handle.actor, no_restart=True)
        if handle in self._handles:
            self._handles.remove(handle)

    def job_actors(self) -> list[str]:
        """Names of every live actor of this job, also those other roles spawned."""
        prefix = f"{self.job}."
        listed = _ray().util.list_named_actors(all_namespaces=True)
        return sorted(
            a["name"]
            for a in listed
            if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix)
        )

    def shutdown(self) -> None:
        """Stop every actor of this job, and the local Ray instance if this runtime started one.

        Actors the planner spawned (loaders, shadows) are detached, so they are
        found by the job's name prefix rather than by handle.
        """
        ray = _ray()
        for h in reversed(list(self._handles)):
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h.actor, no_restart=True)
        self._handles.clear()
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                for name in self.job_actors():
                    with contextlib.suppress(Exception):
                        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        if self._started_ray:
            stop_watching()  # the head goes with this instance, on purpose
            ray.shutdown()
            self._started_ray = False


def lookup(job: str, role: str) -> RayHandle:
    """A named actor of a running job, with a clear error if there is none."""
    ray = _ray()
    name = f"{job}.{role}"
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise LoaderError(
            f"no overlord job '{job}' on this Ray cluster (actor '{name}' not found): start it "
            f"with 'overlord serve PLAN --name {job}', and connect to the same cluster "
            "(RAY_ADDRESS)"
        ) from None
    return RayHandle(actor, role)
