"""Dynamic CP (``world.cp: dynamic``, ByteScale's HDP): each document on its own CP sub-group.

A DP rank has ``C = cp_max`` CP ranks. Its batch is ``rows`` rows of ``S =
max_seq_len`` tokens, whose segments (over the flattened rows) are its
documents and each row's padding tail. The contract:

1. **Degree.** A document of ``L`` tokens has degree ``d``, the smallest power
   of two ``d <= C`` with ``ceil(L / d) <= T`` (``T = tokens_per_cp_rank``),
   and ``d = C`` where none is (:func:`overlord.plan.cp.cp_degrees`).
2. **Placement.** A document of degree ``d`` is held by the aligned
   sub-group of ranks ``[k*d, (k+1)*d)`` that
   :func:`overlord.plan.cp.place_documents` gives it, from the documents'
   degrees and their cost to each of their ranks, ``cost(L') / d`` under the
   plan's cost model: a pure function of the DP rank's planned rows.
3. **Cut.** A document of degree 1 stays whole on its rank. One of degree
   ``d > 1`` is padded to ``L' = 2d * ceil(L / 2d)`` and cut into ``2d``
   chunks of ``L' / 2d`` tokens; the rank ``j``-th in its sub-group gets
   chunks ``j`` and ``2d - 1 - j`` (the load-balanced causal split).
4. **Local order.** Each CP rank's batch is one row: its documents in the
   order of the unsliced batch, then padding tail tokens, then padding added
   for CP. Let ``n_i`` be rank ``i``'s document tokens (added padding of its
   documents included). The width is ``W = max(max_i n_i, ceil((sum_i n_i +
   P) / C))`` where ``P`` is the padding tail tokens of all rows; the tails,
   in row order, fill ranks 0, 1, ... up to ``W`` each, and whatever is left
   of a rank's ``W`` is padding added for CP. Every CP rank of the DP rank
   has the same shape ``(1, W)``.

Padding added for CP has ``input_ids`` = the pad id, ``labels`` = -100,
``position_ids`` = 0, ``segment_ids`` = 0 and ``global_positions`` = -1.
Every other token keeps its values in the unsliced batch (``position_ids``:
its position within its unsliced document), and ``global_positions`` gives
its index in the flattened ``(rows, S)`` unsliced batch: scattering every CP
rank's tokens there gives that batch back exactly, each position once.
``cu_seqlens`` splits the local row into segments: a document's tokens (both
chunks), its added padding, each row's tail piece, the trailing added
padding. ``cp_groups`` (int32, ``(len(cu_seqlens) - 1, 2)``) gives each such
segment ``(first CP rank, degree)`` of its sub-group: a document's (and its
added padding's) ``(k*d, d)``, the same on each of its ``d`` ranks; ``(i,
1)`` for tail pieces and trailing padding on rank ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overlord.batch import Batch
from overlord.batch.cp import local_batch, local_cu_seqlens
from overlord.plan.cost import CostModel
from overlord.plan.cp import cp_degrees, dynamic_lengths, place_documents
from overlord.world import DYNAMIC


@dataclass(frozen=True)
class Placement:
    """The documents of one DP rank's batch and the CP sub-group of each."""

    start: np.ndarray  # flattened position of each document's first token
    length: np.ndarray  # L
    padded: np.ndarray  # L'
    degree: np.ndarray  # d
    first: np.ndarray  # the sub-group's first CP rank


def placement(
    cu_seqlens: np.ndarray, is_tail: np.ndarray, cp_max: int, per_rank: int, model: CostModel
) -> Placement:
    """Degree, padded length and sub-group of every document (segments that are not tails).

    >>> cu, tail = np.array([0, 3, 8, 16]), np.array([False, False, True])
    >>> p = placement(cu, tail, 2, 4, CostModel(1.0, 0.0))
    >>> p.degree.tolist(), p.padded.tolist(), p.first.tolist()
    ([1, 2], [3, 8], [0, 0])
    """
    start = np.asarray(cu_seqlens[:-1], dtype=np.int64)
    length = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    doc = ~np.asarray(is_tail, dtype=bool)
    start, length = start[doc], length[doc]
    degree = cp_degrees(length, cp_max, per_rank)
    padded = dynamic_lengths(length, degree)
    first = place_documents(model.cost(padded) / degree, degree, cp_max)
    return Placement(start, length, padded, degree, first)


