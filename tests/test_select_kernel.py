"""``overlord.plan.select_fast``: the compiled selection is ``select_step``, bit for bit.

Skipped without numba (the ``fast`` extra; ``dev`` has it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.plan import select as select_mod
from overlord.plan import select_fast
from overlord.plan.select import MixState, select_items, select_step, select_step_fast

pytest.importorskip("numba")


class GrowingWindow:
    """Pending items of which ``fetched`` are in ``tokens``; ``peek`` fetches ``block`` more at a
    time (every other fetch as a new list, as a window may replace it), logging each call."""

    def __init__(self, lengths: list[int], fetched: int, block: int):
        self.source, self.block = lengths, block
        self.read = min(fetched, len(lengths))
        self.tokens: list[int] = lengths[: self.read]
        self.peeks: list[int] = []
        self.fetches = 0

    def peek(self, i: int) -> int:
        self.peeks.append(i)
        while i >= len(self.tokens):
            got = [self.source[(self.read + k) % len(self.source)] for k in range(self.block)]
            self.read += self.block
            self.fetches += 1
            if self.fetches % 2:
                self.tokens = self.tokens + got
            else:
                self.tokens.extend(got)
        return self.tokens[i]

    def take(self, indices: list[int]) -> None:
        gone = set(indices)
        self.tokens = [x for i, x in enumerate(self.tokens) if i not in gone]


class ArrayWindow(GrowingWindow):
    """A GrowingWindow that also gives its pending tokens as an int64 array, as a cursor does."""

    def token_array(self) -> np.ndarray:
        return np.asarray(self.tokens, dtype=np.int64)


def _lengths(rng: np.random.Generator, n: int, cap: int, specials: float) -> list[int]:
    """Long-tailed lengths, with empty, full-length and too-long items among them."""
    x = np.clip(rng.lognormal(rng.uniform(0, 6), 1.5, n).astype(int), 1, max(cap, 1))
    pick = rng.random(n) < specials
    x[pick] = rng.choice([0, cap, cap + 1, 2 * cap + 3], size=int(pick.sum()))
    return [int(v) for v in x]


def _mix(rng: np.random.Generator, n: int, kind: str) -> MixState:
    if kind == "zeros":
        return MixState.zeros(n)
    if kind == "ties":  # every deficit equal at first: the first source wins ties
        v = np.full(n, float(rng.integers(0, 10**6)))
        return MixState(v.copy(), v.copy())
    return MixState(rng.uniform(0, 1e7, n), rng.uniform(0, 1e7, n))


def _weights(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "equal":
        return np.full(n, 1.0 / n)
    if kind == "odd":  # zero, negative and NaN weights are not live (NaN's deficit never wins)
        return rng.choice([0.0, -0.5, 0.3, 1.0, np.nan, 1e-17], size=n)
    return rng.dirichlet(np.ones(n)) * (rng.random(n) < 0.8)


def _same(a: Any, b: Any) -> None:
    assert (a.source, a.pending_index, a.tokens, a.ref_row) == (
        b.source, b.pending_index, b.tokens, b.ref_row
    )  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_sources=st.integers(1, 5),
    rows=st.integers(0, 60),
    cap=st.sampled_from([0, 1, 7, 64, 512, 4096]),
    lookahead=st.integers(-1, 16),
    fetched=st.sampled_from([0, 1, 5, 300, 5000]),
    block=st.sampled_from([1, 3, 64, 2000]),
    specials=st.sampled_from([0.0, 0.05, 0.3]),
    mix_kind=st.sampled_from(["zeros", "ties", "random"]),
    weight_kind=st.sampled_from(["dirichlet", "equal", "odd"]),
    arrays=st.booleans(),
)
def test_the_kernel_selects_what_select_step_selects_and_peeks_the_same(
    seed, n_sources, rows, cap, lookahead, fetched, block, specials, mix_kind, weight_kind, arrays
):
    """Same Selection, same ``mix`` bits, same peeks (indices and order) over three steps.

    ``arrays``: the kernel's windows give their tokens as arrays (copied whole), not lists.
    """
    rng = np.random.default_rng(seed)
    lengths = [_lengths(rng, 2000, cap, specials) for _ in range(n_sources)]
    weights = _weights(rng, n_sources, weight_kind)
    mix = _mix(rng, n_sources, mix_kind)
    kinds = (ArrayWindow if arrays else GrowingWindow, GrowingWindow)
    runs = [
        (
            [kind(x, fetched, block) for x in lengths],
            MixState(mix.target.copy(), mix.placed.copy()),
        )
        for kind in kinds
    ]
    for _ in range(3):
        (fast_wins, fast_mix), (py_wins, py_mix) = runs
        fast = select_step_fast(fast_wins, weights, fast_mix, rows, cap, lookahead)
        ref = select_step(py_wins, weights, py_mix, rows, cap, lookahead)
        _same(fast, ref)
        assert fast_mix.target.tobytes() == py_mix.target.tobytes()
        assert fast_mix.placed.tobytes() == py_mix.placed.tobytes()
        assert [w.peeks for w in fast_wins] == [w.peeks for w in py_wins]
        for wins in (fast_wins, py_wins):
            for s, w in enumerate(wins):
                w.take([i for src, i in zip(ref.source, ref.pending_index) if src == s])


def test_near_tied_deficits_resolve_as_in_python():
    """Deficits a rounding apart: the float64 expression is the same, so is the winner."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = 3
        base = rng.uniform(0, 1e9)
        target = base + rng.integers(-2, 3, n) * np.spacing(base)
        weights = np.array([0.1, 0.1 + 1e-16, 0.1 - 1e-16]) * rng.uniform(0.5, 2)
        mix_a, mix_b = MixState(target.copy(), np.full(n, base)), MixState(target, np.full(n, base))
        lengths = [_lengths(rng, 300, 512, 0.0) for _ in range(n)]
        wa = [GrowingWindow(x, 300, 1) for x in lengths]
        wb = [GrowingWindow(x, 300, 1) for x in lengths]
        _same(
            select_step_fast(wa, weights, mix_a, 16, 512, 4),
            select_step(wb, weights, mix_b, 16, 512, 4),
        )
        assert mix_a.target.tobytes() == mix_b.target.tobytes()


