"""Several SourceLoaders in one process: each source's state still held once, one process fewer.

A process costs tens of MB before it holds any data (a Ray actor with numpy and
pyarrow imported: about 60 MB), so a job with many small sources spends more
on processes than on source state. ``placement.loader_processes`` caps how
many processes hold the job's SourceLoaders; each loader then lives in a
:class:`LoaderGroup`, and a :class:`overlord.roles.loader_pool.MemberHandle`
makes it look to the planner and the constructors exactly like a loader of its
own.
"""

from __future__ import annotations

import os
from typing import Any

from overlord.plan.spec import Plan
from overlord.roles.source_loader import SourceLoader
from overlord.runtime.threads import lean_allocators
from overlord.sources.catalog import SourceFiles


class LoaderGroup:
    """Hosts SourceLoaders, by member name, and forwards calls to them."""

    def __init__(
        self,
        plan: Plan,
        files: dict[str, SourceFiles],
        members: list[tuple[str, str, int, int, dict[str, Any] | None]],
        keep_payloads: bool = True,
        shadow: bool = False,
    ):
        lean_allocators()  # one process, many sources' threads: see the function
        # members: (member name, source, loader index, loaders of the source, start)
        self.loaders = {
            name: SourceLoader(plan, files[source], source, k, n, start, keep_payloads, shadow)
            for name, source, k, n, start in members
        }

    def call(self, member: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on member ``member``."""
        return getattr(self.loaders[member], method)(*args)

    def take_many(self, keys: dict[str, Any]) -> dict[str, Any]:
        """``take`` on several members in one call: one round trip per group, not per source."""
        return {member: self.loaders[member].take(k) for member, k in keys.items()}

    def release_many(self, keys: dict[str, Any]) -> None:
        """``release`` on several members in one call."""
        for member, k in keys.items():
            self.loaders[member].release(k)

    def pid(self) -> int:
        """The process the group runs in."""
        return os.getpid()

    def close(self) -> None:
        """Close every member."""
        for loader in self.loaders.values():
            loader.close()


def assign_groups(loaders: list[tuple[str, int]], processes: int) -> list[list[tuple[str, int]]]:
    """Spread ``(source, index)`` loaders over ``processes`` groups, round robin in plan order.

    >>> assign_groups([("a", 0), ("a", 1), ("b", 0)], 2)
    [[('a', 0), ('b', 0)], [('a', 1)]]
    """
    groups: list[list[tuple[str, int]]] = [[] for _ in range(min(processes, len(loaders)))]
    for i, member in enumerate(loaders):
        groups[i % len(groups)].append(member)
    return groups
