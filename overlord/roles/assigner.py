"""Assigners: the roles that balance a hierarchical step's groups in parallel.

A step of thousands of ranks is split into groups (:mod:`overlord.plan.hierarchy`),
each balanced on its own. The planner sends the groups to its assigners, one
call per assigner with every ``count``-th group, through the runtime seam:
on Ray each assigner is an actor, so the groups are balanced in parallel, in
processes of their own; on the embedded runtime an assigner is an object in
the planner's process and the groups run one after the other (Python's GIL
would serialize threads, and processes would need a transport the embedded
runtime does not have). A group's result is a pure function of its items, so
how many assigners there are, or which one balanced a group, never changes a
row: an assigner that died is replaced by the planner balancing its groups
itself.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from overlord.errors import ActorDiedError
from overlord.plan.hierarchy import Job, group_count, run_here
from overlord.plan.spec import Plan
from overlord.roles.api import AssignerRole
from overlord.runtime.base import Handle, RoleOptions, Runtime

log = logging.getLogger("overlord.assigner")

# assigners on a distributed runtime when the plan does not say (never more than groups)
DEFAULT_ASSIGNERS = 16


def assigner_count(plan: Plan, distributed: bool) -> int:
    """The assigners a job's planner uses: the plan's count, else a default for the runtime.

    ``distributed``: roles run in processes of their own, where groups are
    balanced in parallel; in one process the planner balances them itself (0).
    """
    count = plan.placement.assigners
    if count is not None:
        return count
    groups = group_count(plan.world.dp, plan.balance.group_ranks)
    return min(groups, DEFAULT_ASSIGNERS) if distributed else 0


class Assigner:
    """Balances groups of a step's ranks; holds nothing between calls."""

    def assign(self, jobs: list[Job]) -> list[np.ndarray]:
        """The rows of each group's items, among the group's own rows."""
        return run_here(jobs)

    def pid(self) -> int:
        """The process this assigner runs in."""
        return os.getpid()

    def close(self) -> None:
        """Nothing to free."""


class Assigners:
    """The planner's ``count`` assigners, spawned through ``runtime`` when first needed.

    ``count`` 0 balances every group in the caller. A restarted planner finds
    the assigners of its job by name (on Ray they outlive it) and uses them.
    """

    def __init__(self, runtime: Runtime, count: int, options: RoleOptions):
        self.runtime, self.count, self.options = runtime, count, options
        self._handles: list[Handle[AssignerRole]] = []

    def _ready(self, count: int) -> list[Handle[AssignerRole]]:
        while len(self._handles) < count:
            name = f"assigner-{len(self._handles)}"
            found = self.runtime.lookup_or_spawn(Assigner, name=name, options=self.options)
            self._handles.append(found)
        return self._handles[:count]

    def run(self, jobs: list[Job]) -> list[np.ndarray]:
        """Balance ``jobs`` on the assigners, all at once; their rows, in order."""
        count = min(self.count, len(jobs))
        if count <= 1:
            return run_here(jobs)
        handles = self._ready(count)
        refs = [h.call(AssignerRole.assign, jobs[i::count]) for i, h in enumerate(handles)]
        out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(jobs)
        lost = False
        for i, ref in enumerate(refs):
            try:
                got = ref.result()
            except ActorDiedError as e:  # the same rows, balanced here
                log.warning("assigner %d died (%s): the planner balances its groups", i, e)
                got, lost = run_here(jobs[i::count]), True
            out[i::count] = got
        if lost:
            self._handles.clear()  # looked up (or spawned) again at the next step
        return out


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[AssignerRole] = Assigner