def test_a_step_of_more_items_than_first_allotted_and_long_windows():
    """Many one-token items (the output arrays grow) from windows of thousands fetched (their
    tokens converted a chunk at a time) and a window fetched one item per peek."""
    lengths = [[1] * 9000, [1, 2] * 4000, [3] * 10]
    wins = [[GrowingWindow(lengths[0], 9000, 1), GrowingWindow(lengths[1], 2500, 7),
             GrowingWindow(lengths[2], 0, 1)] for _ in range(2)]  # fmt: skip
    mixes = [MixState.zeros(3), MixState.zeros(3)]
    weights = np.array([0.5, 0.3, 0.2])
    fast = select_step_fast(wins[0], weights, mixes[0], 2, 4096, 3)
    ref = select_step(wins[1], weights, mixes[1], 2, 4096, 3)
    _same(fast, ref)
    assert len(ref.tokens) > 4 * 2 + 1024  # more than the kernel's first output arrays
    assert [w.peeks for w in wins[0]] == [w.peeks for w in wins[1]] and wins[1][2].peeks


@pytest.mark.parametrize("kind", [GrowingWindow, ArrayWindow])
def test_negative_tokens_are_refused(kind):
    with pytest.raises(ValueError, match="tokens are a count"):
        select_step_fast([kind([3, -1], 2, 1)], np.ones(1), MixState.zeros(1), 1, 8, 0)


def test_select_items_follows_overlord_select(monkeypatch):
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        calls.append(1)
        return select_step_fast(*args)

    monkeypatch.setattr(select_mod, "select_step_fast", counted)

    def run() -> Any:
        return select_items(
            [GrowingWindow([4, 5, 6], 3, 1)], np.ones(1), MixState.zeros(1), 2, 8, 0
        )

    monkeypatch.delenv("OVERLORD_SELECT", raising=False)
    auto = run()
    assert calls == [1]
    monkeypatch.setenv("OVERLORD_SELECT", "python")
    _same(run(), auto)
    assert calls == [1]
    monkeypatch.setenv("OVERLORD_SELECT", "numba")
    run()
    assert calls == [1, 1]
    monkeypatch.setenv("OVERLORD_SELECT", "fast")
    with pytest.raises(ValueError, match="expected 'auto', 'python' or 'numba'"):
        run()
    monkeypatch.setattr(select_fast, "kernel", lambda: None)  # as without numba
    monkeypatch.setenv("OVERLORD_SELECT", "numba")
    with pytest.raises(ImportError, match="overlord-data\\[fast\\]"):
        run()
    monkeypatch.delenv("OVERLORD_SELECT")
    _same(run(), auto)  # the Python loop
    assert calls == [1, 1]


@pytest.mark.integration
def test_a_planners_plans_are_the_same_with_either_selection(job_plan, monkeypatch):
    from overlord import Loader, load_plan
    from overlord.roles.api import PlannerRole

    calls: list[int] = []
    monkeypatch.setattr(
        select_mod, "select_step_fast", lambda *a: calls.append(1) or select_step_fast(*a)
    )
    plan = load_plan(job_plan).with_dp(4)
    got = {}
    for how in ("python", "numba"):
        monkeypatch.setenv("OVERLORD_SELECT", how)
        with Loader(plan, build_batches=False) as loader:
            planner, got[how] = loader.planner, []
            for step in range(6):
                got[how] += [
                    planner.call(PlannerRole.rank_plan, step, r).result() for r in range(4)
                ]
                for r in range(4):
                    planner.call(PlannerRole.mark_consumed, r, step).result()
            got[how].append(planner.call(PlannerRole.state_dict).result())
    assert len(calls) >= 6  # the kernel planned every step of the second run
    py, nb = got["python"], got["numba"]
    assert len(py) == len(nb)
    for a, b in zip(py, nb):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], np.ndarray):
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            else:
                assert a[k] == b[k], k
