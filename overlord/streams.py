"""A trainer process's batches: one decision of where they come from, one kind of stream.

A trainer holds a :class:`RankStream`: the batches of its rank, step after
step, with the state of what it received. Where they come from is decided
here, once, for ``overlord.Loader``, ``OverlordIterableDataset.from_plan`` /
``from_job`` and ``overlord.connect`` alike:

- **embedded**: this process runs the plan's roles itself (an
  ``overlord.Loader`` of its own) and takes its rank's batches from them
  (a :class:`~overlord.roles.client.Client`, or :class:`EmbeddedStream` when
  the stream owns its Loader);
- **node**: ``torchrun`` started several processes on one node and the plan's
  world has as many. The node's rank 0 runs the only Loader and sends every
  rank its batches (:class:`~overlord.dist.node.NodeClient`), so each source is
  read once per node, without Ray;
- **job**: the roles run as a job on Ray (``overlord serve``, or a trainer's
  ``Loader(plan, runtime="ray")``) and this process connects to it by name
  (a Client whose DataConstructor is the job's, or its own where the plan puts
  constructors in the trainer).

The environment is read only through :meth:`overlord.world.World.launch` and
:meth:`~overlord.world.World.detect`. A job is chosen by naming it; between the
other two, :func:`stream_kind` decides.

This module runs a plan through the class it is handed (``loader=``, which is
``overlord.Loader``): ``overlord.Loader`` itself asks this module which stream
it gives, so the two cannot import each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from overlord.batch import Batch
from overlord.errors import LoaderError
from overlord.plan.settings import ConstructorSite
from overlord.plan.spec import Plan, validate_plan
from overlord.plans import load_plan
from overlord.roles.api import ConstructorRole, LoaderRole, OpsRole, PlannerRole, PoolRole
from overlord.roles.client import Client
from overlord.roles.constructor import DataConstructor
from overlord.runtime import RUNTIMES
from overlord.runtime.base import Handle
from overlord.runtime.inline import InlineHandle
from overlord.sources.catalog import SourceFiles
from overlord.state.checkpoint import check_state
from overlord.world import World


@runtime_checkable
class RankStream(Protocol):
    """The batches of one trainer process's rank, with the state of what it received.

    ``step`` is the step of the next batch. :meth:`state_dict` is the stream's
    state as of that position (what a resumed stream starts from, the same on
    every rank of a synchronous step). :meth:`load_state_dict` resumes from such
    a state where the stream can still move there (one this process runs and
    has not started, or a Loader of its own), and otherwise checks that it is
    there. :meth:`close` ends what this process holds of it (never a job served
    elsewhere).
    """

    @property
    def step(self) -> int:
        """The step of the next batch."""
        ...

    def __iter__(self) -> Iterator[Batch]:
        """The stream itself."""
        ...

    def __next__(self) -> Batch:
        """The next step's batch; ``StopIteration`` at the stop step."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The stream's state as of this rank's position."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state`` (or check that the stream is there)."""
        ...

    def report(
        self, step: int, seconds: float, loss_by_source: dict[str, float] | None = None
    ) -> None:
        """Tell the planner this rank trained ``step`` in ``seconds`` (one way; never blocks)."""
        ...

    def close(self) -> None:
        """End what this process holds of the stream."""
        ...


class PlanHost(Protocol):
    """What runs a plan's roles in this process, as a stream uses it: ``overlord.Loader``."""

    def client(self, rank: int, stop_step: int | None = None) -> RankStream:
        """DP rank ``rank``'s batches."""
        ...

    def rank_client(self, global_rank: int, stop_step: int | None = None) -> RankStream:
        """Mesh rank ``global_rank``'s batches."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The state as of the last step every rank consumed."""
        ...

    def close(self) -> None:
        """Stop every role."""
        ...

    def __enter__(self) -> PlanHost: ...

    def __exit__(self, *exc: object) -> None: ...


class Hosting(Protocol):
    """How a plan is run in this process: ``overlord.Loader`` (called with ``node=False``)."""

    def __call__(
        self, plan: Plan, *, state: dict[str, Any] | None, node: bool, runtime: str = "inline"
    ) -> PlanHost:
        """A running ``plan`` of this process's alone, from ``state``, on ``runtime``."""
        ...


class StreamKind(str, Enum):
    """Where a trainer process's batches come from (see the module docstring)."""

    EMBEDDED = "embedded"
    NODE = "node"
    JOB = "job"