def _rank_documents(p: Placement, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank ``rank``'s document tokens in order: global positions (-1: added), keys, document."""
    mine = np.flatnonzero((p.first <= rank) & (rank < p.first + p.degree))
    d, padded = p.degree[mine], p.padded[mine]
    local = padded // d
    offsets = np.zeros(len(mine), dtype=np.int64)
    if len(mine):
        np.cumsum(local[:-1], out=offsets[1:])
    doc = np.repeat(np.arange(len(mine)), local)
    at = np.arange(int(local.sum()), dtype=np.int64) - offsets[doc]
    j = rank - p.first[mine][doc]  # the rank's index within its sub-group
    dd = d[doc]
    c = padded[doc] // (2 * dd)  # chunk length (unused for degree 1)
    offset = np.where(dd == 1, at, np.where(at < c, j * c + at, (2 * dd - 1 - j) * c + (at - c)))
    real = offset < p.length[mine][doc]
    gpos = np.where(real, p.start[mine][doc] + offset, -1)
    which = mine[doc]
    return gpos, 2 * which + ~real, which


def dynamic_index(
    cu_seqlens: np.ndarray, is_tail: np.ndarray, p: Placement, cp_max: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per CP rank: global positions (W,; -1 added), segment keys (W,), ``cp_groups`` per key run.

    >>> cu, tail = np.array([0, 3, 8, 16]), np.array([False, False, True])
    >>> p = placement(cu, tail, 2, 4, CostModel(1.0, 0.0))
    >>> [g.tolist() for g, _, _ in dynamic_index(cu, tail, p, 2)]  # W = max(7, ceil(19 / 2))
    [[0, 1, 2, 3, 4, -1, -1, 8, 9, 10], [5, 6, 7, -1, 11, 12, 13, 14, 15, -1]]
    """
    start = np.asarray(cu_seqlens[:-1], dtype=np.int64)
    length = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    tails = np.flatnonzero(np.asarray(is_tail, dtype=bool) & (length > 0))
    tail_len = length[tails].astype(np.int64)
    tail_seg = np.repeat(tails, tail_len)  # which unsliced segment (row tail) each token is in
    tail_first = np.zeros(len(tails), dtype=np.int64)
    if len(tails):
        np.cumsum(tail_len[:-1], out=tail_first[1:])
    tail_pos = (
        start[tail_seg] + np.arange(len(tail_seg), dtype=np.int64) - np.repeat(tail_first, tail_len)
    )
    docs = [_rank_documents(p, r) for r in range(cp_max)]
    n = np.array([len(g) for g, _, _ in docs], dtype=np.int64)
    width = int(max(n.max(initial=0), -(-(int(n.sum()) + len(tail_pos)) // cp_max), 1))
    room = np.cumsum(np.concatenate(([0], width - n)))  # rank r's tail tokens: [room[r], room[r+1])
    n_docs = len(p.start)
    out = []
    for r, (gpos, keys, which) in enumerate(docs):
        lo, hi = min(room[r], len(tail_pos)), min(room[r + 1], len(tail_pos))
        extra = width - len(gpos) - (hi - lo)
        gpos = np.concatenate((gpos, tail_pos[lo:hi], np.full(extra, -1, dtype=np.int64)))
        # keys: 2*doc (+1 for its added padding), then 2*n_docs + 2*segment for tails, -1 at the end
        keys = np.concatenate(
            (keys, 2 * n_docs + 2 * tail_seg[lo:hi], np.full(extra, -1, dtype=np.int64))
        )
        first = np.concatenate((p.first[which], np.full(hi - lo + extra, r, dtype=np.int64)))
        degree = np.concatenate((p.degree[which], np.ones(hi - lo + extra, dtype=np.int64)))
        run = local_cu_seqlens(keys)[:-1]  # each local segment's first token
        groups = np.stack((first[run], degree[run]), axis=1).astype(np.int32)
        out.append((gpos, keys, groups))
    return out


def dynamic_slices(
    batch: Batch, cp_max: int, per_rank: int, model: CostModel, pad_id: int
) -> list[Batch]:
    """The batch of every CP rank of ``batch``'s DP rank under ``cp: dynamic``."""
    assert batch.input_ids is not None and batch.labels is not None  # a whole DP batch
    cu = np.asarray(batch.cu_seqlens, dtype=np.int64)
    flat = {k: v.reshape(-1) for k, v in batch.arrays().items() if k != "cu_seqlens"}
    is_tail = flat["segment_ids"][cu[:-1]] == 0
    p = placement(cu, is_tail, cp_max, per_rank, model)
    out = []
    for rank, (gpos, keys, groups) in enumerate(dynamic_index(cu, is_tail, p, cp_max)):
        one_row = gpos.reshape(1, -1)
        out.append(local_batch(batch, flat, one_row, keys, pad_id, DYNAMIC, rank, cp_max, groups))
    return out
