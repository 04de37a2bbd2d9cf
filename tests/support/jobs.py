"""Running a job as a trainer would, with faults injected between batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from overlord import Loader
from overlord.ops.run import dump_line

Action = Callable[[Loader], None]


@dataclass
class Ran:
    """What a job delivered, and how it ended."""

    lines: list[str]
    stats: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    journal: str | None = None


def run_job(
    plan: Any,
    actions: dict[tuple[int, int], Action] | None = None,
    steps: int = 16,
    state: dict[str, Any] | None = None,
    **loader_kwargs: Any,
) -> Ran:
    """Every rank's batches up to step ``steps``; ``actions[(step, rank)](loader)`` runs first."""
    lines = []
    with Loader(plan, state=state, **loader_kwargs) as loader:
        clients = [loader.client(r) for r in range(loader.plan.world.dp)]
        for step in range(loader.start_step, steps):
            for r, c in enumerate(clients):
                if actions and (step, r) in actions:
                    actions[(step, r)](loader)
                lines.append(dump_line(next(c)))
        return Ran(lines, loader.stats(), loader.state_dict(), loader.journal)


def kill(source: str, k: int, replica: int = 0) -> Action:
    """Kill replica ``replica`` (0: the primary) of loader slot ``k`` of ``source``."""

    def act(loader: Loader) -> None:
        loader.runtime.kill(loader.slots()[source][k][replica])

    return act


def restart_planner(loader: Loader) -> None:
    """What Ray does to a killed planner: the same role, built again from the same arguments.

    The clients' consumption notices in flight reach the old planner first, so
    that where the new one resumes is a known step (notices lost with a planner
    only make it resume earlier: the tests of every rank's stream cover that).
    """
    loader._notices.flush()
    loader.runtime.restart(loader.planner)  # type: ignore[attr-defined]


def repartition(source: str, count: int) -> Action:
    """Re-partition ``source`` over ``count`` loaders."""
    return lambda loader: loader.repartition(source, count) and None


def set_threads(source: str, n: int) -> Action:
    """Reader threads of ``source``'s loaders."""
    return lambda loader: loader.set_threads(source, n)
