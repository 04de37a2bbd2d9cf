"""``overlord.plan.schedule``: the mixture's weights at each step. Pure."""

from __future__ import annotations

import numpy as np

from overlord.plan.schedule import Schedule
from overlord.plan.spec import validate_plan


def _plan(schedule, interpolation="linear", names=("a", "b", "c")):
    return validate_plan(
        {
            "sources": [{"name": n, "path": f"{n}/*", "format": "jsonl"} for n in names],
            "batch": {"tokens_per_step": 64, "max_seq_len": 16},
            "mixture": {"interpolation": interpolation, "schedule": schedule},
        }
    )


def test_schedule_linear_and_step():
    sched = [{"step": 10, "weights": {"a": 3, "b": 1}}, {"step": 20, "weights": {"c": 1}}]
    lin = Schedule(_plan(sched))
    np.testing.assert_allclose(lin.weights(0), [0.75, 0.25, 0])  # before the first point
    np.testing.assert_allclose(lin.weights(15), [0.375, 0.125, 0.5])
    np.testing.assert_allclose(lin.weights(99), [0, 0, 1])
    stp = Schedule(_plan(sched, "step"))
    np.testing.assert_allclose(stp.weights(19), [0.75, 0.25, 0])
    np.testing.assert_allclose(stp.weights(20), [0, 0, 1])


def test_schedule_defaults_to_equal_shares():
    plan = validate_plan(
        {
            "sources": [{"name": n, "path": "x", "format": "jsonl"} for n in "ab"],
            "batch": {"tokens_per_step": 8, "max_seq_len": 8},
        }
    )
    np.testing.assert_allclose(Schedule(plan).weights(5), [0.5, 0.5])
