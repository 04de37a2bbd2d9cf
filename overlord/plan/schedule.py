"""Mixture weights along training: a pure function of the plan and the step."""

from __future__ import annotations

import bisect

import numpy as np

from overlord.plan.spec import Interpolation, Plan


class Schedule:
    """Token shares per source (plan order) at any step.

    Before the first point the first weights hold, after the last the last.
    Weights are normalized to sum to one at every point. Without a mixture,
    every source gets an equal share.
    """

    def __init__(self, plan: Plan):
        self.names = names = plan.source_names
        if plan.mixture is None:
            self._steps = [0]
            self._weights = np.full((1, len(names)), 1.0 / len(names))
            self._linear = False
            return
        points = plan.mixture.schedule
        self._steps = [p.step for p in points]
        w = np.array([[p.weights.get(n, 0.0) for n in names] for p in points], dtype=np.float64)
        self._weights = w / w.sum(axis=1, keepdims=True)
        self._linear = plan.mixture.interpolation is Interpolation.LINEAR

    def weights(self, step: int) -> np.ndarray:
        """Weights at ``step``, one per source in plan order, summing to one.

        >>> from overlord.plan.spec import validate_plan
        >>> p = validate_plan({"sources": [{"name": "a", "path": "a", "format": "jsonl"},
        ...                                {"name": "b", "path": "b", "format": "jsonl"}],
        ...     "batch": {"tokens_per_step": 8, "max_seq_len": 8},
        ...     "mixture": {"schedule": [{"step": 0, "weights": {"a": 1}},
        ...                              {"step": 10, "weights": {"b": 1}}]}})
        >>> Schedule(p).weights(5).tolist()
        [0.5, 0.5]
        """
        i = bisect.bisect_right(self._steps, step) - 1
        if i < 0:
            return self._weights[0].copy()
        if i == len(self._steps) - 1 or not self._linear:
            return self._weights[i].copy()
        s0, s1 = self._steps[i], self._steps[i + 1]
        f = (step - s0) / (s1 - s0)
        return (1 - f) * self._weights[i] + f * self._weights[i + 1]

    def named(self, step: int) -> dict[str, float]:
        """Weights at ``step`` by source name."""
        return dict(zip(self.names, self.weights(step).tolist()))
