"""CP slicing: each CP rank's slice of a DP batch, for both layouts, reassembles it exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.batch import Batch
from overlord.batch.cp import cp_slices
from overlord.batch.rows import IGNORE_INDEX, pack
from overlord.world import CPLayout

PAD = 257


def dp_batch(lengths: list[int], rows_of: list[int], rows: int, seq_len: int) -> Batch:
    tokens = np.arange(1, sum(lengths) + 1) % 250 + 1
    a = pack(tokens, np.array(lengths), np.array(rows_of), rows, seq_len, PAD)
    return Batch(0, 0, samples=[], cost=0.0, **a)


@st.composite
def packed(draw: st.DrawFn) -> tuple[Batch, int]:
    cp = draw(st.sampled_from([2, 3, 4]))
    return packed_rows(draw, 2 * cp * draw(st.integers(1, 6))), cp


def packed_rows(draw: st.DrawFn, seq_len: int) -> Batch:
    """A DP rank's batch of 1-3 rows of ``seq_len``, each holding random documents."""
    rows = draw(st.integers(1, 3))
    lengths, rows_of = [], []
    for r in range(rows):
        free = seq_len
        while free and draw(st.booleans()):
            n = draw(st.integers(1, free))
            lengths.append(n)
            rows_of.append(r)
            free -= n
    return dp_batch(lengths, rows_of, rows, seq_len)


def reassemble(batch: Batch, slices: list[Batch]) -> dict[str, np.ndarray]:
    """Scatter every CP rank's tokens to their global positions; check each lands once."""
    size = batch.position_ids.size
    hits = np.zeros(size, dtype=np.int64)
    out = {k: np.zeros(size, dtype=np.int32) for k in ("input_ids", "labels", "position_ids",
                                                          "segment_ids")}  # fmt: skip
    for s in slices:
        g = s.global_positions.reshape(-1)
        real = g >= 0
        np.add.at(hits, g[real], 1)
        for k in out:
            out[k][g[real]] = getattr(s, k).reshape(-1)[real]
    assert (hits == 1).all()
    return {k: v.reshape(batch.position_ids.shape) for k, v in out.items()}


@settings(max_examples=60, deadline=None)
@given(packed(), st.sampled_from(list(CPLayout)))
def test_slices_reassemble_the_unsliced_batch_exactly(case, layout):
    batch, cp = case
    slices = cp_slices(batch, cp, layout, PAD)
    assert [s.cp_rank for s in slices] == list(range(cp))
    assert len({s.input_ids.shape for s in slices}) == 1  # the same shape on every CP rank
    for k, v in reassemble(batch, slices).items():
        assert np.array_equal(v, getattr(batch, k)), k
    for s in slices:
        assert s.global_positions.dtype == np.int32 and s.cp_layout == layout.value
        added = s.global_positions < 0
        assert (s.labels[added] == IGNORE_INDEX).all() and (s.input_ids[added] == PAD).all()
        assert (s.segment_ids[added] == 0).all()
        cu = s.cu_seqlens
        assert cu[0] == 0 and cu[-1] == s.input_ids.size and (np.diff(cu) > 0).all()


@settings(max_examples=40, deadline=None)
@given(packed())
def test_zigzag_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i(case):
    batch, cp = case
    rows, seq_len = batch.position_ids.shape
    c = seq_len // (2 * cp)
    for i, s in enumerate(cp_slices(batch, cp, CPLayout.ZIGZAG, PAD)):
        assert s.input_ids.shape == (rows, 2 * c)
        want = np.concatenate((np.arange(i * c, (i + 1) * c),
                               np.arange((2 * cp - 1 - i) * c, (2 * cp - i) * c)))  # fmt: skip
        assert np.array_equal(s.global_positions % seq_len, np.tile(want, (rows, 1)))
        assert np.array_equal(s.input_ids, batch.input_ids[:, want])


def test_per_document_pads_each_document_and_gives_chunks_i_and_2cp_minus_1_minus_i():
    # row 0: documents of 3 and 4 tokens, a tail of 1; row 1: documents of 1 and 2, a tail of 5
    batch = dp_batch([3, 4, 1, 2], [0, 0, 1, 1], 2, 8)
    s0, s1 = cp_slices(batch, 2, CPLayout.PER_DOCUMENT, PAD)
    # per row: documents padded to 4, 4 | 4, 4; R = 4 * ceil(max(8 + 1, 8 + 5) / 4) = 16
    # tails: 16 - 8 = 8 tokens each, the unsliced padding first; every segment in 4 chunks
    assert s0.global_positions.tolist() == [[0, -1, 3, 6, 7, -1, -1, -1],
                                            [8, -1, 9, -1, 11, 12, -1, -1]]  # fmt: skip
    assert s1.global_positions.tolist() == [[1, 2, 4, 5, -1, -1, -1, -1],
                                            [-1, -1, 10, -1, 13, 14, 15, -1]]  # fmt: skip
    # positions within the unsliced document (what RoPE needs); added padding at 0
    assert s0.position_ids.tolist()[0] == [0, 0, 0, 3, 0, 0, 0, 0]
    assert s1.position_ids.tolist()[0] == [1, 2, 1, 2, 0, 0, 0, 0]
    # local documents; a document's added padding is a segment of its own
    assert s0.cu_seqlens.tolist() == [0, 1, 2, 4, 8, 9, 10, 11, 12, 16]
    assert s1.cu_seqlens.tolist() == [0, 2, 4, 8, 10, 11, 12, 16]


def test_no_cp_is_the_batch_itself():
    batch = dp_batch([3, 4], [0, 0], 1, 8)
    assert cp_slices(batch, 1, CPLayout.ZIGZAG, PAD) == [batch]


@pytest.mark.parametrize("layout", list(CPLayout))
def test_a_row_without_documents_is_sliced_too(layout):
    batch = dp_batch([], [], 2, 8)
    slices = cp_slices(batch, 2, layout, PAD)
    assert all(s.input_ids.shape == (2, 4) for s in slices)
    reassemble(batch, slices)
