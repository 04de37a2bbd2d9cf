"""Context-parallel slicing: each CP rank's part of its DP rank's packed batch.

A DP rank's batch is ``rows`` rows of ``S = max_seq_len`` tokens (see
:mod:`overlord.batch.rows`); its segments, over the flattened rows, are its
documents and each row's padding tail. Every CP rank ``i`` of ``cp`` gets,
from every row, tokens in this order (both layouts give chunks ``i`` and
``2cp - 1 - i`` of what they cut, the load-balanced causal split of Megatron
and Transformer Engine):

- ``zigzag``: the row is cut into ``2 * cp`` chunks of ``S / (2 * cp)``
  tokens (``S`` a multiple of ``2 * cp``, checked by the plan); rank ``i``
  gets chunk ``i`` then chunk ``2cp - 1 - i``. Nothing is added.
- ``per_document``: every document of ``L`` tokens is extended by
  ``(-L) mod 2cp`` padding tokens to ``L' = 2cp * ceil(L / 2cp)``. The row's
  length becomes ``R = 2cp * ceil(max_r(D_r + P_r) / 2cp)``, the same for every
  row of the DP rank's step, where ``D_r`` is the sum of row ``r``'s ``L'`` and
  ``P_r`` its padding tail in the unsliced batch. Row ``r``'s padding tail
  becomes ``R - D_r`` tokens: its ``P_r`` tokens, then padding added for CP
  (no tail when that is 0). Every segment (document with its padding, or the
  tail) is cut into ``2 * cp`` equal chunks and rank ``i`` gets chunks ``i``
  and ``2cp - 1 - i`` of each, segments in row order: ``R / cp`` tokens per row.

Padding added for CP has ``input_ids`` = the pad id, ``labels`` = -100,
``position_ids`` = 0, ``segment_ids`` = 0 and ``global_positions`` = -1.
Every other token keeps the values it has in the unsliced batch, and its
``global_positions`` entry is its index in the flattened ``(rows, S)``
unsliced batch: scattering every CP rank's tokens there gives that batch back
exactly, each position once. ``cu_seqlens`` describes the rank's local tokens:
a new segment starts wherever the unsliced segment changes, and a document's
added padding is a segment of its own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from overlord.batch import Batch
from overlord.batch.rows import IGNORE_INDEX
from overlord.world import CPLayout

# what an added padding token holds in each field
PAD_VALUES = {"labels": IGNORE_INDEX, "position_ids": 0, "segment_ids": 0}


def zigzag_index(rows: int, seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Global positions (rows, seq_len / cp) of CP rank ``rank``'s tokens.

    >>> zigzag_index(1, 8, 2, 0).tolist()
    [[0, 1, 6, 7]]
    >>> zigzag_index(1, 8, 2, 1).tolist()
    [[2, 3, 4, 5]]
    """
    c = seq_len // (2 * cp)
    cols = np.concatenate(
        (
            np.arange(rank * c, (rank + 1) * c),
            np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c),
        )
    )
    return np.arange(rows, dtype=np.int64)[:, None] * seq_len + cols[None, :]


