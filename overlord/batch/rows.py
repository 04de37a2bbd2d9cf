"""Packing documents into rows: the tensors a trainer consumes, built with numpy.

A rank's batch for one step is ``rows`` rows of ``seq_len`` tokens. Documents
sit back to back in a row; the rest of the row is padding. Next to the tokens:

- ``labels``: the next token of the same document, ``-100`` where there is
  none (a document's last token, padding), so that no loss crosses documents;
- ``position_ids``: restart at 0 for every document;
- ``segment_ids``: 1, 2, ... for the documents of a row, 0 for padding;
- ``cu_seqlens``: boundaries of documents (and of each row's padding, as a
  segment of its own) over the flattened ``rows * seq_len`` tokens, as varlen
  attention kernels take them.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


def pack(
    tokens: np.ndarray,
    lengths: np.ndarray,
    row_of: np.ndarray,
    rows: int,
    seq_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Pack documents (``tokens`` back to back, in row order) into ``rows`` rows.

    ``row_of`` is each document's row, non-decreasing; documents keep their
    order inside a row.

    >>> b = pack(np.array([1, 2, 3, 4, 5]), np.array([2, 3]), np.array([0, 1]), 2, 4, 0)
    >>> b["input_ids"].tolist(), b["labels"].tolist()
    ([[1, 2, 0, 0], [3, 4, 5, 0]], [[2, -100, -100, -100], [4, 5, -100, -100]])
    >>> b["cu_seqlens"].tolist()
    [0, 2, 4, 7, 8]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    row_of = np.asarray(row_of, dtype=np.int64)
    n = len(lengths)
    total = int(lengths.sum())
    src_start = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(lengths[:-1], out=src_start[1:])
    # offset of each document inside its row: tokens of earlier documents of that row
    row_start_doc = np.searchsorted(row_of, np.arange(rows))
    first_src = np.append(src_start, total)[row_start_doc]
    in_row = src_start - first_src[row_of]
    dst_start = row_of * seq_len + in_row
    if n and (in_row + lengths > seq_len).any():
        bad = int(np.flatnonzero(in_row + lengths > seq_len)[0])
        raise ValueError(f"row {row_of[bad]} overflows its {seq_len} tokens (a planner bug)")

    doc_of_tok = np.repeat(np.arange(n), lengths)
    offset_in_doc = np.arange(total, dtype=np.int64) - src_start[doc_of_tok]
    dst = dst_start[doc_of_tok] + offset_in_doc

    size = rows * seq_len
    input_ids = np.full(size, pad_id, dtype=np.int32)
    labels = np.full(size, IGNORE_INDEX, dtype=np.int32)
    position_ids = np.zeros(size, dtype=np.int32)
    segment_ids = np.zeros(size, dtype=np.int32)

    input_ids[dst] = tokens
    nxt = np.empty(total, dtype=np.int32)
    nxt[:-1] = tokens[1:]
    nxt[-1:] = IGNORE_INDEX
    last = src_start + lengths - 1
    nxt[last[lengths > 0]] = IGNORE_INDEX
    labels[dst] = nxt
    position_ids[dst] = offset_in_doc
    doc_in_row = np.arange(n) - row_start_doc[row_of]
    segment_ids[dst] = np.repeat(doc_in_row + 1, lengths)

    used = np.bincount(row_of, weights=lengths, minlength=rows).astype(np.int64)
    pad = seq_len - used
    # segments in flattened order: each row's documents, then its padding if any
    seg_len = np.concatenate((lengths, pad[pad > 0]))
    seg_key = np.concatenate((row_of * 2, np.flatnonzero(pad > 0) * 2 + 1))
    seg_len = seg_len[np.argsort(seg_key, kind="stable")]
    cu = np.zeros(len(seg_len) + 1, dtype=np.int32)
    np.cumsum(seg_len, out=cu[1:])

    shape = (rows, seq_len)
    return {
        "input_ids": input_ids.reshape(shape),
        "labels": labels.reshape(shape),
        "position_ids": position_ids.reshape(shape),
        "segment_ids": segment_ids.reshape(shape),
        "cu_seqlens": cu,
    }
