"""A step's plan as a pure function: array windows in, columns by rank and row out (no Loader)."""

from __future__ import annotations

import numpy as np
import pytest
from support.windows import ColumnWindow

from overlord import load_plan
from overlord.plan.cost import CostModel
from overlord.plan.select import MixState
from overlord.plan.spec import Plan, validate_plan
from overlord.plan.step import StepColumns, plan_step, rank_slice

DP, RPR, CAP = 4, 2, 256


@pytest.fixture(scope="module")
def plan(job_plan) -> Plan:
    """The job's plan for 4 ranks of 2 rows of 256 tokens, rank groups of 2 allowed."""
    base = load_plan(job_plan)
    data = base.model_dump(mode="json")
    data["batch"].update(tokens_per_step=DP * RPR * CAP, max_seq_len=CAP)
    data["world"]["dp"] = DP
    return validate_plan(data, base_dir=base.base_dir)


def _windows(plan: Plan, seed: int) -> list[ColumnWindow]:
    rng = np.random.default_rng(seed)
    return [
        ColumnWindow(np.clip(rng.lognormal(3.5 + s, 1.2, 500).astype(int), 1, CAP))
        for s in range(len(plan.source_names))
    ]


def _step(
    plan: Plan, windows: list[ColumnWindow], mix: MixState | None = None, groups: int = 1
) -> StepColumns:
    n = len(windows)
    weights = np.full(n, 1.0 / n)
    mix = MixState.zeros(n) if mix is None else mix
    return plan_step(plan, windows, weights, mix, CostModel.from_spec(plan.balance.cost), groups)


def _items(cols: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    return list(zip(cols["source"].tolist(), cols["key"][:, 2].tolist()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_steps_columns_hold_each_chosen_item_once_by_rank_in_rows_that_hold_it(plan, seed):
    step = _step(plan, _windows(plan, seed))
    cols = step.columns
    items = _items(cols)
    assert len(items) == len(set(items)) > 0
    bounds = cols["bounds"]
    assert bounds[0] == 0 and bounds[-1] == len(items) and (np.diff(bounds) >= 0).all()
    assert ((cols["row"] >= 0) & (cols["row"] < RPR)).all()
    rank = np.searchsorted(bounds, np.arange(len(items)), side="right") - 1
    global_row = rank * RPR + cols["row"]
    assert (np.diff(global_row) >= 0).all()  # grouped by rank, rows in order
    assert (np.bincount(global_row, weights=cols["tokens"], minlength=DP * RPR) <= CAP).all()
    # the record's row is the item's own (taken from its window), not its row in the batch
    assert (cols["rec_row"] == cols["key"][:, 2]).all()
    per_source = np.bincount(cols["source"], weights=cols["tokens"], minlength=len(plan.sources))
    assert step.stats["tokens"] == per_source.tolist()
    assert step.stats["max_cost"] == pytest.approx(float(step.rank_cost.max()))
    assert step.stats["fill"] == pytest.approx(cols["tokens"].sum() / plan.batch.tokens_per_step)


def test_rank_slices_cover_the_step_once_and_are_views_of_its_columns(plan):
    cols = _step(plan, _windows(plan, 3)).columns
    parts = [rank_slice(cols, r) for r in range(DP)]
    assert np.concatenate([p["tokens"] for p in parts]).tolist() == cols["tokens"].tolist()
    assert all(np.shares_memory(p["key"], cols["key"]) for p in parts if len(p["key"]))
    for r, p in enumerate(parts):  # a rank's sum, computed with the step's
        lo, hi = cols["bounds"][r], cols["bounds"][r + 1]
        assert p["cost"] == pytest.approx(float(cols["cost"][lo:hi].sum()))
        assert len(p["source"]) == len(p["row"]) == len(p["rec_row"]) == hi - lo


def test_the_same_windows_give_the_same_step_and_groups_never_change_its_items(plan):
    a, b = (_step(plan, _windows(plan, 4)) for _ in range(2))
    assert a.columns.keys() == b.columns.keys()
    assert all(np.array_equal(a.columns[c], b.columns[c]) for c in a.columns)
    grouped = _step(plan, _windows(plan, 4), groups=2)
    assert sorted(_items(grouped.columns)) == sorted(_items(a.columns))


def test_the_windows_and_the_mixture_move_past_the_step(plan):
    windows, mix = _windows(plan, 5), MixState.zeros(len(plan.sources))
    first = _step(plan, windows, mix)
    placed = mix.placed.copy()
    assert placed.sum() == first.columns["tokens"].sum()
    second = _step(plan, windows, mix)
    assert not set(_items(first.columns)) & set(_items(second.columns))  # taken once
    assert mix.placed.sum() == placed.sum() + second.columns["tokens"].sum()


@pytest.mark.parametrize(
    "source",
    [[7, 2, 7, 11, 2, 7, 0], [3, 3, 3], [5]],
    ids=["several windows", "one window", "one item"],
)
def test_taken_columns_follow_the_selection_order_whichever_windows_gave_items(source):
    from overlord.plan.step import take_columns

    windows = [ColumnWindow(np.arange(1, 40) + 100 * s, loaders=3) for s in range(12)]
    for w in windows:
        w.peek(30)
    # items from a few of the windows only, interleaved, each window's in any order (one
    # window alone: its answer is the step's columns as it is)
    source = np.array(source, dtype=np.int64)
    pending = np.array([4, 0, 1, 9, 3, 20, 5][: len(source)], dtype=np.int64)
    expected = [(int(s), windows[s].ids[int(i)]) for s, i in zip(source, pending)]
    lengths = [windows[s].pending[int(i)] for s, i in zip(source, pending)]
    cols = take_columns(windows, source, pending)
    # ColumnWindow's record row is the item's read order: each row is its own item's
    assert [(int(s), int(r)) for s, r in zip(source, cols["row"])] == expected
    assert cols["key"][:, 2].tolist() == [r for _, r in expected]
    assert cols["key"].shape == (len(source), 3)
    assert cols["loader"].tolist() == [r % 3 for _, r in expected]
    assert cols["tokens"].tolist() == lengths
    counts = np.bincount(source, minlength=12)
    assert all(len(windows[s].pending) == 31 - counts[s] for s in range(12))
    assert take_columns(windows, source[:0], pending[:0])["key"].shape == (0, 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_ranks_statistics_are_its_whole_step_as_the_general_sums_give_them(plan, seed):
    from overlord.plan.balance import rank_costs
    from overlord.plan.step import equal_docs_max_cost

    one = plan.with_dp(1)
    step = _step(one, _windows(one, seed))
    cost, rows = step.columns["cost"], one.rows_per_rank
    whole = rank_costs(cost, np.zeros(len(cost), dtype=np.int64), 1, rows)
    assert step.stats["max_cost"] == step.stats["baseline_max_cost"] == float(whole[0])
    assert step.stats["equal_docs_max_cost"] == equal_docs_max_cost(cost, 1) == float(whole[0])
