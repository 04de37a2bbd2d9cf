"""The loaders as a DataConstructor sees them: handles, and the planner for failovers.

The :class:`~overlord.roles.loader_pool.LoaderPool` owns every loader and
lives in the planner's process; a constructor holds a :class:`PoolView` of it,
the current primary of every slot, and asks the planner for a replacement when
one dies (the pool's ``failover``, served by the planner) or for the primaries
of a partition added after the view was made.
"""

from __future__ import annotations

import numpy as np

from overlord.errors import ActorDiedError, LoaderError
from overlord.plan.partition import group_rows
from overlord.roles.api import LoaderRole, PoolRole
from overlord.runtime import call_each
from overlord.runtime.base import Handle

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
        planner: Handle[PoolRole],
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
            calls: list[tuple[Handle[LoaderRole], np.ndarray]] = []
            for s, k, mine in todo:
                # a partition added after this view was made, or retired when it was last
                # looked at (a rewind to before the retirement starts its loaders anew)
                if k >= len(self.loaders[s]) or self.loaders[s][k] is None:
                    now = self.planner.call(PoolRole.primaries, self.names[s]).result()
                    self.loaders[s] = list(now)
                handle = self.loaders[s][k]
                if handle is None:
                    raise LoaderError(f"loader {k} of '{self.names[s]}' was retired")
                calls.append((handle, group_rows(keys, mine)))
            # loaders that share a process are asked in one call to it
            refs = call_each(LoaderRole.take, calls)
            asked, todo = todo, []
            for (s, k, mine), (handle, _), ref in zip(asked, calls, refs):
                try:
                    out.append((mine, ref.result()))
                except ActorDiedError:
                    self.loaders[s][k] = self.planner.call(
                        PoolRole.failover, self.names[s], k, handle.name
                    ).result()
                    todo.append((s, k, mine))
            if not todo:
                return out
        raise LoaderError(
            f"loaders of sources {sorted({self.names[s] for s, _, _ in todo})} kept dying: "
            f"{MAX_FAILOVERS} failovers in a row"
        )
