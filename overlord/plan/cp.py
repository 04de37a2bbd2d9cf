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
) -> np.ndarray:
    """Cost of each document to one rank of its CP group (``model.cost`` when ``cp == 1``).

    >>> m = CostModel(alpha=1.0, beta=1.0)
    >>> cp_cost(m, np.array([2, 8]), None, 2, CPLayout.PER_DOCUMENT).tolist()
    [10.0, 36.0]
    """
    if cp <= 1:
        return model.cost(tokens, patches)
    return model.cost(padded_lengths(tokens, cp, layout), patches) / cp
