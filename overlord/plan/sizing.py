"""What the autoscaler reads and decides: source profiles, the budget, decisions.

Plain frozen values, validated on construction with every problem listed at
once; the policy itself is :mod:`overlord.plan.autoscale`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# ---- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceProfile:
    """What a source's loaders measured (moving averages) and how it is sized now.

    ``cpu_s_per_token`` is one reader's busy seconds per token produced (read +
    decode + tokenize, per-document and per-file overheads included): the
    SourceLoader's read time over its tokens. 0 or NaN means not measured yet.
    ``thread_efficiency`` is the gain of each extra reader thread in one loader,
    as a fraction of the first thread's rate, ``(rate(T)/rate(1) - 1)/(T - 1)``.
    ``max_loaders`` is how many loaders can be busy at all (a loader owns whole
    shards, so at most the number of shards); None for no limit.
    """

    name: str
    cpu_s_per_token: float
    memory_bytes_per_loader: float
    loaders: int
    threads: int
    thread_efficiency: float = 1.0
    max_loaders: int | None = None

    def __post_init__(self) -> None:
        c, m, e = self.cpu_s_per_token, self.memory_bytes_per_loader, self.thread_efficiency
        check_all(f"source profile {self.name!r}", [
            (isinstance(self.name, str) and bool(self.name),
             f"name must be a non-empty string, found {self.name!r}"),
            (math.isnan(c) or 0 <= c < math.inf,
             f"cpu_s_per_token must be >= 0 and finite (0 or NaN: unmeasured), found {c}"),
            (0 <= m < math.inf, f"memory_bytes_per_loader must be >= 0 and finite, found {m}"),
            (self.loaders >= 0, f"loaders must be >= 0, found {self.loaders}"),
            (self.threads >= 1, f"threads must be >= 1, found {self.threads}"),
            (0 <= e <= 1, f"thread_efficiency must be in [0, 1], found {e}"),
            (self.max_loaders is None or self.max_loaders >= 1,
             f"max_loaders must be >= 1 or None, found {self.max_loaders}"),
        ])  # fmt: skip

    @property
    def measured(self) -> bool:
        """Whether a cost has been measured (False while 0 or NaN)."""
        return self.cpu_s_per_token > 0


@dataclass(frozen=True)
class Budget:
    """What all sources' readers may use together.

    ``cpus`` bounds the cores all readers are expected to burn together at the
    horizon's peak demand, with headroom: a source's tokens to produce times
    its ``cpu_s_per_token``, at most one core per reader thread, whatever its
    loaders (an idle reader burns none); an unmeasured source counts one core
    per reader thread. Loaders cost memory instead: ``memory_bytes`` bounds the
    sum of loaders x ``memory_bytes_per_loader``; ``math.inf`` for none.
    """

    cpus: float
    memory_bytes: float = math.inf
    max_threads_per_loader: int = 4
    min_loaders: int = 1

    def __post_init__(self) -> None:
        check_all("budget", [
            (1 <= self.cpus < math.inf, f"cpus must be >= 1 and finite, found {self.cpus}"),
            (self.memory_bytes > 0,
             f"memory_bytes must be > 0 (inf: no limit), found {self.memory_bytes}"),
            (self.max_threads_per_loader >= 1,
             f"max_threads_per_loader must be >= 1, found {self.max_threads_per_loader}"),
            (self.min_loaders >= 1, f"min_loaders must be >= 1, found {self.min_loaders}"),
        ])  # fmt: skip


# ---- outputs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceDecision:
    """The size chosen for one source, with the figures behind it.

    ``capacity_tokens_per_s`` is what the chosen size supplies by the model
    (NaN while the source's cost is unmeasured); ``cpu_cores`` is what its
    readers are expected to burn, the share of ``Budget.cpus`` it takes (its
    reader threads while unmeasured).
    """

    name: str
    loaders: int
    threads: int
    demand_tokens_per_s: float
    capacity_tokens_per_s: float
    memory_bytes: float
    reason: str
    cpu_cores: float = math.nan

    @property
    def cpus(self) -> int:
        """Reader threads of this source in all."""
        return self.loaders * self.threads


@dataclass(frozen=True)
class Decision:
    """Sizes for every source at one step; ``bottleneck`` is the source furthest below demand."""

    step: int
    sources: tuple[SourceDecision, ...]
    bottleneck: str | None
    reason: str

    @property
    def cpus(self) -> int:
        """Reader threads of all sources together (may exceed ``Budget.cpus``)."""
        return sum(s.cpus for s in self.sources)

    @property
    def cpu_cores(self) -> float:
        """Cores all readers are expected to burn together: what ``Budget.cpus`` bounds."""
        return sum(s.cpu_cores for s in self.sources)

    @property
    def memory_bytes(self) -> float:
        """Memory of all loaders together."""
        return sum(s.memory_bytes for s in self.sources)

    def source(self, name: str) -> SourceDecision:
        """The decision for source ``name``."""
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"no source {name!r} in this decision: {[s.name for s in self.sources]}")


def check_all(what: str, rules: Sequence[tuple[bool, str]]) -> None:
    """Raise one ValueError that lists every rule broken, not only the first."""
    problems = [msg for ok, msg in rules if not ok]
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"{what}: {len(problems)} problem(s):\n{lines}")
