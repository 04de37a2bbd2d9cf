"""Chaos on Ray, at a small size: kill every kind of role; the stream must not change.

The longer run, with figures, is ``benchmarks/chaos.py``.
"""

from __future__ import annotations

import pytest

from benchmarks._lib.corpus import write_corpus
from benchmarks.chaos import Kill, reference, run, with_shadows
from overlord import load_plan

pytestmark = [pytest.mark.ray, pytest.mark.integration]

STEPS = 24


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return load_plan(write_corpus(tmp_path_factory.mktemp("chaos"), sources=2, files=4, docs=200))


def test_killing_loaders_constructors_and_the_planner_leaves_the_stream_exact(ray_session, plan):
    want = reference(plan, STEPS)
    kills = [
        Kill(4, "loader", "sigkill"),
        Kill(8, "constructor", "sigkill"),
        Kill(12, "planner", "sigkill"),
        Kill(15, "loader", "ray.kill"),
        Kill(18, "planner", "ray.kill"),
    ]
    got = run(with_shadows(plan, 1), STEPS, kills, step_time=0.05, job="chaos-ci", seed=3)
    assert got.lines == want
    events = [e.get("event") for e in got.events]
    assert "planner-recovered" in events
    assert not got.leftover, got.leftover  # every actor process of the job is gone
    assert got.shm_after <= got.shm_before
    # a second job of the same name starts cleanly after all that
    again = run(with_shadows(plan, 1), 3, [], step_time=0.0, job="chaos-ci")
    assert len(again.lines) == 3 * plan.world.dp and again.lines == want[: len(again.lines)]


def test_without_shadows_a_killed_loader_is_read_again_and_the_stream_is_exact(ray_session, plan):
    want = reference(plan, STEPS)
    kills = [Kill(5, "loader", "sigkill"), Kill(11, "loader", "ray.kill")]
    got = run(with_shadows(plan, 0), STEPS, kills, step_time=0.0, job="chaos-ci-0", seed=5)
    assert got.lines == want
    hows = [e["how"] for e in got.events if e.get("event") == "failover"]
    assert hows and all(h.startswith("started a new loader") for h in hows)
