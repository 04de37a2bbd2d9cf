"""The autoscaler's actuator: it measures a pool's loaders, asks the policy, and re-sizes.

The policy (:mod:`overlord.plan.autoscale`) is pure: from each source's
profile (its measured cost per token, memory, loaders and threads) and the
mixture's weights in the steps ahead, it decides how many loaders and threads
each source needs. :class:`Scaling` supplies the profiles, measured from the
current loaders' stats, keeps each decision with its reasons for the run
summary, and carries out what a decision moved through the pool: a
re-partition for a new number of loaders, ``set_threads`` for a new number of
threads. Its state (the policy's hysteresis timers, each source's measured
cost) goes into the pool's journal record, so a restarted planner keeps it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from overlord.plan.autoscale import Autoscaler, Budget, Decision, SourceProfile
from overlord.plan.budget import token_budget
from overlord.plan.partition import Position
from overlord.plan.spec import Plan
from overlord.roles.api import LoaderRole
from overlord.runtime.base import Handle
from overlord.sources.catalog import SourceFiles

log = logging.getLogger("overlord.pool")


class Sized(Protocol):
    """What scaling needs of the loader pool (:class:`~overlord.roles.loader_pool.LoaderPool`)."""

    names: list[str]
    slots: dict[str, list[list[Handle[LoaderRole]]]]

    def current(self, source: str) -> list[int]:
        """The slots of the source's current partition."""
        ...

    def repartition(self, source: str, count: int) -> Position | None:
        """Read ``source`` with ``count`` loaders from a shard boundary on."""
        ...

    def set_threads(self, source: str, threads: int) -> None:
        """Reader threads of every current loader of ``source``."""
        ...


class Scaling:
    """The autoscaler of one job's loaders: measure, decide, re-size.

    ``measure_rss``: loaders run in processes of their own, whose memory is
    theirs to report (embedded, a loader's memory is what its budget lets it
    hold).
    """

    def __init__(
        self, plan: Plan, files: dict[str, SourceFiles], policy: Autoscaler, measure_rss: bool
    ):
        self.plan = plan
        self.files = files
        self.policy = policy
        self.measure_rss = measure_rss
        self.decisions: list[dict[str, Any]] = []  # the autoscaler's decisions, with reasons
        # CPU seconds per token each source's loaders measured last: a source's cost, which
        # loaders a re-partition just started have not measured yet
        self.cost: dict[str, float] = {}

    @classmethod
    def of(cls, plan: Plan, files: dict[str, SourceFiles], measure_rss: bool) -> Scaling | None:
        """The plan's autoscaler (``autoscale.cpus`` set), or None: the sizes stay as planned."""
        a = plan.autoscale
        if a.cpus is None:
            return None
        memory = math.inf if a.memory_gb is None else a.memory_gb * 2**30
        budget = Budget(a.cpus, memory, a.max_threads_per_loader, a.min_loaders)
        policy = Autoscaler(
            budget,
            headroom=a.headroom,
            cooldown_steps=a.cooldown_steps,
            horizon_steps=a.horizon_steps,
        )
        return cls(plan, files, policy, measure_rss)

    def measure(self, pool: Sized) -> tuple[list[SourceProfile], dict[str, tuple[int, int]]]:
        """Every source's profile from its current loaders, and its ``(loaders, threads)`` now."""
        a = self.plan.autoscale
        profiles, now = [], {}
        for name in pool.names:
            mine = pool.current(name)
            stats = [pool.slots[name][k][0].call(LoaderRole.stats).result() for k in mine]
            costs = [s["cpu_s_per_token"] for s in stats if not math.isnan(s["cpu_s_per_token"])]
            if costs:
                self.cost[name] = float(np.mean(costs))
            # a loader in a process of its own reports its memory; embedded, a loader's
            # memory is what its budget lets it hold
            own = [s["rss_bytes"] for s in stats] if self.measure_rss else []
            memory = float(np.mean(own)) if own else 4.0 * token_budget(self.plan, len(mine), name)
            threads = stats[0]["threads"] if stats else 1
            now[name] = (len(mine), threads)
            profiles.append(
                SourceProfile(
                    name,
                    self.cost.get(name, 0.0),
                    memory,
                    len(mine),
                    threads,
                    thread_efficiency=a.thread_efficiency,
                    max_loaders=max(len(fs) for _, fs in self.files[name].lists),
                )
            )
        return profiles, now

    def scale(
        self, pool: Sized, step: int, train_s: float, weights: Callable[[int], np.ndarray]
    ) -> Decision:
        """Measure every source's current loaders, decide, and re-size what the decision moved."""
        profiles, now = self.measure(pool)
        ahead = self.policy.weights_ahead(weights, step)
        decision = self.policy.decide(
            step, profiles, ahead, self.plan.batch.tokens_per_step, train_s
        )
        self.decisions.append(_decision_record(step, train_s, decision))
        for d in decision.sources:
            loaders, threads = now[d.name]
            if d.loaders != loaders:
                pool.repartition(d.name, d.loaders)
            if d.threads != threads or d.loaders != loaders:  # new loaders start with 1
                pool.set_threads(d.name, d.threads)
            if (d.loaders, d.threads) != (loaders, threads):
                log.warning("autoscaler: %s", d.reason)
        return decision

    def state_dict(self) -> dict[str, Any]:
        """The policy's hysteresis timers and each source's measured cost."""
        return {"policy": self.policy.state_dict(), "cost": dict(self.cost)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (a restarted planner's)."""
        self.policy.load_state_dict(state["policy"])
        self.cost = {n: float(c) for n, c in state["cost"].items()}


def _decision_record(step: int, train_s: float, decision: Decision) -> dict[str, Any]:
    """An autoscaler decision as the run summary shows it."""
    return {
        "step": step,
        "step_time_s": train_s,
        "bottleneck": decision.bottleneck,
        "cpu_cores": decision.cpu_cores,
        "reason": decision.reason,
        "sources": {
            d.name: {
                "loaders": d.loaders,
                "threads": d.threads,
                "demand_tokens_per_s": d.demand_tokens_per_s,
                "capacity_tokens_per_s": d.capacity_tokens_per_s,
                "cpu_cores": d.cpu_cores,
                "reason": d.reason,
            }
            for d in decision.sources
        },
    }
