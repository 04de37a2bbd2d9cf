"""Hierarchical balancing: groups of ranks balanced apart, and the planner that uses them.

What a grouping may change is who gets an item, never which items form a step;
how many assigners balance the groups, and where, changes nothing at all.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.windows import windows

from overlord import Loader, load_plan
from overlord.ops.run import dump_line
from overlord.plan.balance import assign, rank_costs, whole_rows
from overlord.plan.cost import CostModel
from overlord.plan.hierarchy import assign_step, group_count, split_rows, step_bound, swap_rows
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod, validate_plan
from overlord.roles.assigner import Assigners
from overlord.runtime.base import DEFAULT_OPTIONS
from overlord.runtime.inline import InlineRuntime

ALPHA, BETA = 1.0, 2.5e-4


def _step(seed: int, dp: int, rpr: int, cap: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    wins = windows(rng, 3, cap, n=2 * dp * rpr)
    sel = select_step(wins, np.array([0.5, 0.3, 0.2]), MixState.zeros(3), dp * rpr, cap, 64)
    tokens = np.array(sel.tokens)
    return tokens, CostModel(ALPHA, BETA).cost(tokens), np.array(sel.ref_row)


def _grouped(tokens, cost, ref, dp, rpr, cap, groups, run=None):
    bound = lambda: step_bound(tokens, cost, dp, rpr * cap, ALPHA, BETA)  # noqa: E731
    args = (tokens, cost, ref, dp, rpr, cap, BalanceMethod.KK, groups, bound)
    return assign_step(*args) if run is None else assign_step(*args, run)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    dp=st.sampled_from([4, 6, 16]),
    rpr=st.integers(1, 4),
    groups=st.sampled_from([2, 4]),
)
def test_groups_place_every_item_once_in_rows_that_hold_it(seed, dp, rpr, groups):
    if dp % groups:
        groups = 2
    cap = 256
    tokens, cost, ref = _step(seed, dp, rpr, cap)
    row = _grouped(tokens, cost, ref, dp, rpr, cap, groups)
    assert row.shape == tokens.shape and ((row >= 0) & (row < dp * rpr)).all()
    assert (np.bincount(row, weights=tokens, minlength=dp * rpr) <= cap).all()
    # never worse than each group's reference rows balanced whole, what a group falls back to
    split = split_rows(cost, ref, dp * rpr, groups)
    whole = 0.0
    for g in range(groups):
        mine = split.order[split.bounds[g] : split.bounds[g + 1]]
        got = whole_rows(cost[mine], split.local_ref[mine], dp // groups, rpr)
        whole = max(whole, rank_costs(cost[mine], got, dp // groups, rpr).max())
    assert rank_costs(cost, row, dp, rpr).max() <= whole * (1 + 1e-12)


def test_one_group_is_the_flat_balancer_exactly():
    tokens, cost, ref = _step(3, 16, 2, 512)
    flat = assign(tokens, cost, ref, 16, 2, 512, BalanceMethod.KK)
    assert (_grouped(tokens, cost, ref, 16, 2, 512, 1) == flat).all()


@pytest.mark.parametrize(("dp", "rpr"), [(256, 1), (256, 2), (256, 4), (128, 8)])
def test_groups_stay_within_one_percent_of_the_capacity_aware_bound(dp, rpr):
    cap = 1024
    tokens, cost, ref = _step(11, dp, rpr, cap)
    row = _grouped(tokens, cost, ref, dp, rpr, cap, group_count(dp, 32))
    span = rank_costs(cost, row, dp, rpr).max()
    bound = step_bound(tokens, cost, dp, rpr * cap, ALPHA, BETA)
    assert span <= 1.01 * bound
    # and the groups are really apart: no rank of a group holds another group's rows
    assert group_count(dp, 32) > 1


def test_group_count_divides_dp_with_at_most_group_ranks_each():
    for dp, per in [(4096, 64), (64, 64), (1000, 64), (96, 64), (13, 4)]:
        g = group_count(dp, per)
        assert dp % g == 0 and dp // g <= per
        assert all(dp % k or dp // k > per for k in range(1, g))  # the fewest such groups


def test_row_swaps_lower_the_peak_and_move_rows_whole():
    rng = np.random.default_rng(5)
    dp, rpr = 8, 3
    row = rng.permutation(np.repeat(np.arange(dp * rpr), 3))
    cost = rng.lognormal(0, 1, len(row))
    row[np.argmax(cost)] = 0  # rank 0 holds the costliest item
    swapped = swap_rows(row, cost, dp, rpr, 0.0)
    assert rank_costs(cost, swapped, dp, rpr).max() < rank_costs(cost, row, dp, rpr).max()
    # items of one row stay together in one row
    for r in range(dp * rpr):
        assert len(set(swapped[row == r].tolist())) == 1


def test_assigners_give_the_rows_of_the_planner_alone_and_survive_a_dead_one():
    tokens, cost, ref = _step(7, 16, 2, 256)
    alone = _grouped(tokens, cost, ref, 16, 2, 256, 4)
    runtime = InlineRuntime()
    assigners = Assigners(runtime, 3, DEFAULT_OPTIONS)
    assert (_grouped(tokens, cost, ref, 16, 2, 256, 4, assigners.run) == alone).all()
    assert [h.name for h in assigners._handles] == ["assigner-0", "assigner-1", "assigner-2"]
    runtime.kill(assigners._handles[1])  # its groups are balanced by the caller instead
    assert (_grouped(tokens, cost, ref, 16, 2, 256, 4, assigners.run) == alone).all()
    runtime.shutdown()


# ---- the planner ---------------------------------------------------------------------------

STEPS = 6


@pytest.fixture(scope="module")
def plan8(tmp_path_factory):
    from conftest import make_corpus

    return make_corpus(
        tmp_path_factory.mktemp("groups"),
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 40 for i in range(3)}},
            "code": {"files": {"data/code/p0.jsonl": 40}},
        },
        batch={"tokens_per_step": 2048, "max_seq_len": 64},
        world={"dp": 8},
        balance={"method": "kk", "cost": {"alpha": 1.0, "beta": 0.05}},
    )


def _dump(path, group_ranks: int, assigners: int | None = None) -> list[str]:
    base = load_plan(path)
    data = base.model_dump(mode="json")
    data["balance"]["group_ranks"] = group_ranks
    data["placement"]["assigners"] = assigners
    plan = validate_plan(data, base_dir=base.base_dir)
    lines = []
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(STEPS):
            lines += [dump_line(next(c)) for c in clients]
    return lines


def _samples(lines: list[str]) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for line in lines:
        rec = json.loads(line)
        out.setdefault(rec["step"], Counter()).update(s["id"] for s in rec["samples"])
    return out


def _ranks(lines: list[str]) -> list[tuple[int, int, str]]:
    return sorted(
        (json.loads(x)["step"], json.loads(x)["rank"], s["id"])
        for x in lines
        for s in json.loads(x)["samples"]
    )


@pytest.mark.integration
def test_the_group_count_never_changes_which_samples_form_a_step(plan8):
    flat = _dump(plan8, 8)
    grouped = {g: _dump(plan8, g) for g in (4, 2)}
    for lines in grouped.values():
        assert _samples(lines) == _samples(flat)
    # the grouping is real: it decides who gets some sample
    assert any(_ranks(lines) != _ranks(flat) for lines in grouped.values())


@pytest.mark.integration
def test_how_many_assigners_balance_the_groups_never_changes_a_rank(plan8):
    assert _dump(plan8, 2, assigners=3) == _dump(plan8, 2, assigners=0)


@pytest.mark.integration
def test_rank_plans_are_cut_from_the_steps_columns_when_asked(plan8):
    plan = load_plan(plan8)
    with Loader(plan, build_batches=False) as loader:
        planner = loader.planner.obj  # the embedded planner object
        planner.rank_plan(0, 5)
        cols = planner.plans[0]
        # one array per column for the whole step, no per-rank structure built ahead
        assert all(isinstance(v, np.ndarray) for v in cols.values())
        assert len(cols["bounds"]) == plan.world.dp + 1
        mine = planner.rank_plan(0, 3)
        assert np.shares_memory(mine["tokens"], cols["tokens"])  # a slice, cut on request
