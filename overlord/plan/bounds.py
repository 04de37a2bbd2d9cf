"""Lower bounds on a step's makespan: no assignment of items to DP ranks does better.

A step's items are split over ``dp`` ranks; a rank's cost is the sum of its
items' costs, and the makespan is the cost of the most loaded rank. Each bound
below is a value that every feasible assignment's makespan reaches or exceeds,
so ``makespan / bound`` is how far a balancer can be from optimal at most.

- ``lower_bound``: ``max(total / dp, largest item)``. Needs only the costs.
- ``pigeonhole_bound``: also counts how many long items some rank must hold,
  and how many tokens every rank must carry when ranks are nearly full.
- ``capacity_bound``: for costs ``alpha * L + beta * L**2``, also counts that
  a rank holding long items (a large sum of squares) must still carry its
  share of the tokens when the other ranks have no room for them.

Each is at least ``lower_bound``; neither of the other two dominates.
"""

from __future__ import annotations

import numpy as np

from overlord.plan.columns import stable_order


def lower_bound(cost: np.ndarray, dp: int) -> float:
    """``max(total / dp, largest item)``: no assignment does better.

    Some rank carries at least the average load, and the rank holding the
    costliest item carries at least that item.

    >>> lower_bound(np.array([3.0, 1.0, 2.0]), 2)
    3.0
    """
    if len(cost) == 0:
        return 0.0
    return float(max(cost.sum() / dp, cost.max()))


def _small(tokens: np.ndarray) -> bool:
    """Non-negative integers (lengths): :func:`stable_order` sorts them by radix."""
    t = np.asarray(tokens)
    return len(t) > 0 and t.dtype.kind in "iu" and int(t.min()) >= 0


