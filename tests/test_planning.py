"""Pure planning functions: schedule, cost, selection, balance, packing. No threads, no files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.plan.balance import assign, kk_partition, lower_bound, rank_costs
from overlord.plan.cost import CostModel
from overlord.plan.packing import IGNORE_INDEX, pack
from overlord.plan.schedule import Schedule
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod, CostSpec, validate_plan
from overlord.sources.tokenizers import BytesTokenizer


class ArrayWindow:
    """A source's pending items: an endless cycle over an array of lengths."""

    def __init__(self, lengths: np.ndarray):
        self.source = [int(x) for x in lengths]
        self.read = 0
        self.pending: list[int] = []

    def peek(self, i: int) -> int:
        while i >= len(self.pending):
            self.pending.append(self.source[self.read % len(self.source)])
            self.read += 1
        return self.pending[i]

    def take(self, indices: list[int]) -> None:
        gone = set(indices)
        self.pending = [x for i, x in enumerate(self.pending) if i not in gone]


def _plan(schedule, interpolation="linear", names=("a", "b", "c")):
    return validate_plan(
        {
            "sources": [{"name": n, "path": f"{n}/*", "format": "jsonl"} for n in names],
            "batch": {"tokens_per_step": 64, "max_seq_len": 16},
            "mixture": {"interpolation": interpolation, "schedule": schedule},
        }
    )


def test_schedule_linear_and_step():
    sched = [{"step": 10, "weights": {"a": 3, "b": 1}}, {"step": 20, "weights": {"c": 1}}]
    lin = Schedule(_plan(sched))
    np.testing.assert_allclose(lin.weights(0), [0.75, 0.25, 0])  # before the first point
    np.testing.assert_allclose(lin.weights(15), [0.375, 0.125, 0.5])
    np.testing.assert_allclose(lin.weights(99), [0, 0, 1])
    stp = Schedule(_plan(sched, "step"))
    np.testing.assert_allclose(stp.weights(19), [0.75, 0.25, 0])
    np.testing.assert_allclose(stp.weights(20), [0, 0, 1])


def test_schedule_defaults_to_equal_shares():
    plan = validate_plan(
        {
            "sources": [{"name": n, "path": "x", "format": "jsonl"} for n in "ab"],
            "batch": {"tokens_per_step": 8, "max_seq_len": 8},
        }
    )
    np.testing.assert_allclose(Schedule(plan).weights(5), [0.5, 0.5])


def test_cost_model_from_model_shape():
    m = CostModel.from_spec(CostSpec(model={"params": 7e9, "layers": 32, "hidden": 4096}))
    assert m.alpha == 6 * 7e9 and m.beta == 6 * 32 * 4096
    np.testing.assert_allclose(m.cost(np.array([1000])), [6 * 7e9 * 1000 + 6 * 32 * 4096 * 1e6])
    shape = {"params": 7e9, "layers": 32, "hidden": 4096, "attention_factor": 2.0}
    slow_attention = CostModel.from_spec(CostSpec(model=shape))
    assert slow_attention.alpha == m.alpha and slow_attention.beta == 2 * m.beta


def _windows(rng, n_sources, cap, n=4000):
    return [
        ArrayWindow(np.clip(rng.lognormal(5 + s, 1.2, n).astype(int), 1, cap))
        for s in range(n_sources)
    ]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 16),
    cap=st.sampled_from([64, 512, 4096]),
    lookahead=st.integers(1, 32),
)
def test_selection_fits_rows_and_keeps_source_order(seed, rows, cap, lookahead):
    rng = np.random.default_rng(seed)
    wins = _windows(rng, 3, cap)
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
    wins = _windows(rng, 3, cap)
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
    wins = _windows(rng, 3, 512)
    sel = select_step(wins, np.array([0.5, 0.0, 0.5]), MixState.zeros(3), 4, 512, 8)
    assert 1 not in sel.source


def _step(seed, dp, rpr, cap, beta=1e-3):
    rng = np.random.default_rng(seed)
    wins = _windows(rng, 3, cap)
    sel = select_step(wins, np.array([0.5, 0.3, 0.2]), MixState.zeros(3), dp * rpr, cap, 64)
    tokens = np.array(sel.tokens)
    cost = CostModel(1.0, beta).cost(tokens)
    return tokens, cost, np.array(sel.ref_row)


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
    span = rank_costs(cost, row, dp, rpr).max()
    assert span >= lower_bound(cost, dp) * (1 - 1e-12)


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


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    seq_len=st.integers(9, 20),
)
def test_pack_layout(lengths, seq_len):
    # first-fit the documents into rows, in order
    rows_of, used = [], [0]
    for n in lengths:
        if used[-1] + n > seq_len:
            used.append(0)
        rows_of.append(len(used) - 1)
        used[-1] += n
    rows = len(used) + 1  # one empty row too
    lengths_a = np.array(lengths)
    tokens = np.arange(1, lengths_a.sum() + 1, dtype=np.int32)
    b = pack(tokens, lengths_a, np.array(rows_of), rows, seq_len, pad_id=0)
    ids, labels, pos, seg = b["input_ids"], b["labels"], b["position_ids"], b["segment_ids"]
    assert ids.shape == labels.shape == pos.shape == (rows, seq_len)
    assert sorted(ids[ids > 0].tolist()) == tokens.tolist()
    flat_ids, flat_lab = ids.reshape(-1), labels.reshape(-1)
    cu = b["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == rows * seq_len and (np.diff(cu) > 0).all()
    for a, z in zip(cu[:-1], cu[1:]):
        segment = flat_ids[a:z]
        if segment[0] == 0:  # padding segment
            assert (segment == 0).all() and (flat_lab[a:z] == IGNORE_INDEX).all()
            continue
        assert (flat_lab[a : z - 1] == segment[1:]).all()  # next token inside the document
        assert flat_lab[z - 1] == IGNORE_INDEX  # never across documents
        assert (pos.reshape(-1)[a:z] == np.arange(z - a)).all()
        assert len(set(seg.reshape(-1)[a:z].tolist())) == 1


def test_bytes_tokenizer_matches_utf8():
    texts = ["", "héllo", "日本", "a\nb"]
    toks, offs = BytesTokenizer().encode(pa.array(texts, pa.large_string()))
    for i, t in enumerate(texts):
        assert toks[offs[i] : offs[i + 1]].tolist() == list(t.encode()) + [256]
    # a sliced Arrow array (offset != 0) is handled too
    toks, offs = BytesTokenizer().encode(pa.array(texts, pa.large_string()).slice(1, 2))
    assert toks.tolist() == list("héllo".encode()) + [256] + list("日本".encode()) + [256]


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=7),
    dp=st.integers(1, 3),
    beta=st.sampled_from([0.0, 0.05, 1.0]),
)
def test_pigeonhole_bound_never_exceeds_the_optimum(lengths, dp, beta):
    import itertools

    from overlord.plan.balance import pigeonhole_bound

    tokens = np.array(lengths)
    cap = max(40, -(-int(tokens.sum()) // dp) + 10)  # one row per rank, every split feasible
    cost = CostModel(1.0, beta).cost(tokens)
    best = np.inf
    for ranks in itertools.product(range(dp), repeat=len(lengths)):
        ranks = np.array(ranks)
        if (np.bincount(ranks, weights=tokens, minlength=dp) <= cap).all():
            best = min(best, np.bincount(ranks, weights=cost, minlength=dp).max())
    assert pigeonhole_bound(tokens, cost, dp, cap) <= best * (1 + 1e-9)
    assert pigeonhole_bound(tokens, cost, dp, cap) >= lower_bound(cost, dp) * (1 - 1e-12)
