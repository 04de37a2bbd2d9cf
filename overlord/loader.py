"""The public entry point: a running data plan, on a runtime."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from overlord.checkpoint import check_state
from overlord.plan.spec import ConstructorSite, Plan, load_plan, validate_plan
from overlord.roles.client import Client
from overlord.roles.constructor import DataConstructor
from overlord.roles.loader_group import LoaderGroup, MemberHandle, assign_groups
from overlord.roles.planner import Planner
from overlord.roles.source_loader import SourceLoader
from overlord.runtime import make_runtime
from overlord.runtime.base import Handle
from overlord.runtime.inline import InlineHandle

# a SourceLoader answers the planner (which may wait for data) and constructors at once
LOADER_CONCURRENCY = 16


def constructor_ranks(dp: int, per_constructor: int) -> list[list[int]]:
    """DP ranks of each DataConstructor: consecutive groups of ``per_constructor``.

    >>> constructor_ranks(5, 2)
    [[0, 1], [2, 3], [4]]
    """
    return [list(range(r, min(r + per_constructor, dp))) for r in range(0, dp, per_constructor)]


def local_constructor(layout: dict[str, Any], planner: Handle, runtime: Any, rank: int) -> Handle:
    """A DataConstructor for ``rank`` in this process, pulling from the job's loaders."""
    plan = validate_plan(layout["plan"])
    obj = DataConstructor(
        layout["plan"],
        layout["base_dir"],
        planner,
        layout["loaders"],
        runtime,
        [rank],
        plan.batch.prefetch_steps,
    )
    return InlineHandle(obj, f"constructor-local-{rank}")


