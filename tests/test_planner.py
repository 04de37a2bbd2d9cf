"""Planner: rank plans cut from a step's columns, consumption, and its state on any DP size."""

from __future__ import annotations

from typing import Any

import pytest
from support.roundtrip import Part, check_save_restore

from overlord import Loader, LoaderError, load_plan
from overlord.ops.run import dump_line
from overlord.roles.api import OpsRole, PlannerRole

pytestmark = pytest.mark.integration

STEPS = 7


def test_rank_plans_are_slices_of_the_steps_columns_that_cover_it_once(job_plan):
    plan = load_plan(job_plan).with_dp(4)
    with Loader(plan, build_batches=False) as loader:
        planner = loader.planner
        parts = [planner.call(PlannerRole.rank_plan, 0, r).result() for r in range(4)]
        history = planner.call(OpsRole.stats).result()["history"]
    items = [(s, *k) for p in parts for s, k in zip(p["source"].tolist(), p["key"].tolist())]
    assert len(set(items)) == len(items) > 0  # every item of the step, once
    assert sum(int(p["tokens"].sum()) for p in parts) == sum(history[0]["tokens"])
    for p in parts:
        assert p["rows"] == plan.rows_per_rank
        assert ((p["row"] >= 0) & (p["row"] < plan.rows_per_rank)).all()  # rows of its own
        assert list(p["row"]) == sorted(p["row"])
        assert p["cost"] > 0
    assert max(p["cost"] for p in parts) == pytest.approx(history[0]["max_cost"])


def test_the_planner_resumes_from_its_state_on_any_dp_size(job_plan):
    plan = load_plan(job_plan).with_dp(2)

    def make(state: dict[str, Any] | None) -> tuple[Loader, list[Any]]:
        loader = Loader(plan, state=state)
        return loader, [loader.client(r) for r in range(2)]

    check_save_restore(
        Part(
            make,
            lambda p: [dump_line(next(c)) for c in p[1]],
            lambda p: p[0].state_dict(),
            lambda p: p[0].close(),
        ),
        STEPS,
    )


@pytest.mark.integration
def test_the_planner_keeps_recent_steps_and_a_run_report_gathers_them_all(
    default_corpus, monkeypatch
):
    from overlord.ops.run import run_plan
    from overlord.roles import planner as planner_module

    plan = load_plan(default_corpus)
    whole = run_plan(plan, 20, progress=False)  # every step kept by the planner
    monkeypatch.setattr(planner_module, "HISTORY_STEPS", 8)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(20):
            for c in clients:
                next(c)
        kept = loader.stats()["history"]
    assert len(kept) == 8 and kept[-1]["step"] >= 19  # memory flat: the last 8 steps only
    gathered = run_plan(plan, 20, progress=False)  # the run asks for them as it goes
    for key in ("steps", "mixture", "balance_mean", "balance_p95", "fill_mean"):
        assert gathered[key] == whole[key], key


def test_the_plans_of_several_ranks_at_once_are_their_rank_plans_joined(job_plan):
    import numpy as np

    plan = load_plan(job_plan).with_dp(4)
    with Loader(plan, build_batches=False) as loader:
        planner = loader.planner
        parts = [planner.call(PlannerRole.rank_plan, 0, r).result() for r in (1, 2)]
        both = planner.call(PlannerRole.ranks_plan, 0, 2, 1, 2).result()
        with pytest.raises(LoaderError, match="outside the plan's world"):
            planner.call(PlannerRole.ranks_plan, 0, 2, 3, 2).result()
    assert both["first"] == 1 and both["rows"] == plan.rows_per_rank
    assert both["bounds"].tolist() == [
        0,
        len(parts[0]["tokens"]),
        sum(len(p["tokens"]) for p in parts),
    ]
    assert both["cost"].tolist() == [p["cost"] for p in parts]
    for c in ("source", "tokens", "row", "loader", "key", "file_index", "chunk", "rec_row"):
        assert np.array_equal(both[c], np.concatenate([p[c] for p in parts])), c
