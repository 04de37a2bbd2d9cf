"""Runtimes that execute overlord's roles: ``inline`` (embedded) and ``ray``."""

from __future__ import annotations

from overlord.plan.spec import LoaderPlacement, Plan
from overlord.runtime.base import Handle, Runtime
from overlord.runtime.inline import InlineRuntime

RUNTIMES = ("inline", "ray")


def make_runtime(name: str, plan: Plan, job: str, address: str | None = None) -> Runtime:
    """The runtime called ``name``, set up for ``plan`` (actor placement) and ``job``."""
    if name == "inline":
        return InlineRuntime()
    if name == "ray":
        from overlord.loader import LOADER_CONCURRENCY
        from overlord.runtime.ray_runtime import RayRuntime, RoleOptions

        p = plan.placement
        spread = "SPREAD" if p.loader_strategy is LoaderPlacement.SPREAD else None
        nodes = tuple((f"loader-{src}-", node) for src, node in sorted(p.loader_nodes.items()))
        options = {
            "loader": RoleOptions(p.loader_cpus, LOADER_CONCURRENCY, spread, nodes),
            "planner": RoleOptions(p.planner_cpus, 1, restartable=True),
            "constructor": RoleOptions(p.constructor_cpus, 1, restartable=True),
        }
        return RayRuntime(job, address, options)
    raise ValueError(f"unknown runtime '{name}': expected one of {', '.join(RUNTIMES)}")


__all__ = ["RUNTIMES", "Handle", "InlineRuntime", "Runtime", "make_runtime"]
