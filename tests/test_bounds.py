"""The makespan lower bounds of overlord.plan.bounds against brute-force optima."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.plan import balance
from overlord.plan.bounds import capacity_bound, lower_bound, pigeonhole_bound
from overlord.plan.cost import CostModel


def optimum(tokens: np.ndarray, cost: np.ndarray, dp: int, rpr: int, cap: int) -> float | None:
    """The least makespan over every assignment of items to rows of ``cap`` tokens; None if none.

    Enumerates every map of the items onto the ``dp * rpr`` rows (rank = row // rpr)
    and keeps those whose rows all fit in ``cap``.
    """
    rows = dp * rpr
    codes = np.array(list(itertools.product(range(rows), repeat=len(tokens))))
    on_row = codes[:, :, None] == np.arange(rows)  # (assignments, items, rows)
    row_tokens = (on_row * tokens[None, :, None]).sum(axis=1)
    fits = (row_tokens <= cap).all(axis=1)
    if not fits.any():
        return None
    on_rank = codes[fits][:, :, None] // rpr == np.arange(dp)
    rank_cost = (on_rank * cost[None, :, None]).sum(axis=1)
    return float(rank_cost.max(axis=1).min())


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 8), min_size=1, max_size=6),
    dp=st.integers(1, 3),
    rpr=st.integers(1, 2),
    cap=st.integers(1, 8),
    alpha=st.sampled_from([0.5, 1.0, 3.0]),
    beta=st.sampled_from([0.0, 0.1, 1.0, 4.0]),
)
def test_bounds_never_exceed_the_brute_force_optimum(lengths, dp, rpr, cap, alpha, beta):
    tokens = np.minimum(np.array(lengths, dtype=np.int64), cap)  # every item fits a row
    if (dp * rpr) ** len(lengths) > 5000:
        rpr = 1  # keep the enumeration small
    cost = CostModel(alpha, beta).cost(tokens)
    best = optimum(tokens, cost, dp, rpr, cap)
    if best is None:
        return  # no assignment fits, nothing to bound
    lb = lower_bound(cost, dp)
    assert lb <= best * (1 + 1e-9)
    assert pigeonhole_bound(tokens, cost, dp, rpr * cap) <= best * (1 + 1e-9)
    lb_cap = capacity_bound(tokens, cost, alpha, beta, dp, rpr * cap)
    assert lb_cap <= best * (1 + 1e-9)
    assert lb_cap >= lb * (1 - 1e-12)


def test_capacity_bound_sees_the_rank_that_must_still_carry_tokens():
    # two ranks of 4 tokens; a 3 and five 1s, each costing L + L**2: the rank holding the 3
    # must take a 1 as well (the other rank has room for four), so the optimum is 14,
    # lower_bound says 12 (the largest item) and capacity_bound says 13: with a makespan M,
    # that rank holds M - 9 tokens at most (alpha = beta = 1, its squares sum to 9 already),
    # and the other ranks hold 4, so M - 9 + 4 >= 8 tokens gives M >= 13
    tokens = np.array([3, 1, 1, 1, 1, 1])
    cost = CostModel(1.0, 1.0).cost(tokens)
    assert optimum(tokens, cost, 2, 1, 4) == 14.0
    assert lower_bound(cost, 2) == 12.0
    assert capacity_bound(tokens, cost, 1.0, 1.0, 2, 4) == 13.0


def test_capacity_bound_is_attained_on_an_even_split():
    # four items of 2 in two ranks of 4 tokens: the even split costs 12 per rank, the optimum,
    # and every bound reaches it (so none of them can be replaced by 0 unnoticed)
    tokens = np.array([2, 2, 2, 2])
    cost = CostModel(1.0, 1.0).cost(tokens)
    assert optimum(tokens, cost, 2, 1, 4) == 12.0
    assert capacity_bound(tokens, cost, 1.0, 1.0, 2, 4) == 12.0
    assert pigeonhole_bound(tokens, cost, 2, 4) == 12.0


def test_lower_and_pigeonhole_bounds_are_attained():
    # lower_bound: the largest item, alone on its rank
    tokens = np.array([4, 2, 2])
    cost = CostModel(1.0, 1.0).cost(tokens)
    assert lower_bound(cost, 2) == optimum(tokens, cost, 2, 1, 4) == 20.0
    # pigeonhole_bound: three full rows on two ranks put two on one rank
    tokens = np.array([4, 4, 4])
    cost = CostModel(1.0, 0.0).cost(tokens)
    assert pigeonhole_bound(tokens, cost, 2, 8) == optimum(tokens, cost, 2, 2, 4) == 8.0
    assert lower_bound(cost, 2) == 6.0


def test_capacity_bound_falls_back_to_lower_bound_without_a_quadratic_model():
    tokens = np.array([5, 1, 1])
    cost = CostModel(1.0, 0.0).cost(tokens)
    assert capacity_bound(tokens, cost, 1.0, 0.0, 2, 6) == lower_bound(cost, 2) == 5.0
    assert capacity_bound(np.zeros(0, np.int64), np.zeros(0), 1.0, 1.0, 2, 6) == 0.0


def test_capacity_bound_returns_outside_its_preconditions_instead_of_searching_forever():
    tok = np.array([3, 2, 2])
    # items that do not fit the ranks (7 tokens, 2 ranks of 3): no makespan passes the test
    assert capacity_bound(tok, tok + tok**2.0, 1.0, 1.0, 2, 3) == lower_bound(tok + tok**2.0, 2)
    # items that cost nothing: a zero bound that doubling never moves
    assert capacity_bound(tok, np.zeros(3), 1.0, 1.0, 2, 4) == 0.0


def test_balance_still_exports_the_bounds_it_uses():
    assert balance.lower_bound is lower_bound
    assert balance.pigeonhole_bound is pigeonhole_bound