class Loader:
    """Runs a data plan: source loaders, a planner and the data constructors.

    Example::

        with overlord.Loader("plan.yaml") as loader:
            batches = loader.client(rank=0)
            batch = next(batches)
            state = loader.state_dict()  # save it with the trainer's checkpoint

    ``state`` (from :meth:`state_dict`) resumes the stream exactly where every
    rank had consumed it, on any DP size. ``runtime`` is ``inline`` (every role
    in this process) or ``ray`` (every role a Ray actor of job ``job``, on the
    cluster at ``address`` or a local instance). With ``build_batches=False``
    the loaders keep no payloads and only :meth:`dry_run` is available.
    """

    def __init__(
        self,
        plan: Plan | str | Path,
        runtime: str = "inline",
        state: dict[str, Any] | None = None,
        build_batches: bool = True,
        job: str | None = None,
        address: str | None = None,
    ):
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        if state is not None:
            check_state(state, self.plan)
        self.job = job or f"overlord-{uuid.uuid4().hex[:8]}"
        self.runtime = make_runtime(runtime, self.plan, self.job, address)
        distributed = runtime != "inline"
        data = self.plan.model_dump(mode="json")
        base = str(self.plan.base_dir)
        saved = (state or {}).get("sources", {})
        spawn = self.runtime.spawn
        self.loaders: dict[str, list[Handle]] = {}
        self.shadows: dict[str, list[list[Handle]]] = {}
        # the planner's journal, for a planner that Ray restarts; a fresh folder per run
        self.journal: str | None = None
        recovery = self.plan.recovery
        if distributed or recovery.journal_dir is not None:
            root = recovery.journal_dir or tempfile.gettempdir()
            self.journal = str(
                Path(root) / "overlord-journal" / f"{self.job}-{uuid.uuid4().hex[:8]}"
            )
        self.constructors: list[Handle] = []
        self._constructor_of: dict[int, Handle] = {}
        try:
            processes = self.plan.placement.loader_processes
            if distributed and processes is not None:
                self._spawn_grouped(data, base, saved, build_batches, processes)
            else:
                for spec in self.plan.sources:
                    start = saved.get(spec.name, {}).get("cursor")
                    n, copies = spec.loaders, self._shadow_count(spec.shadows, distributed)
                    args = (data, base, spec.name)
                    self.loaders[spec.name] = [
                        spawn(
                            SourceLoader,
                            *(*args, k, n, start, build_batches),
                            name=f"loader-{spec.name}-{k}",
                        )
                        for k in range(n)
                    ]
                    self.shadows[spec.name] = [
                        [
                            spawn(
                                SourceLoader,
                                *(*args, k, n, start, build_batches, True),
                                name=f"loader-{spec.name}-{k}-shadow{j}",
                            )
                            for j in range(copies)
                        ]
                        for k in range(n)
                    ]
            self.planner = spawn(
                Planner,
                *(data, base, self.loaders, self.runtime, state, distributed),
                *(self.shadows, self.journal, build_batches),
                name="planner",
            )
            groups = constructor_ranks(
                self.plan.world.dp, self.plan.placement.ranks_per_constructor
            )
            prefetch = self.plan.batch.prefetch_steps if distributed else 0
            in_trainer = distributed and self.plan.placement.constructors is ConstructorSite.TRAINER
            for i, ranks in enumerate(groups if build_batches and not in_trainer else []):
                h = spawn(
                    DataConstructor,
                    *(data, base, self.planner, self.loaders, self.runtime, ranks, prefetch),
                    name=f"constructor-{i}",
                )
                self.constructors.append(h)
                self._constructor_of.update({r: h for r in ranks})
            if build_batches and in_trainer:  # each client builds its own batches, here
                layout = self.runtime.get(self.planner.call("layout"))
                for r in range(self.plan.world.dp):
                    h = local_constructor(layout, self.planner, self.runtime, r)
                    self.constructors.append(h)
                    self._constructor_of[r] = h
        except BaseException:
            self.close()
            raise
        self.start_step = int((state or {}).get("step", 0))

    def _spawn_grouped(
        self,
        data: dict[str, Any],
        base: str,
        saved: dict[str, Any],
        build_batches: bool,
        processes: int,
    ) -> None:
        """SourceLoaders spread over ``processes`` LoaderGroup actors (shadows over as many more).

        Shadow ``j`` of every member of group ``g`` lives in group ``shadow{j}-g``,
        so that a group's process dying never takes a slot's shadow with it.
        """
        specs = {s.name: s for s in self.plan.sources}
        wanted = [(s.name, k) for s in self.plan.sources for k in range(s.loaders)]
        copies = max(self._shadow_count(s.shadows, True) for s in self.plan.sources)
        handles: dict[tuple[str, int, int], Handle] = {}
        for g, group in enumerate(assign_groups(wanted, processes)):
            members = [
                (f"{src}-{k}", src, k, specs[src].loaders, saved.get(src, {}).get("cursor"))
                for src, k in group
            ]
            for j in range(1 + copies):
                mine = [
                    m
                    for m, (src, _) in zip(members, group)
                    if j <= self._shadow_count(specs[src].shadows, True)
                ]
                if not mine:
                    continue
                name = f"loader-group{g}" if j == 0 else f"loader-shadow{j}-group{g}"
                handle = self.runtime.spawn(
                    LoaderGroup, data, base, mine, build_batches, j > 0, name=name
                )
                for member, src, k, *_ in mine:
                    handles[(src, k, j)] = MemberHandle(handle, member)
        for src, spec in specs.items():
            n = self._shadow_count(spec.shadows, True)
            self.loaders[src] = [handles[(src, k, 0)] for k in range(spec.loaders)]
            self.shadows[src] = [
                [handles[(src, k, j)] for j in range(1, n + 1)] for k in range(spec.loaders)
            ]

    @staticmethod
    def _shadow_count(shadows: int | None, distributed: bool) -> int:
        """Shadows per loader: the plan's, else 1 on a distributed runtime and 0 inline."""
        if shadows is not None:
            return shadows
        return 1 if distributed else 0

    def client(self, rank: int, stop_step: int | None = None) -> Client:
        """Iterator of batches for DP rank ``rank``, from the resumed step on."""
        dp = self.plan.world.dp
        if not self.constructors:
            raise ValueError("this Loader was made with build_batches=False: it has no clients")
        if not 0 <= rank < dp:
            raise ValueError(f"rank {rank} is outside the plan's world: dp={dp}, ranks 0..{dp - 1}")
        return Client(
            rank, self._constructor_of[rank], self.planner, self.runtime, self.start_step, stop_step
        )

    def dry_run(self, steps: int) -> list[dict[str, Any]]:
        """Plan ``steps`` steps from the start state without building batches."""
        history: list[dict[str, Any]] = self.runtime.get(self.planner.call("dry_run", steps))
        return history

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state as of the last step every rank has consumed."""
        state: dict[str, Any] = self.runtime.get(self.planner.call("state_dict"))
        return state

    def stats(self) -> dict[str, Any]:
        """Planner history and every loader's counters."""
        out: dict[str, Any] = self.runtime.get(self.planner.call("stats"))
        loaders = self.runtime.get(self.planner.call("layout"))["loaders"]  # after failovers
        out["loaders"] = [
            self.runtime.get(h.call("stats")) for hs in loaders.values() for h in hs if h
        ]
        return out

    def close(self) -> None:
        """Stop every role, free what they hold, and remove the planner's journal."""
        try:
            for h in self.constructors:  # trainer-side constructors are not the runtime's
                close = getattr(getattr(h, "obj", None), "close", None)
                if close is not None:
                    close()
            self.runtime.shutdown()
        finally:
            if self.journal is not None:
                shutil.rmtree(self.journal, ignore_errors=True)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
