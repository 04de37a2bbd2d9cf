"""The cost model under context parallelism: what a document costs each rank of its CP group.

The ``cp`` ranks of a DP group share every document of the group's batch: each
holds ``1/cp`` of its tokens and computes ``1/cp`` of its causal attention
(both layouts cut a sequence into ``2 * cp`` chunks and give rank ``i`` chunks
``i`` and ``2cp - 1 - i``: for a causal sequence of ``L`` tokens that is
exactly ``L**2 / (2 * cp)`` of the ``L**2 / 2`` query-key pairs per rank). So
a document costs each rank of its group ``cost(L') / cp``, where ``L'`` is
the length the layout gives it: ``per_document`` pads every document to a
multiple of ``2 * cp`` tokens; ``zigzag`` pads nothing (its balance holds
over a whole row, and a document's share is its expectation). A DP group is
as slow as its most loaded CP rank, which is what the balancer balances.

Under ``cp: dynamic`` (ByteScale's HDP) a document of ``L`` tokens has its own
degree ``d`` (:func:`cp_degrees`) and is held by ``d`` of its DP group's
``cp_max`` ranks; it costs each of them ``cost(L') / d``, with ``L' = L`` for
``d = 1`` and ``L' = 2d * ceil(L / 2d)`` otherwise (the ``per_document`` rule
with ``2d``). For the balance between DP groups a document counts
``cost(L') / cp_max``: its share of its group's mean rank load (the sum over
the group's ranks, divided by ``cp_max``); within a group,
:func:`place_documents` decides which ranks hold it.
"""

from __future__ import annotations

import numpy as np

from overlord.plan.cost import CostModel
from overlord.world import CPLayout


def padded_lengths(tokens: np.ndarray, cp: int, layout: CPLayout | None) -> np.ndarray:
    """Each document's length as its CP group holds it.

    >>> padded_lengths(np.array([1, 4, 5]), 2, CPLayout.PER_DOCUMENT).tolist()
    [4, 4, 8]
    >>> padded_lengths(np.array([1, 4, 5]), 2, CPLayout.ZIGZAG).tolist()
    [1, 4, 5]
    """
    t = np.asarray(tokens, dtype=np.int64)
    if cp <= 1 or layout is not CPLayout.PER_DOCUMENT:
        return t
    k = 2 * cp
    return -(-t // k) * k


def cp_cost(
    model: CostModel,
    tokens: np.ndarray,
    patches: np.ndarray | None,
    cp: int,
    layout: CPLayout | None,
    per_rank: int | None = None,
) -> np.ndarray:
    """Cost of each document to one rank of its CP group (``model.cost`` when ``cp == 1``).

    With ``per_rank`` (``world.tokens_per_cp_rank`` of ``cp: dynamic``; ``cp``
    is then ``cp_max``), a document's share of its DP group's mean rank load.

    >>> m = CostModel(alpha=1.0, beta=1.0)
    >>> cp_cost(m, np.array([2, 8]), None, 2, CPLayout.PER_DOCUMENT).tolist()
    [10.0, 36.0]
    >>> cp_cost(m, np.array([2, 8]), None, 2, None, per_rank=4).tolist()  # degrees 1, 2
    [3.0, 36.0]
    """
    if per_rank is not None:
        t = dynamic_lengths(tokens, cp_degrees(tokens, cp, per_rank))
        return model.cost(t, patches) / cp
    if cp <= 1:
        return model.cost(tokens, patches)
    return model.cost(padded_lengths(tokens, cp, layout), patches) / cp


def cp_degrees(tokens: np.ndarray, cp_max: int, per_rank: int) -> np.ndarray:
    """Each document's CP degree under ``cp: dynamic`` (int64).

    The smallest power of two ``d <= cp_max`` with ``ceil(L / d) <= per_rank``;
    ``cp_max`` where none is (``L > cp_max * per_rank``: the document is held
    by every rank of its group, more than ``per_rank`` tokens each).

    >>> cp_degrees(np.array([1, 4, 5, 8, 9, 16, 17, 100]), 4, 4).tolist()
    [1, 1, 2, 2, 4, 4, 4, 4]
    """
    t = np.asarray(tokens, dtype=np.int64)
    need = -(-t // per_rank)  # ceil(L / d) <= T exactly when d >= ceil(L / T)
    d = np.ones_like(t)
    while True:
        short = (d < need) & (d < cp_max)
        if not short.any():
            return d
        d[short] *= 2


def dynamic_lengths(tokens: np.ndarray, degrees: np.ndarray) -> np.ndarray:
    """Each document's length on its sub-group: ``L`` for degree 1, else ``2d * ceil(L / 2d)``.

    >>> dynamic_lengths(np.array([3, 3, 9]), np.array([1, 2, 4])).tolist()
    [3, 4, 16]
    """
    t = np.asarray(tokens, dtype=np.int64)
    k = 2 * np.asarray(degrees, dtype=np.int64)
    return np.where(k > 2, -(-t // k) * k, t)


def place_documents(rank_cost: np.ndarray, degrees: np.ndarray, cp_max: int) -> np.ndarray:
    """The first CP rank of each document's sub-group, within one DP group of ``cp_max`` ranks.

    A document of degree ``d`` goes to an aligned sub-group, ranks ``[k*d,
    (k+1)*d)``, and adds ``rank_cost`` (its cost to each of its ranks) to each.
    Greedy, for a low most loaded rank: documents by degree (highest first,
    they have the fewest choices), then by cost (highest first), then in
    batch order; each to the sub-group whose most loaded rank is least loaded
    (the lowest among equals). A pure function of its arguments.

    >>> place_documents(np.array([4.0, 1.0, 3.0, 2.0]), np.array([2, 1, 1, 1]), 2).tolist()
    [0, 1, 0, 1]
    """
    cost = np.asarray(rank_cost, dtype=np.float64)
    deg = np.asarray(degrees, dtype=np.int64)
    load = np.zeros(cp_max)
    first = np.zeros(len(deg), dtype=np.int64)
    for i in np.lexsort((np.arange(len(deg)), -cost, -deg)).tolist():
        d = int(deg[i])
        k = int(np.argmin(load.reshape(cp_max // d, d).max(axis=1)))
        first[i] = k * d
        load[k * d : (k + 1) * d] += cost[i]
    return first
