"""``overlord.plan.select``: which items of which source form a step. Pure."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.reference import select_step_reference
from support.roundtrip import Part, check_save_restore
from support.windows import ArrayWindow, windows

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


def test_the_mixture_resumes_from_its_state():
    lengths = [np.random.default_rng(s).integers(1, 300, 500) for s in range(3)]

    def make(state: dict[str, Any] | None) -> dict[str, Any]:
        part = {"mix": MixState.zeros(3), "windows": [ArrayWindow(x) for x in lengths], "step": 0}
        if state is not None:
            part["mix"] = MixState(np.array(state["target"]), np.array(state["placed"]))
            for w, (read, pending) in zip(part["windows"], state["windows"]):
                w.read, w.pending = read, list(pending)
            part["step"] = state["step"]
        return part

    def advance(part: dict[str, Any]) -> list[Any]:
        f = part["step"] / 10
        weights = np.array([0.6 - 0.4 * f, 0.3, 0.1 + 0.4 * f])
        sel = select_step(part["windows"], weights, part["mix"], 4, 512, 8)
        for s, w in enumerate(part["windows"]):
            w.take([i for src, i in zip(sel.source, sel.pending_index) if src == s])
        part["step"] += 1
        return [sel.source, sel.tokens, sel.ref_row]

    def save(part: dict[str, Any]) -> dict[str, Any]:
        mix = part["mix"]
        return {
            "target": mix.target.tolist(),
            "placed": mix.placed.tolist(),
            "windows": [[w.read, w.pending] for w in part["windows"]],
            "step": part["step"],
        }

    check_save_restore(Part(make, advance, save), 10)


def _best_fit_rows(tokens: list[int], rows: int, cap: int) -> list[int]:
    """Best fit the plain way: a sorted list of (free room, row) over every row."""
    free = [(cap, r) for r in range(rows)]
    out = []
    for t in tokens:
        k = next(k for k, (f, _) in enumerate(free) if f >= t)
        f, r = free.pop(k)
        free.append((f - t, r))
        free.sort()
        out.append(r)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    cap=st.sampled_from([1, 7, 64, 512]),
    lookahead=st.integers(0, 16),
)
def test_reference_rows_are_the_best_fit_of_the_chosen_items(seed, rows, cap, lookahead):
    rng = np.random.default_rng(seed)
    wins = windows(rng, 3, cap)
    sel = select_step(wins, rng.dirichlet(np.ones(3)), MixState.zeros(3), rows, cap, lookahead)
    assert sel.ref_row == _best_fit_rows(sel.tokens, rows, cap)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_sources=st.integers(1, 5),
    rows=st.integers(1, 300),
    cap=st.sampled_from([1, 7, 64, 512, 4096]),
    lookahead=st.integers(0, 16),
    empty=st.sampled_from([0.0, 0.1]),
)
def test_selection_is_the_reference_selection(seed, n_sources, rows, cap, lookahead, empty):
    """The inlined loop chooses what the plain one (one call per item) chose, step after step
    (items of no tokens too: the fast way for full-length items then steps aside)."""
    rng = np.random.default_rng(seed)
    lengths = [
        np.clip(rng.lognormal(4 + s, 1.5, 3000).astype(int), 1, cap)
        * (rng.random(3000) >= empty)  # items of no tokens: a tenth of them, or none
        for s in range(n_sources)
    ]
    weights = rng.dirichlet(np.ones(n_sources)) * (rng.random(n_sources) < 0.8)
    runs = [([ArrayWindow(x) for x in lengths], MixState.zeros(n_sources)) for _ in range(2)]
    for _ in range(3):
        (fast_wins, fast_mix), (ref_wins, ref_mix) = runs
        fast = select_step(fast_wins, weights, fast_mix, rows, cap, lookahead)
        ref = select_step_reference(ref_wins, weights, ref_mix, rows, cap, lookahead)
        assert (fast.source, fast.pending_index, fast.tokens, fast.ref_row) == (
            ref.source, ref.pending_index, ref.tokens, ref.ref_row
        )  # fmt: skip
        assert fast_mix.target.tobytes() == ref_mix.target.tobytes()
        assert fast_mix.placed.tobytes() == ref_mix.placed.tobytes()
        for wins in (fast_wins, ref_wins):
            for s, w in enumerate(wins):
                w.take([i for src, i in zip(fast.source, fast.pending_index) if src == s])


def test_a_row_that_took_an_empty_item_comes_before_fresh_rows():
    """An empty first item uses row 0 and leaves it all its room: a full-length one goes there."""
    fast, ref = (
        select([ArrayWindow(np.array([0, 5, 5, 5]))], np.array([1.0]), MixState.zeros(1), 3, 5, 0)
        for select in (select_step, select_step_reference)
    )
    assert fast.ref_row == ref.ref_row == [0, 0, 1, 2]
