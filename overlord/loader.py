"""The public entry point: a running data plan, on a runtime.

This is the wiring: it lists the job's files once, chooses the runtime and
how each role is placed on it, spawns the planner (whose pool spawns the
loaders) and the constructors, and hands out clients.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from overlord.dist.data_process import DataProcess, ProcessStream
from overlord.dist.data_server import steps_ahead
from overlord.errors import LoaderError, RanksApart
from overlord.plan.settings import ConstructorSite, LoaderPlacement
from overlord.plan.spec import Plan
from overlord.plans import load_plan
from overlord.roles.api import ConstructorRole, LoaderRole, OpsRole, PlannerRole, PoolRole
from overlord.roles.assigner import assigner_count
from overlord.roles.client import Client
from overlord.roles.constructor import DataConstructor
from overlord.roles.loader_pool import PoolConfig
from overlord.roles.planner import Planner
from overlord.roles.quarantine import check_job as check_quarantine
from overlord.roles.source_loader import SourceLoader
from overlord.runtime import RUNTIMES
from overlord.runtime.base import Handle, OneWay, RoleOptions, Runtime
from overlord.runtime.inline import InlineHandle, InlineRuntime
from overlord.sources.catalog import job_files
from overlord.sources.tokenizers import make_tokenizer
from overlord.state.checkpoint import check_state
from overlord.state.runs import new_run
from overlord.streams import (
    RankStream,
    StreamKind,
    local_constructor,
    open_stream,
    resolved_runtime,
    stream_kind,
)


def make_runtime(
    name: str, job: str, address: str | None = None, connect_timeout: float | None = None
) -> Runtime:
    """The runtime called ``name`` for job ``job``.

    ``ray``: on the cluster at ``address``, reached within ``connect_timeout`` seconds.
    """
    if name == "inline":
        return InlineRuntime()
    if name == "ray":
        from overlord.runtime.ray_runtime import RayRuntime

        return RayRuntime(job, address, connect_timeout=connect_timeout)
    raise ValueError(f"unknown runtime '{name}': expected one of {', '.join(RUNTIMES)}")


def loader_options(plan: Plan) -> dict[str, RoleOptions]:
    """How each source's SourceLoaders are placed (the ``placement`` section)."""
    p = plan.placement
    spread = "SPREAD" if p.loader_strategy is LoaderPlacement.SPREAD else None
    return {
        s.name: RoleOptions(
            p.loader_cpus,
            SourceLoader.CONCURRENCY,
            spread,
            p.loader_nodes.get(s.name),
            # a process of loaders tunes its allocators (overlord.runtime.hosting.lean_allocators)
            lean=True,
        )
        for s in plan.sources
    }


def constructor_ranks(dp: int, per_constructor: int) -> list[list[int]]:
    """DP ranks of each DataConstructor: consecutive groups of ``per_constructor``.

    >>> constructor_ranks(5, 2)
    [[0, 1], [2, 3], [4]]
    """
    return [list(range(r, min(r + per_constructor, dp))) for r in range(0, dp, per_constructor)]