def per_document_index(
    cu_seqlens: np.ndarray, is_tail: np.ndarray, rows: int, seq_len: int, cp: int, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """Global positions (rows, R/cp; -1 for added padding) and local segment keys, same shape.

    ``is_tail[k]`` says whether segment ``k`` of ``cu_seqlens`` is a row's padding tail.

    >>> cu = np.array([0, 3, 8]); tail = np.array([False, True])   # a doc of 3, a tail of 5
    >>> per_document_index(cu, tail, 1, 8, 2, 0)[0].tolist()  # R = 4 * ceil((4 + 5) / 4) = 12
    [[0, -1, 3, 4, -1, -1]]
    >>> per_document_index(cu, tail, 1, 8, 2, 1)[0].tolist()  # the doc in 4 chunks, the tail too
    [[1, 2, 5, 6, 7, -1]]
    """
    k = 2 * cp
    start = np.asarray(cu_seqlens[:-1], dtype=np.int64)
    length = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    row = start // seq_len
    is_tail = np.asarray(is_tail, dtype=bool)
    doc = ~is_tail
    padded = np.where(doc, -(-length // k) * k, 0)
    docs_len = np.bincount(row, weights=padded, minlength=rows).astype(np.int64)
    tail_len = np.bincount(row, weights=np.where(is_tail, length, 0), minlength=rows)
    tail_len = tail_len.astype(np.int64)
    width = int(-(-int((docs_len + tail_len).max(initial=0)) // k) * k)
    # the segments as CP sees them: documents (padded), then one tail per row
    n_doc = int(doc.sum())
    seg_start = np.concatenate((start[doc], np.arange(rows) * seq_len + seq_len - tail_len))
    seg_real = np.concatenate((length[doc], tail_len))
    seg_len = np.concatenate((padded[doc], width - docs_len))
    seg_row = np.concatenate((row[doc], np.arange(rows)))
    seg_tail = np.concatenate((np.zeros(n_doc, dtype=bool), np.ones(rows, dtype=bool)))
    order = np.lexsort((seg_tail, seg_row))  # by row, documents (in order) before the tail
    seg_start, seg_real, seg_len, seg_tail = (
        a[order] for a in (seg_start, seg_real, seg_len, seg_tail)
    )
    keep = seg_len > 0
    seg_start, seg_real, seg_len, seg_tail = (
        a[keep] for a in (seg_start, seg_real, seg_len, seg_tail)
    )
    c = seg_len // k
    local = 2 * c
    first = np.zeros(len(local), dtype=np.int64)
    if len(local):
        np.cumsum(local[:-1], out=first[1:])
    seg = np.repeat(np.arange(len(local)), local)
    j = np.arange(int(local.sum()), dtype=np.int64) - first[seg]
    cs = c[seg]
    offset = np.where(j < cs, rank * cs + j, (k - 1 - rank) * cs + (j - cs))
    real = offset < seg_real[seg]
    gpos = np.where(real, seg_start[seg] + offset, -1)
    # a document's own tokens, its added padding, a tail: three kinds of local segment
    keys = 2 * seg + (~real & ~seg_tail[seg])
    w = width // cp
    return gpos.reshape(rows, w), keys.reshape(rows, w)


def local_cu_seqlens(keys: np.ndarray) -> np.ndarray:
    """Boundaries (int32) where the segment key changes over the flattened local rows.

    >>> local_cu_seqlens(np.array([[4, 4, 5], [6, 6, 6]])).tolist()
    [0, 2, 3, 6]
    """
    flat = keys.reshape(-1)
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    return np.concatenate(([0], change, [len(flat)])).astype(np.int32)


def cp_slices(batch: Batch, cp: int, layout: CPLayout, pad_id: int) -> list[Batch]:
    """The batch of every CP rank of ``batch``'s DP rank (``[batch]`` when ``cp == 1``)."""
    if cp <= 1:
        return [batch]
    assert batch.input_ids is not None and batch.labels is not None  # a whole DP batch
    rows, seq_len = batch.position_ids.shape
    cu = np.asarray(batch.cu_seqlens, dtype=np.int64)
    flat = {k: v.reshape(-1) for k, v in batch.arrays().items() if k != "cu_seqlens"}
    seg_of = np.repeat(np.arange(len(cu) - 1), np.diff(cu))  # unsliced segment of each token
    is_tail = flat["segment_ids"][cu[:-1]] == 0
    out = []
    for rank in range(cp):
        if layout is CPLayout.ZIGZAG:
            gpos = zigzag_index(rows, seq_len, cp, rank)
            keys = seg_of[gpos]
        else:
            gpos, keys = per_document_index(cu, is_tail, rows, seq_len, cp, rank)
        out.append(local_batch(batch, flat, gpos, keys, pad_id, layout.value, rank, cp))
    return out


def local_batch(
    batch: Batch,
    flat: dict[str, np.ndarray],
    gpos: np.ndarray,
    keys: np.ndarray,
    pad_id: int,
    layout: str,
    rank: int,
    size: int,
    cp_groups: np.ndarray | None = None,
) -> Batch:
    """CP rank ``rank``'s batch: every field of ``flat`` taken at ``gpos`` (its shape).

    ``flat`` holds the DP rank's arrays flattened; a position of ``-1`` is
    padding added for CP (:data:`PAD_VALUES`, ``pad_id`` for the ids), and
    ``keys`` mark the local segments ``cu_seqlens`` splits.
    """
    added = gpos < 0
    at = np.where(added, 0, gpos)
    f: dict[str, np.ndarray] = {}
    for name, values in flat.items():
        local = values[at]
        local[added] = PAD_VALUES.get(name, pad_id)
        f[name] = local
    return replace(
        batch,
        input_ids=f["input_ids"],
        labels=f["labels"],
        position_ids=f["position_ids"],
        segment_ids=f["segment_ids"],
        cu_seqlens=local_cu_seqlens(keys),
        global_positions=gpos.astype(np.int32),
        cp_layout=layout,
        cp_rank=rank,
        cp_size=size,
        cp_groups=cp_groups,
    )
