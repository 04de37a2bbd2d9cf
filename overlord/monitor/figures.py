"""What the planner counts: consumed steps and tokens, trainer waits, planning time, rank costs.

The planner keeps one :class:`Figures` and updates it as ranks consume steps and as it plans
them. :meth:`Figures.as_dict` is a plain reading of it; the planner adds what it asks of its
pool and loaders, and :mod:`overlord.monitor.prometheus` shows the result under the metric
names of its ``METRICS`` table. The figures are kept whether or not an endpoint is served.
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any

import numpy as np

# upper bounds of the histograms' buckets, in seconds (+Inf is added)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0)  # fmt: skip
PLAN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 5.0)  # fmt: skip
COST_STEPS_KEPT = 1024  # steps whose per-rank predicted cost is kept to pair with step times
COST_STEPS_PRUNED = 64  # how many more are kept before the oldest are forgotten together
COUNT_STEPS = 64  # consumed steps whose tokens and samples by source are counted together


class Histogram:
    """Counts of observations under fixed bucket bounds, with their sum.

    Not thread-safe: :class:`Figures` updates and reads it under its lock.
    """

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in its bucket."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    def as_dict(self) -> dict[str, Any]:
        """Cumulative buckets ``[[bound, count], ...]`` (the last bound ``inf``), count, sum."""
        cum = np.cumsum(self.counts).tolist()
        return {
            "buckets": [[b, c] for b, c in zip([*self.bounds, math.inf], cum)],
            "count": cum[-1],
            "sum": self.sum,
        }


class Figures:
    """What the planner counts for monitoring, updated on its thread, read on any."""

    def __init__(self, names: list[str], dp: int):
        self.names, self.dp = names, dp
        self._lock = threading.Lock()
        self.steps = 0
        self._tokens = np.zeros(len(names), dtype=np.int64)
        self._samples = np.zeros(len(names), dtype=np.int64)
        # consumed steps' (source, tokens) columns not counted yet: counted together
        self._uncounted: list[tuple[np.ndarray, np.ndarray]] = []
        self.skipped_q = np.zeros(len(names), dtype=np.int64)  # quarantined, in consumed steps
        self.wait = [Histogram(WAIT_BUCKETS) for _ in range(dp)]
        self.plan = Histogram(PLAN_BUCKETS)
        self.cost = [math.nan] * dp  # predicted cost of each rank's last consumed step
        self.step_s = [math.nan] * dp  # each rank's last measured step time
        self._costs: dict[int, list[float]] = {}  # step -> per-rank cost, while it may be paired
        self._fit = [0.0, 0.0]  # sum of cost * seconds, sum of cost**2
        self._reporting: set[int] = set()  # ranks whose trainers report their step times
        self.refits = 0  # cost-model refits from reports (overlord.roles.feedback)
        self.model_err = math.nan  # the most loaded rank's relative error, last reported step

    def planned(self, step: int, seconds: float, rank_costs: np.ndarray) -> None:
        """Step ``step`` was planned in ``seconds``; ``rank_costs`` is each rank's cost."""
        with self._lock:
            self.plan.observe(seconds)
            self._costs[step] = np.asarray(rank_costs, dtype=np.float64).tolist()
            if len(self._costs) > COST_STEPS_KEPT + COST_STEPS_PRUNED:  # the oldest, at once
                for old in sorted(self._costs)[: len(self._costs) - COST_STEPS_KEPT]:
                    del self._costs[old]

    def consumed(self, source: np.ndarray, tokens: np.ndarray) -> None:
        """Every rank consumed a step whose items come from ``source`` with ``tokens`` each.

        Kept as they are (the step's plan columns, which nothing writes) and counted
        :data:`COUNT_STEPS` steps at a time, or when read: a few numpy calls per step on a
        step's handful of items cost more than the counting itself.
        """
        with self._lock:
            self.steps += 1
            self._uncounted.append((source, tokens))
            if len(self._uncounted) >= COUNT_STEPS:
                self._count()

    def _count(self) -> None:
        """Add the steps not counted yet to the tokens and samples by source (lock held)."""
        if not self._uncounted:
            return
        source = np.concatenate([s for s, _ in self._uncounted])
        tokens = np.concatenate([t for _, t in self._uncounted])
        self._uncounted.clear()
        n = len(self.names)
        self._tokens += np.bincount(source, weights=tokens, minlength=n).astype(np.int64)
        self._samples += np.bincount(source, minlength=n)

    @property
    def tokens(self) -> np.ndarray:
        """Tokens of consumed steps, by source (a copy)."""
        with self._lock:
            self._count()
            return self._tokens.copy()

    @property
    def samples(self) -> np.ndarray:
        """Samples of consumed steps, by source (a copy)."""
        with self._lock:
            self._count()
            return self._samples.copy()

    def quarantined(self, source: np.ndarray) -> None:
        """A step every rank consumed was planned without these quarantined items (by source)."""
        with self._lock:
            self.skipped_q += np.bincount(source, minlength=len(self.names))

    def trainer(self, rank: int, step: int, train_s: float | None, wait_s: float | None) -> None:
        """DP rank ``rank`` received ``step`` after waiting ``wait_s`` for it.

        ``train_s`` is its time on the step before (waits excluded), paired with
        that step's predicted cost for the fit; the client's measures, None where
        it has none.
        """
        with self._lock:
            if wait_s is not None and wait_s >= 0:
                self.wait[rank].observe(wait_s)
            costs = self._costs.get(step)
            if costs is not None:
                self.cost[rank] = costs[rank]
            before = self._costs.get(step - 1)
            if rank in self._reporting:
                return  # its trainer reports its own step times: they fill these figures
            if train_s is not None and train_s >= 0 and before is not None:
                self.step_s[rank] = train_s
                c = before[rank]
                self._fit[0] += c * train_s
                self._fit[1] += c * c

    def reported(self, rank: int, predicted: float, seconds: float) -> None:
        """DP rank ``rank``'s trainer reported ``seconds`` on a step predicted at ``predicted``.

        A rank that reports is measured by its reports from then on, rather
        than by the time between its ``next()`` calls.
        """
        with self._lock:
            if rank not in self._reporting:
                self._reporting.add(rank)
            self.cost[rank], self.step_s[rank] = predicted, seconds
            self._fit[0] += predicted * seconds
            self._fit[1] += predicted * predicted

    def model_error(self, error: float, refits: int) -> None:
        """The cost model's relative error on the last reported step, and the refits so far."""
        with self._lock:
            self.model_err, self.refits = error, refits

    def seconds_per_cost(self) -> float:
        """The least-squares slope through 0 of step time against predicted cost."""
        with self._lock:
            return self._fit[0] / self._fit[1] if self._fit[1] > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        """The counters and histograms, as plain data."""
        k = self.seconds_per_cost()
        with self._lock:
            self._count()
            tokens = self._tokens.tolist()
            total = max(sum(tokens), 1)
            return {
                "steps": self.steps,
                "tokens": dict(zip(self.names, tokens)),
                "samples": dict(zip(self.names, self._samples.tolist())),
                "quarantined": dict(zip(self.names, self.skipped_q.tolist())),
                "share": {n: t / total for n, t in zip(self.names, tokens)},
                "wait": [h.as_dict() for h in self.wait],
                "plan": self.plan.as_dict(),
                "rank_cost": list(self.cost),
                "rank_step_s": list(self.step_s),
                "rank_step_s_predicted": [c * k for c in self.cost],
                "seconds_per_cost": k,
                "cost_model_error": self.model_err,
                "refits": self.refits,
            }
