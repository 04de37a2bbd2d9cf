"""``overlord.plan.columns`` (and the bounds' sorting): numpy's results, found faster. Pure."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.plan.bounds import capacity_bound, costliest_first
from overlord.plan.columns import rank_sums, stable_order


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    ranks=st.integers(1, 300),
    most=st.sampled_from([3, 8, 20, 130, 300]),
    scale=st.sampled_from([1e-6, 1.0, 1e12]),
)
def test_rank_sums_are_the_slices_sums(seed, ranks, most, scale):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, most + 1, ranks)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    x = rng.lognormal(0, 3, int(bounds[-1])) * scale
    want = [x[lo:hi].sum() for lo, hi in zip(bounds[:-1], bounds[1:])]
    assert rank_sums(x, bounds).tobytes() == np.array(want, dtype=np.float64).tobytes()


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(0, 3000),
    top=st.sampled_from([1, 3, 600, 65535, 65536, 70000, 2**40]),
)
def test_stable_order_is_numpys_stable_argsort(seed, n, top):
    keys = np.random.default_rng(seed).integers(0, top + 1, n)
    assert stable_order(keys).tolist() == np.argsort(keys, kind="stable").tolist()


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 2000),
    top=st.sampled_from([2, 600, 70000]),
    kind=st.sampled_from(["by length", "few values", "not by length"]),
)
def test_costliest_first_is_the_stable_argsort_by_cost(seed, n, top, kind):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, top, n)
    cost = {
        "by length": 1.0 * tokens + 1e-3 * tokens**2,
        "few values": rng.integers(0, 3, n) * 1.0,
        "not by length": tokens + rng.integers(0, 2, n) * 0.5,
    }[kind]
    want = np.argsort(-cost, kind="stable")
    assert costliest_first(tokens, cost).tolist() == want.tolist()
    if kind == "by length":  # (the bound's costs: at least alpha * L + beta * L**2)
        # it sorts integer lengths by radix, float ones by numpy: the same number
        args = (1.0, 1e-3, 7, int(tokens.sum()) // 6 + top)
        exact = capacity_bound(tokens, cost, *args)
        assert exact == capacity_bound(tokens.astype(np.float64), cost, *args)