def stream_kind(
    plan: Plan,
    runtime: str = "inline",
    node: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> StreamKind:
    """Whether this process's stream of ``plan`` is its own (embedded) or its node's.

    Node mode is the embedded runtime shared by the processes of one node: it
    is chosen with ``node=True``, or by default (``node=None``) where
    ``torchrun`` started several processes (``WORLD_SIZE`` > 1) and the plan's
    world has more than one. ``node=False``, and any
    runtime but ``inline`` and ``process`` (``ray``, whose roles are actors
    that every process could reach), keep the stream this process's own. In node mode the launcher's
    world must be the plan's.

    >>> from overlord.plan.spec import validate_plan
    >>> plan = validate_plan({"sources": [{"name": "a", "path": "a/*", "format": "jsonl"}],
    ...                       "batch": {"tokens_per_step": 64, "max_seq_len": 16},
    ...                       "world": {"dp": 2}})
    >>> stream_kind(plan, env={}).value, stream_kind(plan, env={"WORLD_SIZE": "2"}).value
    ('embedded', 'node')
    >>> stream_kind(plan, "ray", env={"WORLD_SIZE": "2"}).value
    'embedded'
    """
    if runtime not in ("inline", "process") or node is False:
        return StreamKind.EMBEDDED
    launch = World.launch(env)
    torchrun = launch.launcher == "torchrun" and launch.size > 1  # SLURM alone may span nodes
    if node is None and not (torchrun and plan.world.size > 1):
        return StreamKind.EMBEDDED
    world = World.detect(plan=plan, env=env)  # RANK inside a world of WORLD_SIZE processes
    if world.dp != plan.world.dp:
        raise LoaderError(
            f"{world.size} processes run under torchrun but the plan's world has "
            f"{plan.world.size} (dp={plan.world.dp}, cp={world.cp}, tp={world.tp}, "
            f"pp={world.pp}): set world.dp to {world.dp} (plan.with_dp({world.dp}))"
        )
    return StreamKind.NODE


RUNTIME_ENV = "OVERLORD_RUNTIME"  # the default runtime, where a caller names none
DEFAULT_RUNTIMES = (*RUNTIMES, "process")  # Loader's runtimes: the seam's, and the data process


def resolved_runtime(
    runtime: str | None, env: Mapping[str, str] | None = None, build_batches: bool = True
) -> str:
    """``runtime`` as given; where None, ``OVERLORD_RUNTIME``; where that is unset, ``process``.

    A trainer takes its batches from a data process (:mod:`overlord.dist.data_process`),
    so that no loader thread shares its process and its GIL; under torchrun one data
    process serves the node's trainers, so that no rank hosts loading work beside its
    trainer. ``runtime="inline"`` keeps every role in this process (tests, debugging,
    a debugger's breakpoint in a role): under torchrun rank 0 then hosts the node's
    Loader (:mod:`overlord.dist.node`). A Loader without batches (``build_batches=False``:
    planning only) has nothing to serve: ``inline``. ``OVERLORD_RUNTIME`` (``inline``,
    ``process`` or ``ray``) changes the default for every Loader of the process.

    >>> resolved_runtime(None, env={}), resolved_runtime("inline", env={})
    ('process', 'inline')
    >>> resolved_runtime(None, env={"OVERLORD_RUNTIME": "inline"})
    'inline'
    >>> resolved_runtime(None, env={}, build_batches=False)
    'inline'
    """
    if runtime is not None:
        return runtime
    named = (os.environ if env is None else env).get(RUNTIME_ENV, "").strip()
    if named:
        if named not in DEFAULT_RUNTIMES:
            raise ValueError(
                f"{RUNTIME_ENV}={named!r} is not a runtime: expected one of "
                f"{', '.join(DEFAULT_RUNTIMES)}"
            )
        return named
    return "process" if build_batches else "inline"


def open_stream(
    plan: Plan | str | Path | None = None,
    rank: int | None = None,
    *,
    global_rank: int | None = None,
    state: Mapping[str, Any] | None = None,
    stop_step: int | None = None,
    loader: Hosting | None = None,
    node: bool | None = None,
    job: str | None = None,
    address: str | None = None,
    runtime: str | None = None,
) -> RankStream:
    """The stream of this process: of ``plan`` (run by ``loader``), or of the running ``job``.

    ``rank`` is a DP rank (one trainer process only where ``cp = tp = pp =
    1``); in a mesh pass ``global_rank``. ``stop_step`` ends the stream.

    A plan gives an :class:`EmbeddedStream` (a Loader of this process's own,
    started on first use; ``rank`` defaults to 0) or, in node mode (see
    :func:`stream_kind`), the stream of this process's rank (``rank`` and
    ``global_rank``, where given, must be this process's): by default from the
    node's data process, which rank 0 starts (:mod:`overlord.dist.data_process`);
    with ``runtime="inline"`` a :class:`~overlord.dist.node.NodeClient`, rank 0
    hosting the node's Loader. ``state`` is where it starts. ``runtime``
    None is :func:`resolved_runtime`'s default; ``runtime="process"`` out of
    node mode runs this process's roles in a data process of its own.

    A job (found on the Ray cluster at ``address``, ``RAY_ADDRESS`` when None,
    or a local instance) gives a :class:`~overlord.roles.client.Client`;
    ``state`` (a trainer's checkpoint: any state the job handed out) then
    rewinds the live job to it once every DP rank reconnected with the same
    state, and the steps from it are served again, exactly as before (see
    :mod:`overlord.roles.rewind`); the client's first ``next()`` waits for that.
    """
    start = None if state is None else dict(state)
    if job is not None:
        if plan is not None:
            raise ValueError("open_stream takes a plan or a job=, not both")
        return _connect(job, rank, address, stop_step, global_rank, start)
    if plan is None:
        raise ValueError("open_stream takes a plan or a job=, one of the two")
    if loader is None:
        raise TypeError("open_stream runs a plan with loader= (overlord.Loader)")
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if start is not None:
        check_state(start, plan)
    runtime = resolved_runtime(runtime)
    if stream_kind(plan, runtime, node=node) is StreamKind.NODE:
        _check_node_rank(plan, rank, global_rank)
        if runtime == "process":
            from overlord.dist.data_process import node_stream

            me = World.launch().rank
            return node_stream(plan, start, stop_step, me, plan.world.coords(me).dp)
        from overlord.dist.node import NodeClient  # torch: only under torchrun

        make = loader

        def serve(plan: Plan, state: dict[str, Any] | None) -> PlanHost:
            """Rank 0's Loader of the node: this process's alone."""
            return make(plan, state=state, node=False, runtime="inline")

        return NodeClient(plan, start, stop_step, serve=serve)
    return EmbeddedStream(
        plan, rank, start, stop_step, loader, global_rank=global_rank, runtime=runtime
    )


def _check_node_rank(plan: Plan, rank: int | None, global_rank: int | None) -> None:
    """In node mode each process iterates its own rank: refuse another one, saying which."""
    me = World.launch().rank  # this process's global rank (its DP rank without a mesh)
    world = plan.world
    if rank is not None and global_rank is None:
        if world.peers > 1:
            raise ValueError(
                f"Loader.client takes a DP rank, which is one trainer process only when "
                f"cp = tp = pp = 1; this plan's world has cp={world.cp}, tp={world.tp}, "
                f"pp={world.pp}: use Loader.rank_client(global_rank) (this process: "
                f"rank_client({me}))"
            )
        if rank != me:
            raise ValueError(
                f"under torchrun this process is DP rank {me}: it iterates its own "
                f"batches (client({me})), the node's Loader serves rank {rank}'s"
            )
    if global_rank is not None:
        world.coords(global_rank)  # ValueError outside the world
        if global_rank != me:
            raise ValueError(
                f"under torchrun this process is global rank {me}: it iterates its own "
                f"batches (rank_client({me})), the node's Loader serves rank "
                f"{global_rank}'s"
            )


class EmbeddedStream:
    """A rank's batches from a Loader of this process's own, started on first use.

    So a state loaded before then applies. :meth:`load_state_dict` stops the
    Loader, and the next batch starts a new one from that state; :meth:`close`
    remembers the position, so that the stream, used again, starts a new
    Loader from there. Without a mesh the Loader serves every DP rank in this
    process, which must then consume every rank's batch of a step before it
    runs ahead (one rank alone stops with an error after a few steps when
    dp > 1).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int | None,
        state: dict[str, Any] | None,
        stop_step: int | None,
        loader: Hosting,
        global_rank: int | None = None,
        runtime: str = "inline",
    ):
        dp = plan.world.dp
        if global_rank is not None:
            plan.world.coords(global_rank)  # ValueError outside the world
        elif rank is not None and not 0 <= rank < dp:
            raise ValueError(f"rank {rank} is outside the plan's world: dp={dp}, ranks 0..{dp - 1}")
        if state is not None:
            check_state(state, plan)
        self.plan, self.stop_step = plan, stop_step
        self.rank, self.global_rank = rank or 0, global_rank
        self._make, self.runtime = loader, runtime
        self._pending = state
        self._loader: PlanHost | None = None
        self._client: RankStream | None = None

    @property
    def step(self) -> int:
        """The step of the next batch."""
        if self._client is None:
            return int((self._pending or {}).get("step", 0))
        return self._client.step

    def _open(self) -> RankStream:
        if self._client is None:
            self._loader = loader = self._make(
                self.plan, state=self._pending, node=False, runtime=self.runtime
            )
            if self.global_rank is None:
                self._client = loader.client(self.rank, stop_step=self.stop_step)
            else:
                self._client = loader.rank_client(self.global_rank, stop_step=self.stop_step)
            self._pending = None
        return self._client

    def __iter__(self) -> Iterator[Batch]:
        """The stream itself."""
        return self

    def __next__(self) -> Batch:
        """The next step's batch (the Loader starts with the first)."""
        return next(self._open())

    def state_dict(self) -> dict[str, Any]:
        """The stream's state as of this rank's position."""
        if self._client is None and self._pending is not None:
            return self._pending  # not started yet: exactly what it will start from
        return self._open().state_dict()

    def report(
        self, step: int, seconds: float, loss_by_source: dict[str, float] | None = None
    ) -> None:
        """:meth:`overlord.roles.client.Client.report` of this rank (the Loader started)."""
        self._open().report(step, seconds, loss_by_source)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start again from ``state``: the Loader stops, the next batch starts a new one."""
        check_state(state, self.plan)
        self._stop()
        self._pending = state

    def close(self) -> None:
        """Stop the Loader, remembering the position (used again, it starts from there)."""
        try:
            if self._client is not None:
                self._pending = self._client.state_dict()
        finally:
            self._stop()

    def _stop(self) -> None:
        if self._loader is not None:
            self._loader.close()
        self._loader, self._client = None, None


def local_constructor(
    layout: dict[str, Any], planner: Handle[PlannerRole], pool: Handle[PoolRole], rank: int
) -> DataConstructor:
    """A DataConstructor for ``rank`` in this process, pulling from the job's loaders.

    ``layout`` is the planner's: the plan, the job's files (never listed again
    here) and the loaders. ``planner`` and ``pool``: the planner's handle, as
    the Protocol of its plans and as that of its loaders.
    """
    plan = validate_plan(layout["plan"], base_dir=layout["base_dir"])
    files = {
        n: SourceFiles.of_record(n, record, layout["base_dir"])
        for n, record in layout["files"].items()
    }
    loaders: dict[str, list[Handle[LoaderRole] | None]] = layout["loaders"]
    prefetch = plan.batch.prefetch_steps
    return DataConstructor(plan, files, planner, pool, loaders, [rank], prefetch, layout["pad_id"])


def _connect(
    job: str,
    rank: int | None,
    address: str | None,
    stop_step: int | None,
    global_rank: int | None,
    state: dict[str, Any] | None,
) -> Client:
    """The Client of DP rank ``rank``, or of mesh rank ``global_rank``, of the job ``job``."""
    from overlord.runtime.ray_runtime import RayObjects, init_ray, lookup

    if (rank is None) == (global_rank is None):
        raise ValueError("connect takes a DP rank or a global_rank=, one of the two")
    init_ray(address or os.environ.get("RAY_ADDRESS") or "auto")
    found = lookup(job, "planner")  # one actor, held under each Protocol used here
    planner: Handle[PlannerRole] = found
    pool: Handle[PoolRole] = found
    ops: Handle[OpsRole] = found
    layout = ops.call(OpsRole.layout).result()
    found_plan = validate_plan(layout["plan"])
    world, timeout_s = found_plan.world, found_plan.loading.timeout_s
    dp = layout["dp"]
    if global_rank is not None:
        if not 0 <= global_rank < world.size:
            raise LoaderError(
                f"global rank {global_rank} is outside job '{job}': its world has "
                f"{world.size} processes (dp={world.dp}, cp={world.cp}, tp={world.tp}, "
                f"pp={world.pp})"
            )
        dp_rank = world.coords(global_rank).dp
    else:
        assert rank is not None
        if world.peers > 1:
            raise LoaderError(
                f"job '{job}' runs a mesh (cp={world.cp}, tp={world.tp}, pp={world.pp}): a DP "
                "rank is several trainer processes; connect with global_rank= (the process's "
                "RANK)"
            )
        if not 0 <= rank < dp:
            raise LoaderError(f"rank {rank} is outside job '{job}': dp={dp}, ranks 0..{dp - 1}")
        dp_rank = rank
    owned, objects = None, None
    if layout["constructors"] == ConstructorSite.TRAINER.value:
        owned = local_constructor(layout, planner, pool, dp_rank)
        constructor: Handle[ConstructorRole] = InlineHandle(owned, f"constructor-local-{dp_rank}")
    else:
        constructor = lookup(job, f"constructor-{dp_rank // layout['ranks_per_constructor']}")
        objects = RayObjects()  # the actor puts a mesh rank's view in Ray's object store
    if state is not None:
        start = planner.call(PlannerRole.reconnect, dp_rank, state).result()
    if global_rank is None:
        if state is None:
            start = planner.call(PlannerRole.position, dp_rank).result()
    else:
        start = planner.call(PlannerRole.attach, global_rank).result()
    return Client(
        dp_rank,
        constructor,
        planner,
        start,
        stop_step,
        owned,
        global_rank=global_rank,
        objects=objects,
        heartbeat=True,  # its trainer may outlive a peer restarted alone: it says it is alive
        sources=tuple(s["name"] for s in layout["plan"]["sources"]),
        rewinding=None if state is None else timeout_s,  # its first batch once the job rewound
    )