class Loader:
    """Runs a data plan: source loaders, a planner and the data constructors.

    Example::

        with overlord.Loader("plan.yaml") as loader:
            batches = loader.client(rank=0)
            batch = next(batches)
            state = loader.state_dict()  # save it with the trainer's checkpoint

    ``state`` (from :meth:`state_dict`) resumes the stream exactly where every
    rank had consumed it, on any DP size. ``runtime`` is ``process`` (every role
    in a data process of the node, beside this one: batches arrive in shared
    memory, and the trainer's thread only takes them; see
    :mod:`overlord.dist.data_process`; the default, where ``OVERLORD_RUNTIME``
    names none and the Loader builds batches: :func:`overlord.streams.resolved_runtime`),
    ``inline`` (every role in this process: tests, a debugger; the default of a
    Loader that only plans) or ``ray``
    (every role a Ray actor of job ``job``, on the
    cluster at ``address`` or a local instance of its own; joining a cluster
    gives up after ``connect_timeout`` seconds, None: ``OVERLORD_CONNECT_TIMEOUT``,
    else 60). With ``build_batches=False``
    the loaders keep no payloads and only :meth:`dry_run` is available. With the
    data process, :meth:`stats`, :meth:`monitor`, :meth:`feedback`,
    :meth:`quarantine` and the steering are asked of the Loader there (answers as
    JSON carries them); :meth:`slots` and :meth:`dry_run` are refused. With
    ``build_ahead=False`` a batch is built on the thread that asks for it, and
    clients send their consumption notices from it too: no thread of the
    Loader's hands work to another, for a caller that runs ahead of its
    trainers itself (the data process's one serving thread does).

    Under ``torchrun`` on one node (``WORLD_SIZE`` > 1, a world of more than
    one process; runtime ``process`` or ``inline``) every process's ``Loader``
    is in node mode (:func:`overlord.streams.stream_kind` decides): it starts
    no role itself, and each process's :meth:`client` (a mesh:
    :meth:`rank_client`) gives its own batches (``node=False`` makes a Loader
    of this process alone; ``loader.node`` says which). By default the node's
    roles run in a data process that rank 0 starts, and every rank takes its
    batches from shared memory; with ``runtime="inline"`` rank 0 runs the one
    Loader that reads each source and sends every other rank its batches, a
    :class:`~overlord.dist.node.NodeClient`. :meth:`state_dict` is then this
    rank's stream's; :meth:`stats` is rank 0's with ``inline`` and refused
    with ``process``, and what steers the node's loaders (re-partitioning,
    threads, slots) is not offered.

    ``journal_dir`` keeps the planner's journal, whole, in a folder of this run's
    under it (:mod:`overlord.state.runs`), after :meth:`close` too, so that any
    step of the run can be replayed (``overlord replay``); without it a journal
    (on Ray, or ``recovery.journal_dir``) is the job's own and removed at close.
    """

    def __init__(
        self,
        plan: Plan | str | Path,
        runtime: str | None = None,
        state: dict[str, Any] | None = None,
        build_batches: bool = True,
        job: str | None = None,
        address: str | None = None,
        node: bool | None = None,
        connect_timeout: float | None = None,
        journal_dir: str | Path | None = None,
        build_ahead: bool = True,
    ):
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        if state is not None:
            check_state(state, self.plan)
        self.start_step = int((state or {}).get("step", 0))
        # one torchrun process of a node's: the node's roles run (for every rank) in the data
        # process rank 0 starts, or with runtime inline in rank 0's process, once this
        # process's stream starts; until then, only what the stream starts from
        runtime = resolved_runtime(runtime, build_batches=build_batches)  # None: process
        self.node = stream_kind(self.plan, runtime, node) is StreamKind.NODE
        self._state = state
        self._stream: RankStream | None = None  # node mode: this process's, on first use
        self._runtime = runtime
        # runtime "process": the roles run in a data process; this one holds streams only
        self._process: DataProcess | None = None
        self._streams: dict[int, ProcessStream] = {}
        if self.node:
            return
        if runtime == "process":
            journal = None if journal_dir is None else str(journal_dir)
            self._process = DataProcess(self.plan, state, node=False, journal_dir=journal)
            return
        base = str(self.plan.base_dir)
        # the job's data: listed once, here; every role reads this list
        self.files = job_files(
            ((s.name, _patterns(s.path)) for s in self.plan.sources),
            base,
            state,
            {s.name: s.storage_options for s in self.plan.sources},
            timeout_s=self.plan.loading.timeout_s,
        )
        check_quarantine(self.plan, self.files, state)  # before a planner is spawned
        self.job = job or f"overlord-{uuid.uuid4().hex[:8]}"
        self.runtime = make_runtime(runtime, self.job, address, connect_timeout)
        # roles in processes of their own (Ray's actors) can die alone: shadows and a planner
        # journal by default; their memory is their own; ranks wait for each other; groups
        # are balanced by assigners in parallel
        distributed = runtime != "inline"
        # the planner's journal, for a planner that Ray restarts; a fresh folder per run
        self.journal: str | None = None
        self._keep_journal = journal_dir is not None
        recovery = self.plan.recovery
        if journal_dir is not None:
            plan_doc = self.plan.model_dump(mode="json")
            self.journal = str(new_run(journal_dir, plan_doc, base, self.start_step))
        elif distributed or recovery.journal_dir is not None:
            root = recovery.journal_dir or tempfile.gettempdir()
            self.journal = str(
                Path(root) / "overlord-journal" / f"{self.job}-{uuid.uuid4().hex[:8]}"
            )
        default_shadows = 1 if distributed else 0
        config = PoolConfig(
            shadows={
                s.name: default_shadows if s.shadows is None else s.shadows
                for s in self.plan.sources
            },
            options=loader_options(self.plan),
            processes=self.plan.placement.loader_processes if distributed else None,
            keep_payloads=build_batches,
            measure_rss=distributed,
        )
        pad_id = make_tokenizer(self.plan.tokenizer, base).pad_id if build_batches else 0
        p = self.plan.placement
        self.constructors: list[Handle[ConstructorRole]] = []
        self._owned: list[DataConstructor] = []  # trainer-side constructors, closed here
        self._constructor_of: dict[int, Handle[ConstructorRole]] = {}
        try:
            planner = self.runtime.spawn(
                Planner,
                *(self.plan, self.files, self.runtime, config, state, self.journal),
                *(distributed, pad_id, assigner_count(self.plan, distributed)),
                self._keep_journal,
                name="planner",
                options=RoleOptions(p.planner_cpus, 1, restartable=True),
            )
            # one actor, held under each of its Protocols: plans, its loaders, operations
            self.planner: Handle[PlannerRole] = planner
            self._pool: Handle[PoolRole] = planner
            self._ops: Handle[OpsRole] = planner
            self._pool.call(PoolRole.start).result()
            layout = self._ops.call(OpsRole.layout).result()
            in_trainer = distributed and p.constructors is ConstructorSite.TRAINER
            # constructors plan and build ahead on threads of their own, on every runtime:
            # the trainer's thread only takes a ready batch
            prefetch = self.plan.batch.prefetch_steps if build_ahead else 0
            # embedded, every constructor is an object of this process: one for every rank
            # builds a step of them all in one pass, on one kept thread (not one per rank,
            # each waking the next for the GIL); on Ray, one actor per rank by default
            per = p.ranks_per_constructor or (1 if distributed else self.plan.world.dp)
            groups = constructor_ranks(self.plan.world.dp, per)
            for i, ranks in enumerate(groups if build_batches and not in_trainer else []):
                h: Handle[ConstructorRole] = self.runtime.spawn(
                    DataConstructor,
                    *(self.plan, self.files, self.planner, self._pool, layout["loaders"]),
                    *(ranks, prefetch),
                    *(pad_id, self.runtime.objects),
                    name=f"constructor-{i}",
                    options=RoleOptions(p.constructor_cpus, 1, restartable=True),
                )
                self.constructors.append(h)
                self._constructor_of.update({r: h for r in ranks})
            for r in range(self.plan.world.dp) if build_batches and in_trainer else []:
                obj = local_constructor(layout, self.planner, self._pool, r)  # each its own
                self._owned.append(obj)
                self._constructor_of[r] = InlineHandle(obj, f"constructor-local-{r}")
        except BaseException:
            self.close()
            raise
        # every client's consumption notices, in order; a trainer's next() only queues them (the
        # embedded planner runs them before its next call; a Ray one gets them from a thread)
        self._notices = OneWay("clients", background=build_ahead)

    def client(self, rank: int, stop_step: int | None = None) -> RankStream:
        """Iterator of batches for DP rank ``rank``, from the resumed step on.

        Only where every DP rank is one trainer process (``cp = tp = pp = 1``);
        in a mesh, use :meth:`rank_client`. In node mode ``rank`` must be this
        process's, and every call gives the same stream.
        """
        if self.node:
            return self._node_stream(stop_step, rank=rank)
        world = self.plan.world
        dp = world.dp
        if self._process is None and not self._constructor_of:
            raise ValueError("this Loader was made with build_batches=False: it has no clients")
        if world.peers > 1:
            raise ValueError(
                f"Loader.client takes a DP rank, which is one trainer process only when "
                f"cp = tp = pp = 1; this plan's world has cp={world.cp}, tp={world.tp}, "
                f"pp={world.pp}: use Loader.rank_client(global_rank)"
            )
        if not 0 <= rank < dp:
            raise ValueError(f"rank {rank} is outside the plan's world: dp={dp}, ranks 0..{dp - 1}")
        if self._process is not None:
            return self._process_stream(rank, rank, stop_step)
        constructor = self._constructor_of[rank]
        return Client(
            *(rank, constructor, self.planner, self.start_step, stop_step, None, self._notices),
            sources=tuple(self.plan.source_names),
        )

    def rank_client(self, global_rank: int, stop_step: int | None = None) -> RankStream:
        """Iterator of the batches of one trainer process of the mesh, by its global rank.

        Its DP rank's batch, cut for its CP rank, with the fields of its
        pipeline stage (see :class:`~overlord.Batch`); TP peers receive the same
        batch object. The DP rank's step counts as consumed once every rank
        client of it has received it. In node mode ``global_rank`` must be this
        process's ``RANK``.
        """
        if self.node:
            return self._node_stream(stop_step, global_rank=global_rank)
        if self._process is not None:
            dp_rank = self.plan.world.coords(global_rank).dp  # ValueError outside the world
            # a mesh's data process serves every global rank (a plan without one: DP ranks)
            return self._process_stream(global_rank, dp_rank, stop_step)
        if not self._constructor_of:
            raise ValueError("this Loader was made with build_batches=False: it has no clients")
        dp = self.plan.world.coords(global_rank).dp  # ValueError outside the world
        start = self.planner.call(PlannerRole.attach, global_rank).result()
        constructor = self._constructor_of[dp]
        notices = self._notices
        # a constructor of the runtime's puts views in its object store; one of ours has none
        objects = None if self._owned else self.runtime.objects
        return Client(
            dp,
            constructor,
            self.planner,
            start,
            stop_step,
            notices=notices,
            global_rank=global_rank,
            objects=objects,
            sources=tuple(self.plan.source_names),
        )

    def _node_stream(
        self, stop_step: int | None, rank: int | None = None, global_rank: int | None = None
    ) -> RankStream:
        """The stream of this process in node mode: one, started on first use (rank 0's roles)."""
        stream = open_stream(
            self.plan, rank, global_rank=global_rank, state=self._state, stop_step=stop_step,
            loader=type(self), node=True, runtime=self._runtime,
        )  # fmt: skip
        if self._stream is None:
            self._stream = stream
        return self._stream

    def _process_stream(self, rank: int, dp_rank: int, stop_step: int | None) -> RankStream:
        """Stream ``rank`` of this Loader's data process (one per rank; asked again, the same)."""
        stream = self._streams.get(rank)
        if stream is None or stream.closed:
            process = self._process
            assert process is not None
            stream = ProcessStream(
                lambda _: process.endpoint, rank, dp_rank, stop_step, process.endpoint.start,
                check=self._apart,
            )  # fmt: skip
            self._streams[rank] = stream
        stream.stop_step = stop_step
        return stream

    def _apart(self, stream: ProcessStream) -> None:
        """Refuse a step the data process cannot build until another rank of ours takes one."""
        ranks = self.plan.world.size if self.plan.world.peers > 1 else self.plan.world.dp
        start = self.start_step
        positions = [self._streams[r].step if r in self._streams else start for r in range(ranks)]
        lag = min(positions)
        ahead = steps_ahead(self.plan.batch.prefetch_steps)  # the data process's bound
        if stream.step - lag >= ahead:
            slow = positions.index(lag)
            raise RanksApart(
                f"rank {stream.rank} asked for step {stream.step} while rank {slow} has "
                f"consumed only up to step {lag}: with runtime 'process' ranks run at most "
                f"{ahead} steps apart (consume every rank's batch of a step before the next)"
            )

    def _roles_here(self) -> None:
        """Refuse what only the roles can do where they are not here (nor in our data process)."""
        if self.node and self._runtime == "process":
            raise LoaderError(
                "under torchrun the node's roles run in its data process: steering and "
                "figures are the inline runtime's (Loader(plan, runtime='inline'), where "
                "rank 0 hosts the node's Loader)"
            )
        if self.node:
            raise LoaderError("under torchrun the node's Loader is rank 0's: steer it there")
        if self._process is not None:
            raise LoaderError(
                "with runtime 'process' the roles run in the data process: their handles "
                "are the inline runtime's (Loader(plan, runtime='inline'))"
            )

    def _reports(self) -> dict[int, int]:
        """How many reports each of this Loader's streams sent its data process."""
        return {r: stream.reports for r, stream in self._streams.items()}

    def dry_run(self, steps: int) -> list[dict[str, Any]]:
        """Plan ``steps`` steps from the start state without building batches."""
        if self._process is not None:  # it builds the steps it would plan here
            raise LoaderError(
                "dry_run plans steps without building them: a Loader of a data process "
                "builds its steps from the start; use Loader(plan, build_batches=False)"
            )
        self._roles_here()
        return self._ops.call(OpsRole.dry_run, steps).result()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state as of the last step every rank has consumed.

        In node mode: this rank's stream's, as of its position.
        """
        if self.node:
            return self._node_stream(None).state_dict()
        if self._process is not None:
            ranks = self.plan.world.size if self.plan.world.peers > 1 else self.plan.world.dp
            streams = [self._streams.get(r) for r in range(ranks)]
            if any(s is None for s in streams):
                return self._process.endpoint.start  # a rank that never read: the start
            return min(streams, key=lambda s: s.step).state_dict()  # type: ignore[union-attr]
        self._notices.flush()
        return self.planner.call(PlannerRole.state_dict).result()

    def stats(self) -> dict[str, Any]:
        """Planner history, events, scaling and every current loader's counters.

        In node mode: the node's Loader's, on rank 0 only (``runtime="inline"``).
        With the data process: its Loader's, as JSON carries them (a tuple is a list).
        """
        if self.node and self._runtime == "inline":
            host = getattr(self._stream, "loader", None)  # the NodeClient's, on rank 0
            if host is None:
                raise LoaderError("the node's Loader runs on rank 0: read its stats there")
            stats: dict[str, Any] = host.stats()
            return stats
        if self._process is not None:
            answer: dict[str, Any] = self._process.ask("stats", reports=self._reports())
            return answer
        if self.node:
            self._roles_here()  # the roles are in the node's data process
        self._notices.flush()
        return self._ops.call(OpsRole.stats).result()

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus endpoint (``monitoring.port``), e.g. ``http://127.0.0.1:9108/metrics``.

        None when the plan serves none. On Ray the planner serves it; with the
        data process, that process.
        """
        if self._process is not None:
            url: str | None = self._process.ask("metrics_url")
            return url
        self._roles_here()
        return self._ops.call(OpsRole.metrics_url).result()

    def monitor(self) -> dict[str, Any]:
        """What the endpoint and ``overlord status`` show, as plain data."""
        if self._process is not None:
            answer: dict[str, Any] = self._process.ask("monitor", reports=self._reports())
            return answer
        self._roles_here()
        self._notices.flush()
        return self._ops.call(OpsRole.monitor).result()

    def feedback(self, step: int) -> dict[int, dict[str, Any]] | None:
        """Each rank's predicted cost and reported seconds for ``step`` (None: not kept).

        ``{rank: {"seconds": s or None, "predicted": cost, "predicted_seconds": ...}}``,
        from the trainers' ``report`` calls; the planner keeps its last 1,024 steps.
        """
        if self._process is not None:
            got = self._process.ask("feedback", step, reports=self._reports())  # JSON: str ranks
            return None if got is None else {int(r): v for r, v in got.items()}
        self._roles_here()
        return self._ops.call(OpsRole.feedback, step).result()

    def quarantine(
        self, ids: Sequence[str] = (), files: Sequence[str] = (), from_step: int | None = None
    ) -> dict[str, Any]:
        """Skip samples ``ids`` and every sample of the files ``files`` match, from ``from_step``.

        ``from_step`` None: the first step the planner has not planned yet (a step
        already planned is refused, naming the earliest one). See the operating guide.
        """
        if self._process is not None:
            answer: dict[str, Any] = self._process.ask(
                "quarantine", list(ids), list(files), from_step
            )
            return answer
        self._roles_here()
        return self._ops.call(OpsRole.add_quarantine, list(ids), list(files), from_step).result()

    def slots(self) -> dict[str, list[list[Handle[LoaderRole]]]]:
        """Every loader slot's replicas, primary first, per source (kill one to test faults)."""
        self._roles_here()
        return self._pool.call(PoolRole.slots).result()

    def repartition(self, source: str, count: int) -> list[int] | None:
        """Read ``source`` with ``count`` loaders from the next shard boundary on (online)."""
        if self._process is not None:
            shards: list[int] | None = self._process.ask("repartition", source, count)
            return shards
        self._roles_here()
        return self._pool.call(PoolRole.repartition, source, count).result()

    def set_threads(self, source: str, threads: int) -> None:
        """Reader threads of every current loader of ``source`` (online)."""
        if self._process is not None:
            self._process.ask("set_threads", source, threads)
            return
        self._roles_here()
        self._pool.call(PoolRole.set_threads, source, threads).result()

    def close(self) -> None:
        """Stop every role, free what they hold, and remove the planner's journal (not a kept one).

        In node mode: stop this rank's stream (call it on every rank, as training
        ends together).
        """
        if self.node:
            if self._stream is not None:
                self._stream.close()
            return
        if self._process is not None:
            try:
                for stream in self._streams.values():
                    stream.close()
            finally:
                self._process.close()
            return
        try:
            for obj in self._owned:  # trainer-side constructors are not the runtime's
                obj.close()
            if hasattr(self, "_notices"):
                self._notices.close(raise_errors=False)
            self.runtime.shutdown()
        finally:
            if self.journal is not None and not self._keep_journal:
                shutil.rmtree(self.journal, ignore_errors=True)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _patterns(path: str | list[str]) -> list[str]:
    return [path] if isinstance(path, str) else list(path)
