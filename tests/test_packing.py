"""``overlord.batch.rows``: documents into rows, labels and segment boundaries. Pure."""

from __future__ import annotations

import numpy as np
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
