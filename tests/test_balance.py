"""``overlord.plan.balance``: items of a step to ranks and rows, by cost. Pure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.reference import rows_balanced_reference
from support.windows import windows

from overlord.plan import balance
from overlord.plan.balance import (
    _improve,
    _rows_balanced,
    assign,
    kk_partition,
    lower_bound,
    pigeonhole_bound,
    rank_costs,
    whole_rows,
)
from overlord.plan.cost import CostModel
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod


def _step(seed, dp, rpr, cap, beta=1e-3):
    rng = np.random.default_rng(seed)
    wins = windows(rng, 3, cap)
    sel = select_step(wins, np.array([0.5, 0.3, 0.2]), MixState.zeros(3), dp * rpr, cap, 64)
    tokens = np.array(sel.tokens)
    cost = CostModel(1.0, beta).cost(tokens)
    return tokens, cost, np.array(sel.ref_row)


def whole_rows_span(cost, ref, dp, rpr):
    """The most loaded rank when whole reference rows go, costliest first, to the least loaded
    rank that has fewer than ``rpr`` rows: what ``assign`` falls back to."""
    row_cost = np.bincount(ref, weights=cost, minlength=dp * rpr)
    loads, count = np.zeros(dp), np.zeros(dp, dtype=int)
    for j in sorted(range(dp * rpr), key=lambda j: (-row_cost[j], j)):
        r = min((r for r in range(dp) if count[r] < rpr), key=lambda r: (loads[r], r))
        loads[r] += row_cost[j]
        count[r] += 1
    return loads.max()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    dp=st.sampled_from([1, 2, 3, 8]),
    rpr=st.integers(1, 4),
    cap=st.sampled_from([256, 4096]),
    method=st.sampled_from(list(BalanceMethod)),
)
def test_assignment_respects_capacity_and_places_every_item_once(seed, dp, rpr, cap, method):
    tokens, cost, ref = _step(seed, dp, rpr, cap)
    row = assign(tokens, cost, ref, dp, rpr, cap, method)
    assert row.shape == tokens.shape
    assert ((row >= 0) & (row < dp * rpr)).all()
    assert (np.bincount(row, weights=tokens, minlength=dp * rpr) <= cap).all()
    again = assign(tokens, cost, ref, dp, rpr, cap, method)
    np.testing.assert_array_equal(row, again)  # a pure function
    if method is BalanceMethod.NONE:
        np.testing.assert_array_equal(row, ref)  # the per-rank baseline keeps the reference rows
    else:
        # balancing item by item never ends worse than moving whole reference rows
        span = rank_costs(cost, row, dp, rpr).max()
        assert span <= whole_rows_span(cost, ref, dp, rpr) * (1 + 1e-12)


def test_balancing_beats_the_per_rank_loader_on_average():
    ratios = {m: [] for m in BalanceMethod}
    for seed in range(30):
        tokens, cost, ref = _step(seed, 8, 2, 4096, beta=2e-4)
        lb = lower_bound(cost, 8)
        for m in BalanceMethod:
            row = assign(tokens, cost, ref, 8, 2, 4096, m)
            ratios[m].append(rank_costs(cost, row, 8, 2).max() / lb)
    none = np.mean(ratios[BalanceMethod.NONE])
    assert np.mean(ratios[BalanceMethod.KK]) < none
    assert np.mean(ratios[BalanceMethod.LPT]) < none


def test_balance_reaches_the_bound_when_items_are_free_to_move():
    # many small items, loose capacity: the bound is tight and both heuristics reach it
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 200, 2000)
    cost = CostModel(1.0, 1e-3).cost(tokens)
    ref = np.arange(len(tokens)) % 64
    for m in (BalanceMethod.KK, BalanceMethod.LPT):
        row = assign(tokens, cost, ref, 16, 4, 10**6, m)
        assert rank_costs(cost, row, 16, 4).max() / lower_bound(cost, 16) < 1.002


def test_kk_partition_small_cases():
    labels = kk_partition(np.array([8.0, 7, 6, 5, 4]), 2)
    sums = np.bincount(labels, weights=[8, 7, 6, 5, 4])
    assert sorted(sums) == [14, 16]  # Karmarkar-Karp's answer on the textbook example
    labels = kk_partition(np.array([5.0]), 3)
    assert labels.tolist() == [0]
    assert kk_partition(np.zeros(0), 4).tolist() == []


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 300),
    k=st.integers(1, 40),
    kind=st.sampled_from(["long tail", "few values", "zeros"]),
)
def test_kk_partition_lists_are_the_arrays_groups(seed, n, k, kind):
    """Small ``k`` runs Karmarkar-Karp over Python lists: the same groups as numpy's merges."""
    rng = np.random.default_rng(seed)
    cost = {
        "long tail": rng.lognormal(0, 2, n),
        "few values": rng.integers(0, 4, n).astype(np.float64),  # ties everywhere
        "zeros": np.zeros(n),
    }[kind]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balance, "KK_PYTHON_K", 0)  # every k by arrays
        want = kk_partition(cost, k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balance, "KK_PYTHON_K", 10**6)  # every k by lists
        got = kk_partition(cost, k)
    assert got.tolist() == want.tolist()


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    dp=st.integers(1, 8),
    rpr=st.integers(1, 20),
    cap=st.integers(2, 200),
    n=st.integers(0, 200),
)
def test_pack_rows_lists_are_the_arrays_rows(seed, dp, rpr, cap, n):
    """A few rows per rank are packed over Python lists: the same rows and overflow."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, cap + 1, n)
    rank_of = rng.integers(0, dp, n)
    order = np.lexsort((np.arange(n), -tokens))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balance, "FEW_ROWS", 0)
        want = balance._pack_rows(order, tokens, rank_of, dp, rpr, cap)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(balance, "FEW_ROWS", 10**6)
        got = balance._pack_rows(order, tokens, rank_of, dp, rpr, cap)
    assert got[0].tolist() == want[0].tolist() and got[1] == want[1]
    assert (got[0] >= 0).sum() + len(got[1]) == n


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7),
    dp=st.integers(1, 3),
    beta=st.sampled_from([0.0, 0.05, 1.0]),
)
def test_pigeonhole_bound_never_exceeds_the_optimum(lengths, dp, beta):
    tokens = np.array(lengths)
    cap = max(40, -(-int(tokens.sum()) // dp) + 10)  # one row per rank, every split feasible
    cost = CostModel(1.0, beta).cost(tokens)
    best = np.inf
    for ranks in itertools.product(range(dp), repeat=len(lengths)):
        ranks = np.array(ranks)
        if (np.bincount(ranks, weights=tokens, minlength=dp) <= cap).all():
            best = min(best, np.bincount(ranks, weights=cost, minlength=dp).max())
    assert pigeonhole_bound(tokens, cost, dp, cap) <= best * (1 + 1e-9)
    # equally long items, room for as many as some rank must hold: the bound is the optimum,
    # ceil(n / dp) items on the fullest rank, which lower_bound does not see once n > dp
    n, most = len(lengths), -(-len(lengths) // dp)
    equal = np.full(n, lengths[0])
    one = float(CostModel(1.0, beta).cost(equal[:1])[0])
    assert pigeonhole_bound(equal, np.full(n, one), dp, most * lengths[0]) == pytest.approx(
        most * one
    )


def test_pigeonhole_bound_sees_that_one_rank_takes_two_of_dp_plus_one_chunks():
    tokens = np.full(5, 16)  # five full-length chunks on four ranks of one 16-token row each
    cost = CostModel(1.0, 0.5).cost(tokens)
    assert lower_bound(cost, 4) == pytest.approx(cost.sum() / 4)
    assert pigeonhole_bound(tokens, cost, 4, 16 * 2) == pytest.approx(2 * cost[0])


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    dp=st.integers(1, 40),
    rpr=st.integers(1, 9),
    kind=st.sampled_from(["uniform", "small integers", "nearly equal", "long tail, zeros"]),
)
def test_whole_rows_in_rounds_are_the_heap_rows(seed, dp, rpr, kind):
    """Plain rounds with numpy, then the heap: the rows the heap alone gives, ties included."""
    rng = np.random.default_rng(seed)
    n = dp * rpr
    cost = {
        "uniform": rng.random(n),
        "small integers": rng.integers(0, 4, n).astype(float),
        "nearly equal": 1 + 0.05 * rng.random(n),
        "long tail, zeros": np.where(rng.random(n) < 0.2, 0.0, rng.lognormal(0, 1, n)),
    }[kind]
    got = _rows_balanced(cost, dp, rpr)
    assert got.tolist() == rows_balanced_reference(cost, dp, rpr).tolist()


def test_the_local_search_stops_at_its_budget():
    """Counted work, not time: no budget changes nothing; more budget never does worse here."""
    tokens, cost, ref = _step(1, 16, 2, 1024)
    start = whole_rows(cost, ref, 16, 2)
    spans = [
        rank_costs(cost, _improve(start, tokens, cost, 16, 2, 1024, budget), 16, 2).max()
        for budget in (0, 200, 10**9)
    ]
    assert spans[0] == rank_costs(cost, start, 16, 2).max()  # nothing examined: unchanged
    assert spans[2] < spans[1] < spans[0]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rpr=st.integers(1, 8),
    cap=st.sampled_from([256, 4096]),
    beta=st.sampled_from([0.0, 1e-3, 1.0]),
    method=st.sampled_from([BalanceMethod.KK, BalanceMethod.LPT]),
)
def test_one_rank_is_packed_only(seed, rpr, cap, beta, method):
    """At dp 1 ``assign`` skips the search: its whole rows already meet the bound it stops at."""
    tokens, cost, ref = _step(seed, 1, rpr, cap, beta)
    fallback = whole_rows(cost, ref, 1, rpr)
    # the search's own stopping rule holds at once: it would have returned the fallback
    bound = pigeonhole_bound(tokens, cost, 1, rpr * cap) * (1 + 1e-9)
    assert rank_costs(cost, fallback, 1, rpr).max() <= bound
    assert assign(tokens, cost, ref, 1, rpr, cap, method).tolist() == fallback.tolist()
    # and the rows are the reference rows, costliest first (ties by row)
    row_cost = np.bincount(ref, weights=cost, minlength=rpr)
    order = sorted(range(rpr), key=lambda j: (-row_cost[j], j))
    assert fallback.tolist() == [order.index(r) for r in ref.tolist()]
