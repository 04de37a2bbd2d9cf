"""``overlord.batch.rows``: documents into rows, labels and segment boundaries. Pure."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.batch.rows import IGNORE_INDEX, pack


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


def _reference(tokens, lengths, row_of, rows, seq_len, pad_id):
    """The five outputs written document by document, position by position."""
    ids = np.full((rows, seq_len), pad_id, np.int32)
    labels = np.full((rows, seq_len), IGNORE_INDEX, np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    at, src, segs, cu = [0] * rows, 0, [0] * rows, []
    for n, r in zip(lengths, row_of):
        segs[r] += 1
        for k in range(n):
            ids[r, at[r] + k] = tokens[src + k]
            labels[r, at[r] + k] = tokens[src + k + 1] if k + 1 < n else IGNORE_INDEX
            pos[r, at[r] + k] = k
            seg[r, at[r] + k] = segs[r]
        cu.append((r, at[r], n))
        at[r], src = at[r] + n, src + n
    bounds, flat = [0], 0
    for r in range(rows):
        for n in [n for rr, _, n in cu if rr == r] + ([seq_len - at[r]] if at[r] < seq_len else []):
            flat += n
            bounds.append(flat)
    return ids, labels, pos, seg, np.array(bounds, np.int32)


@settings(max_examples=80, deadline=None)
@given(
    rows_docs=st.lists(st.lists(st.integers(0, 7), max_size=4), min_size=1, max_size=5),
    pad_id=st.integers(0, 3),
)
def test_pack_equals_a_per_position_reference(rows_docs, pad_id):
    # rows written by slices give, output by output and dtype by dtype, what a
    # position-by-position packing gives (empty documents and empty rows included)
    seq_len = max(1, max(sum(r) for r in rows_docs))
    lengths = [n for r in rows_docs for n in r]
    row_of = [i for i, r in enumerate(rows_docs) for _ in r]
    tokens = np.arange(10, 10 + sum(lengths), dtype=np.int32)
    got = pack(tokens, np.array(lengths, np.int64), np.array(row_of, np.int64),
               len(rows_docs), seq_len, pad_id)  # fmt: skip
    want = _reference(tokens, lengths, row_of, len(rows_docs), seq_len, pad_id)
    names = ("input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens")
    for name, w in zip(names, want):
        assert got[name].dtype == np.int32, name
        assert got[name].tolist() == w.tolist(), name


@settings(max_examples=200, deadline=None)
@given(
    rows_docs=st.lists(st.lists(st.integers(0, 9), max_size=5), min_size=1, max_size=6),
    seq_len=st.integers(1, 24),
    pad_id=st.integers(-3, 3),
    masked=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_compiled_loop_packs_what_numpy_packs(rows_docs, seq_len, pad_id, masked, seed):
    """Every array equal, bit for bit, empty documents and chat masks included; and both
    refuse a row that overflows, naming it."""
    pytest.importorskip("numba")
    from overlord.batch import rows as rows_mod

    rng = np.random.default_rng(seed)
    lengths = np.array([n for docs in rows_docs for n in docs], dtype=np.int64)
    row_of = np.array([r for r, docs in enumerate(rows_docs) for _ in docs], dtype=np.int64)
    tokens = rng.integers(0, 50_000, int(lengths.sum())).astype(np.int32)
    mask = rng.integers(0, 2, len(tokens)).astype(np.uint8) if masked else None
    args = (tokens, lengths, row_of, len(rows_docs), seq_len, pad_id, mask)
    overflows = any(sum(docs) > seq_len for docs in rows_docs)
    if overflows:
        for how in (rows_mod._pack_numpy, rows_mod._pack_compiled):
            with pytest.raises(ValueError, match="overflows its"):
                how(*args)
        return
    want, got = rows_mod._pack_numpy(*args), rows_mod._pack_compiled(*args)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and want[k].shape == got[k].shape, k
        assert (want[k] == got[k]).all(), k


def test_a_block_is_written_again_only_once_nothing_holds_it():
    # a step's outputs are views of one block; a later pack of the same shape writes into
    # a block that nothing holds any more, never into one a batch still shows
    tokens = np.arange(1, 13, dtype=np.int32)
    first = pack(tokens, np.array([5, 7]), np.array([0, 1]), 2, 8, 0)
    kept = first["labels"][1:]  # a slice of one output holds the whole block
    seen = kept.copy()
    block = id(kept.base)  # its id: a name for it would hold it too
    del first
    second = pack(tokens[:3] + 50, np.array([3]), np.array([1]), 2, 8, 0)
    assert id(second["input_ids"].base) != block
    assert (kept == seen).all()
    del kept
    third = pack(tokens[:4] + 90, np.array([4]), np.array([0]), 2, 8, 7)
    assert id(third["input_ids"].base) == block  # free again: written again
    want = _reference(tokens[:4] + 90, [4], [0], 2, 8, 7)
    for name, w in zip(("input_ids", "labels", "position_ids", "segment_ids"), want):
        assert third[name].tolist() == w.tolist(), name  # nothing of the first batch left


def test_a_scratch_array_is_never_one_that_something_still_holds():
    # a step's temporaries come from kept blocks that nothing holds any more, whatever
    # their length, never from one a slice still shows
    from overlord.blocks import KeptBlocks

    blocks = KeptBlocks(keep=2)
    first = blocks.flat(100)
    first[:] = 7
    block = id(first.base)  # its id: a name for it would hold it too
    kept = first[10:20]  # a slice holds the whole block
    del first
    second = blocks.flat(90)
    assert id(second.base) != block
    second[:] = 1
    assert (kept == 7).all()
    del kept
    third = blocks.flat(95)  # free again, and long enough (an eighth more than first asked)
    assert id(third.base) == block and len(third) == 95 and third.dtype == np.int32
    del second, third
    big = blocks.flat(10_000)  # longer than any kept: new, kept in place of a free one
    assert len(big) == 10_000 and len(blocks._flat) == 2
    assert sorted(len(b) for b in blocks._flat)[-1] >= 10_000
