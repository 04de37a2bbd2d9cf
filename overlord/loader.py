"""The public entry point: a running data plan, on a runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from overlord.checkpoint import check_state
from overlord.plan.spec import Plan, load_plan
from overlord.roles.client import Client
from overlord.roles.constructor import DataConstructor
from overlord.roles.planner import Planner
from overlord.roles.source_loader import SourceLoader
from overlord.runtime import make_runtime
from overlord.runtime.base import Handle


class Loader:
    """Runs a data plan: source loaders, a planner and one constructor per DP rank.

    >>> with Loader("plan.yaml") as loader:          # doctest: +SKIP
    ...     batches = loader.client(rank=0)
    ...     batch = next(batches)
    ...     state = loader.state_dict()              # save it with your checkpoint

    ``state`` (from :meth:`state_dict`) resumes the stream exactly where every
    rank had consumed it, on any DP size. With ``build_batches=False`` the
    loaders keep no payloads and only :meth:`dry_run` is available: planning
    statistics without batches.
    """

    def __init__(
        self,
        plan: Plan | str | Path,
        runtime: str = "inline",
        state: dict[str, Any] | None = None,
        build_batches: bool = True,
    ):
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        if state is not None:
            check_state(state, self.plan)
        self.runtime = make_runtime(runtime)
        data = self.plan.model_dump(mode="json")
        base = str(self.plan.base_dir)
        saved = (state or {}).get("sources", {})
        self.loaders: dict[str, list[Handle]] = {}
        try:
            for spec in self.plan.sources:
                start = saved.get(spec.name, {}).get("cursor")
                self.loaders[spec.name] = [
                    self.runtime.spawn(
                        SourceLoader,
                        data,
                        base,
                        spec.name,
                        k,
                        spec.loaders,
                        start,
                        build_batches,
                        name=f"loader-{spec.name}-{k}",
                    )
                    for k in range(spec.loaders)
                ]
            self.planner = self.runtime.spawn(
                Planner, data, base, self.loaders, self.runtime, state, name="planner"
            )
            self.constructors = [
                self.runtime.spawn(
                    DataConstructor,
                    data,
                    base,
                    self.planner,
                    self.loaders,
                    self.runtime,
                    r,
                    name=f"constructor-{r}",
                )
                for r in range(self.plan.world.dp if build_batches else 0)
            ]
        except BaseException:
            self.runtime.shutdown()
            raise
        self.start_step = int((state or {}).get("step", 0))

    def client(self, rank: int, stop_step: int | None = None) -> Client:
        """Iterator of batches for DP rank ``rank``, from the resumed step on."""
        dp = self.plan.world.dp
        if not self.constructors:
            raise ValueError("this Loader was made with build_batches=False: it has no clients")
        if not 0 <= rank < dp:
            raise ValueError(f"rank {rank} is outside the plan's world: dp={dp}, ranks 0..{dp - 1}")
        return Client(
            rank, self.constructors[rank], self.planner, self.runtime, self.start_step, stop_step
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
        out["loaders"] = [
            self.runtime.get(h.call("stats")) for hs in self.loaders.values() for h in hs
        ]
        return out

    def close(self) -> None:
        """Stop every role and free what they hold."""
        self.runtime.shutdown()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