def costliest_first(tokens: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """``np.argsort(-cost, kind="stable")``, sorted by radix where cost grows with length.

    The longest first (stably) is that order whenever it leaves the costs
    non-increasing, equal costs in index order: checked, else sorted by cost.

    >>> costliest_first(np.array([1, 3, 2, 3]), np.array([1.0, 9.0, 4.0, 9.0])).tolist()
    [1, 3, 2, 0]
    """
    if _small(tokens):
        order = stable_order(int(np.max(tokens)) - np.asarray(tokens, dtype=np.int64))
        down, c = np.diff(order), np.diff(cost[order])
        if bool(np.all((c < 0) | ((c == 0) & (down > 0)))):
            return order
    return np.argsort(-cost, kind="stable")


def pigeonhole_bound(tokens: np.ndarray, cost: np.ndarray, dp: int, rank_capacity: int) -> float:
    """A lower bound that counts long items, not only the largest one.

    Of the ``j`` costliest items some rank holds ``k = ceil(j / dp)``, so it
    costs at least the ``k`` cheapest of them; every rank also holds at least
    ``total_tokens - (dp - 1) * rank_capacity`` tokens, each further token
    costing at least the smallest cost per token of any item. With ``dp + 1``
    full-length chunks one rank must take two, which ``lower_bound`` does not
    see (contributed by the planner-scale study in benchmarks/planner_scale.py).

    >>> pigeonhole_bound(np.array([4, 4, 4]), np.array([5.0, 5.0, 5.0]), 2, 8)
    10.0
    """
    if len(cost) == 0:
        return 0.0
    order = costliest_first(tokens, cost)
    c, length = cost[order], tokens[order].astype(np.float64)
    per_token = float(np.min(c / np.maximum(length, 1)))
    j = np.arange(1, len(c) + 1)
    k = -(-j // dp)
    cc = np.concatenate(([0.0], np.cumsum(c)))
    cl = np.concatenate(([0.0], np.cumsum(length)))
    t_min = max(0.0, float(length.sum()) - (dp - 1) * rank_capacity)
    held = cc[j] - cc[j - k] + per_token * np.maximum(0.0, t_min - (cl[j] - cl[j - k]))
    return float(max(cost.sum() / dp, held.max(), cost.max()))


def capacity_bound(
    tokens: np.ndarray, cost: np.ndarray, alpha: float, beta: float, dp: int, rank_capacity: int
) -> float:
    """The capacity-aware lower bound (LB_cap) on the makespan, for quadratic costs.

    Bounds the makespan of every assignment of the items (``tokens[i]`` long,
    costing ``cost[i]``) to ``dp`` ranks in which no rank holds more than
    ``rank_capacity`` tokens (``rows_per_rank * max_seq_len``). It is valid
    when each item costs at least ``alpha * L + beta * L**2`` (the cost model,
    ``CostModel.cost`` with no image term; ``alpha, beta > 0``); otherwise, or
    with no items, it returns ``lower_bound(cost, dp)``.

    Why it is valid. Write Q for ``rank_capacity``, T for the total tokens and
    S_r for the sum of the squared lengths of rank r's items. Under a makespan
    M, rank r costs ``alpha * T_r + beta * S_r <= M``, so it holds at most
    ``min(Q, (M - beta * S_r) / alpha) = Q - (beta / alpha) * max(0, S_r - s)``
    tokens, with ``s = (M - alpha * Q) / beta``. Every token is held somewhere,
    so ``T <= dp * Q - (beta / alpha) * E`` with ``E = sum_r max(0, S_r - s)``.
    E is at least ``sum(L**2) - dp * s``, and at least the sum of the squares
    of the items with ``L**2 > s`` less ``min(their count, dp) * s``, because
    each rank holding such items exceeds s by at least their squares less s.
    Any makespan M at or above the optimum passes this test, so the least M
    that passes (found by bisection, to float precision) is a lower bound. It
    ignores how rows split a rank, so it holds with any number of rows per
    rank; it is never below ``lower_bound``.

    It is tighter than ``lower_bound`` when ranks are nearly full and items are
    long: the rank holding a full-length chunk still has to carry about Q tokens,
    since the other ranks have no room for them.

    Parameters
    ----------
    tokens : np.ndarray
        Length in tokens of each item.
    cost : np.ndarray
        Cost of each item, at least ``alpha * tokens + beta * tokens**2``.
    alpha, beta : float
        The cost model's linear and quadratic coefficients.
    dp : int
        Number of data-parallel ranks.
    rank_capacity : int
        Tokens one rank can hold in a step.

    Returns
    -------
    float
        A makespan that no capacity-respecting assignment beats.

    Examples
    --------
    Two ranks of 4 tokens, one item of 3 tokens and five of 1, each costing
    ``L + L**2``. The 3 costs 12, the most of any item, and the total is 22, so
    ``lower_bound`` is 12. Yet the rank that holds the 3 has to take at least
    one more token (the other rank has room for only four), so the optimum is
    14, and the capacity-aware bound sees part of that:

    >>> tok = np.array([3, 1, 1, 1, 1, 1])
    >>> cost = tok + tok**2.0
    >>> lower_bound(cost, 2), capacity_bound(tok, cost, 1.0, 1.0, 2, 4)
    (12.0, 13.0)

    (it counts only the linear cost of the extra token, 1, not its square).
    """
    base = lower_bound(cost, dp)
    if alpha <= 0 or beta <= 0 or len(tokens) == 0:
        return base
    length = np.asarray(tokens, dtype=np.float64)
    total = float(length.sum())
    short_first = length[stable_order(tokens)] if _small(tokens) else np.sort(length)
    sq = (short_first * short_first)[::-1]  # np.sort(length**2)[::-1]: lengths are >= 0
    prefix = np.concatenate(([0.0], np.cumsum(sq)))
    s2 = float(prefix[-1])
    q = float(rank_capacity)

    def feasible(m: float) -> bool:
        s_star = (m - alpha * q) / beta
        excess = s2 - dp * s_star
        if s_star >= 0:
            big = int(np.searchsorted(-sq, -s_star, side="left"))  # items with L^2 > s*
            excess = max(excess, float(prefix[big]) - min(big, dp) * s_star)
        return total <= dp * q - beta / alpha * max(excess, 0.0)

    if feasible(base) or base <= 0 or total > dp * q:
        # no makespan passes when the items do not fit the ranks at all, and doubling a
        # zero bound never ends: outside the preconditions, lower_bound is the answer
        return base
    lo, hi = base, 2.0 * base
    while not feasible(hi):
        lo, hi = hi, 2.0 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi
