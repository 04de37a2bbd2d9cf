"""``overlord.plan.select``: which items of which source form a step. Pure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from windows import windows

from overlord.plan.select import MixState, select_step


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 16),
    cap=st.sampled_from([64, 512, 4096]),
    lookahead=st.integers(1, 32),
)
def test_selection_fits_rows_and_keeps_source_order(seed, rows, cap, lookahead):
    rng = np.random.default_rng(seed)
    wins = windows(rng, 3, cap)
    weights = rng.dirichlet(np.ones(3))
    mix = MixState.zeros(3)
    sel = select_step(wins, weights, mix, rows, cap, lookahead)
    used = np.bincount(sel.ref_row, weights=sel.tokens, minlength=rows)
    assert (used <= cap).all()
    assert len(sel.tokens) > 0
    for s in range(3):
        idx = [i for src, i in zip(sel.source, sel.pending_index) if src == s]
        assert idx == sorted(idx)  # a source's items in its order
        skipped = (idx[-1] + 1 - len(idx)) if idx else 0
        assert skipped <= lookahead  # carry-over is bounded
        assert [wins[s].peek(i) for i in idx] == [
            t for src, t in zip(sel.source, sel.tokens) if src == s
        ]
    assert mix.placed.sum() == pytest.approx(sum(sel.tokens))
    assert mix.target.sum() == pytest.approx(sum(sel.tokens))


def test_mixture_error_stays_bounded_along_a_changing_schedule():
    rng = np.random.default_rng(0)
    cap, rows = 2048, 8
    wins = windows(rng, 3, cap)
    mix = MixState.zeros(3)
    worst = 0.0
    for step in range(300):
        f = step / 299
        weights = np.array([0.7 - 0.5 * f, 0.2, 0.1 + 0.5 * f])
        sel = select_step(wins, weights, mix, rows, cap, 64)
        for s in range(3):
            wins[s].take([i for src, i in zip(sel.source, sel.pending_index) if src == s])
        worst = max(worst, float(np.abs(mix.placed - mix.target).max()))
    # the cumulative error never exceeds a few rows' worth, however long the run
    assert worst < 3 * cap
    shares = mix.placed / mix.placed.sum()
    np.testing.assert_allclose(shares, mix.target / mix.target.sum(), atol=0.002)


def test_zero_weight_sources_get_nothing():
    rng = np.random.default_rng(1)
    wins = windows(rng, 3, 512)
    sel = select_step(wins, np.array([0.5, 0.0, 0.5]), MixState.zeros(3), 4, 512, 8)
    assert 1 not in sel.source
