"""The loaders as a DataConstructor sees them: handles, and the planner for failovers.

The :class:`~overlord.roles.loader_pool.LoaderPool` owns every loader and
lives in the planner's process; a constructor holds a :class:`PoolView` of it,
the current primary of every slot, and asks the planner for a replacement when
one dies (the pool's ``failover``, served by the planner) or for the primaries
of a partition added after the view was made.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from overlord.errors import ActorDiedError, LoaderError
from overlord.roles.api import LoaderGroupRole, LoaderRole, PlannerRole
from overlord.roles.loader_pool import _grouped, replica_name
from overlord.runtime.base import Handle, Ref

MAX_FAILOVERS = 8  # replacements of one batch's loaders before giving up


class PoolView:
    """The loaders as a DataConstructor sees them: handles, and the planner for failovers.

    Takes only read, so asking a replacement again for what a dead loader
    was asked is safe.
    """

    def __init__(
        self,
        names: list[str],
        loaders: dict[str, list[Handle[LoaderRole] | None]],
        planner: Handle[PlannerRole],
    ):
        self.names, self.planner = names, planner
        self.loaders = [list(loaders[n]) for n in names]  # current primaries

    def take(
        self, slots: list[tuple[int, int, np.ndarray]], keys: np.ndarray
    ) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Payloads of each ``(source, loader, item indexes)``, every loader asked at once."""
        out = []
        todo = slots
        for _ in range(MAX_FAILOVERS):
            calls = []
            for s, k, mine in todo:
                if k >= len(self.loaders[s]):  # a partition added after this view was made
                    now = self.planner.call(PlannerRole.primaries, self.names[s]).result()
                    self.loaders[s] = list(now)
                handle = self.loaders[s][k]
                if handle is None:
                    raise LoaderError(f"loader {k} of '{self.names[s]}' was retired")
                calls.append((handle, keys[mine], (s, k, mine)))
            refs: list[tuple[Ref[Any], list[tuple[str | None, Any]]]] = []
            for target, asked, members in _grouped(calls):
                if isinstance(asked, dict):
                    refs.append((target.call(LoaderGroupRole.take_many, asked), members))
                else:
                    refs.append((target.call(LoaderRole.take, asked), members))
            todo = []
            for ref, members in refs:
                try:
                    got: Any = ref.result()
                except ActorDiedError:
                    for _, (s, k, mine) in members:
                        dead = self.loaders[s][k]
                        assert dead is not None
                        self.loaders[s][k] = self.planner.call(
                            PlannerRole.failover, self.names[s], k, replica_name(dead)
                        ).result()
                        todo.append((s, k, mine))
                    continue
                out += [(mine, got if m is None else got[m]) for m, (_, _, mine) in members]
            if not todo:
                return out
        raise LoaderError(
            f"loaders of sources {sorted({self.names[s] for s, _, _ in todo})} kept dying: "
            f"{MAX_FAILOVERS} failovers in a row"
        )
