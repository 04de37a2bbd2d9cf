"""``overlord.plan.columns``: every rank's sum at once, bit for bit as a slice's sum. Pure."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.plan.columns import rank_sums


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
