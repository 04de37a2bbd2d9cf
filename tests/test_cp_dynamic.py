"""Dynamic CP (``cp: dynamic``): degrees, placement, and slices that reassemble the DP batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cp_slice import PAD, dp_batch, packed_rows, reassemble

from overlord.batch import Batch
from overlord.batch.cp_dynamic import dynamic_slices
from overlord.batch.rows import IGNORE_INDEX
from overlord.plan.cost import CostModel
from overlord.plan.cp import cp_degrees, dynamic_lengths, place_documents

MODEL = CostModel(alpha=1.0, beta=0.01)


@st.composite
def packed(draw: st.DrawFn) -> tuple[Batch, int, int]:
    cp_max = draw(st.sampled_from([2, 4, 8]))
    seq_len = draw(st.integers(1, 40))
    per_rank = draw(st.integers(1, 12))
    return packed_rows(draw, seq_len), cp_max, per_rank


def documents(batch: Batch) -> list[tuple[int, int]]:
    """(start, length) of every document of an unsliced batch, over the flattened rows."""
    cu = batch.cu_seqlens
    seg = batch.segment_ids.reshape(-1)
    return [(int(a), int(b - a)) for a, b in zip(cu[:-1], cu[1:], strict=True) if seg[a] != 0]


def check(batch: Batch, cp_max: int, per_rank: int) -> list[Batch]:
    """Every rule of the contract that a test can see, on one DP batch."""
    slices = dynamic_slices(batch, cp_max, per_rank, MODEL, PAD)
    assert [s.cp_rank for s in slices] == list(range(cp_max))
    assert len({s.input_ids.shape for s in slices}) == 1 and slices[0].input_ids.shape[0] == 1
    for k, v in reassemble(batch, slices).items():  # each position exactly once
        assert np.array_equal(v, getattr(batch, k)), k
    holders: dict[int, list[tuple[int, int, int]]] = {}  # doc start -> (rank, first, degree)
    for s in slices:
        assert s.cp_layout == "dynamic" and s.cp_size == cp_max
        g = s.global_positions.reshape(-1)
        assert s.global_positions.dtype == np.int32
        added = g < 0
        assert (s.labels.reshape(-1)[added] == IGNORE_INDEX).all()
        assert (s.input_ids.reshape(-1)[added] == PAD).all()
        assert (s.segment_ids.reshape(-1)[added] == 0).all()
        assert (s.position_ids.reshape(-1)[added] == 0).all()
        cu = s.cu_seqlens
        assert cu[0] == 0 and cu[-1] == g.size and (np.diff(cu) > 0).all()
        assert s.cp_groups.dtype == np.int32 and s.cp_groups.shape == (len(cu) - 1, 2)
        for k, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
            first, degree = s.cp_groups[k].tolist()
            assert first % degree == 0 and first <= s.cp_rank < first + degree  # aligned, mine
            real = g[a:b][g[a:b] >= 0]
            for start, length in documents(batch):
                if len(real) and start <= real[0] < start + length:
                    assert ((real >= start) & (real < start + length)).all()  # one document
                    holders.setdefault(start, []).append((s.cp_rank, first, degree))
    for start, length in documents(batch):
        want = int(cp_degrees(np.array([length]), cp_max, per_rank)[0])
        ranks = sorted({r for r, _, _ in holders[start]})
        groups = {(f, d) for _, f, d in holders[start]}
        assert len(groups) == 1, groups  # every member lists the same sub-group
        first, degree = groups.pop()
        assert degree == want and set(ranks) <= set(range(first, first + degree))
        # every rank of the sub-group takes part (one may hold only the document's padding)
        for r in range(first, first + degree):
            assert [first, degree] in slices[r].cp_groups.tolist()
    return slices


@settings(max_examples=80, deadline=None)
@given(packed())
def test_dynamic_slices_reassemble_the_unsliced_batch_exactly(case):
    check(*case)


def test_degree_is_the_smallest_power_of_two_that_fits_or_cp_max():
    lengths = np.arange(1, 200)
    for cp_max in (2, 4, 8):
        for per_rank in (1, 7, 16):
            got = cp_degrees(lengths, cp_max, per_rank)
            for n, d in zip(lengths.tolist(), got.tolist(), strict=True):
                fits = [x for x in (1, 2, 4, 8) if x <= cp_max and -(-n // x) <= per_rank]
                assert d == (fits[0] if fits else cp_max), (n, cp_max, per_rank)


def test_a_document_of_degree_d_is_cut_in_2d_chunks_i_and_2d_minus_1_minus_i():
    # one row of 16: a document of 3 (degree 1 with T = 4), one of 9 (degree 4), a tail of 4
    batch = dp_batch([3, 9], [0, 0], 1, 16)
    slices = check(batch, 4, 4)
    # L' = 16: chunks of 2; rank j holds chunks j and 7 - j of positions 3..18 (12.. is padding)
    long_doc = [[3, 4, -1, -1], [5, 6, -1, -1], [7, 8, -1, -1], [9, 10, 11, -1]]
    for j, s in enumerate(slices):
        g = s.global_positions.reshape(-1).tolist()
        assert g[:4] == long_doc[j] or g[3:7] == long_doc[j], (j, g)
    # the short one stays whole, on one rank, before that rank's part of the long one
    assert slices[0].global_positions.reshape(-1).tolist()[:3] == [0, 1, 2]
    assert slices[0].cp_groups.tolist()[:3] == [[0, 1], [0, 4], [0, 4]]
    assert slices[0].position_ids.reshape(-1).tolist()[:5] == [0, 1, 2, 0, 1]


def test_placement_keeps_the_most_loaded_rank_low():
    # degree-2 documents fill halves; short ones go where the load is lowest
    cost = np.array([10.0, 10.0, 4.0, 3.0, 3.0, 1.0])
    deg = np.array([2, 2, 1, 1, 1, 1])
    first = place_documents(cost, deg, 4)
    load = np.zeros(4)
    for f, d, c in zip(first, deg, cost, strict=True):
        load[f : f + d] += c
    assert first[:2].tolist() == [0, 2] and load.max() == 14.0
    assert place_documents(cost, deg, 4).tolist() == first.tolist()  # deterministic


def test_padding_rule_is_per_document_with_2d():
    assert dynamic_lengths(np.array([5, 5, 5, 16, 17]), np.array([1, 2, 4, 4, 8])).tolist() == [
        5, 8, 8, 16, 32
    ]  # fmt: skip


def test_a_batch_of_padding_only_is_sliced_too():
    batch = dp_batch([], [], 2, 8)
    for s in check(batch, 4, 4):
        assert s.input_ids.shape == (1, 4) and s.cp_groups.tolist() == [[s.cp_rank, 1]]


@pytest.mark.parametrize("per_rank", [1, 1000])
def test_every_document_on_all_ranks_or_each_whole(per_rank):
    batch = dp_batch([5, 7, 6, 9], [0, 0, 1, 1], 2, 16)
    for s in check(batch, 4, per_rank):
        for first, degree in s.cp_groups.tolist():
            if per_rank == 1:  # every document longer than cp_max * T: degree cp_max
                assert (first, degree) in ((0, 4), (s.cp_rank, 1))
            else:
                assert (first, degree) == (s.cp_rank, 1)
