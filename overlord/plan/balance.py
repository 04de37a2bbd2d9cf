"""Assigning a step's items to DP ranks and rows, so that the most loaded rank costs least.

Every rank has ``rows_per_rank`` rows of ``capacity`` tokens. A rank's cost is
the sum of its items' costs (with document-masked attention a document costs
the same whichever row of the rank holds it), so balancing is a partition of
items into ranks whose items still pack into the rank's rows.

- ``kk``: Karmarkar-Karp (largest differencing) over items, then a capacity
  repair that moves items which do not fit to the least loaded rank with room.
- ``lpt``: items by decreasing cost, each to the least loaded rank with room.
- ``none``: what a per-rank loader does: rank r takes the r-th contiguous block
  of rows of the reference packing, cost unseen. The baseline.

``kk`` and ``lpt`` also compute the reference rows balanced as whole rows
(always feasible) and keep whichever of the two has the smaller makespan, so
neither is ever worse than balancing packed rows, and never infeasible.

The lower bounds on a step's makespan are in ``overlord.plan.bounds``; ``assign``
stops early when a result meets ``pigeonhole_bound``.
"""

from __future__ import annotations

import heapq

import numpy as np

from overlord.plan.bounds import lower_bound, pigeonhole_bound
from overlord.plan.spec import BalanceMethod

__all__ = [
    "assign",
    "kk_partition",
    "kk_rows",
    "lower_bound",
    "lpt_rows",
    "pigeonhole_bound",
    "rank_costs",
    "whole_rows",
]


def rank_costs(cost: np.ndarray, row: np.ndarray, dp: int, rows_per_rank: int) -> np.ndarray:
    """Cost of each rank, given each item's global row."""
    return np.bincount(row // rows_per_rank, weights=cost, minlength=dp)


def _pack_rows(
    order: np.ndarray, tokens: np.ndarray, rank_of: np.ndarray, dp: int, rpr: int, cap: int
) -> tuple[np.ndarray, list[int]]:
    """First-fit decreasing of each rank's items into its rows; returns rows and overflow.

    Best fit: the row with the least room that takes the item (the first such).
    """
    if rpr <= FEW_ROWS:  # a few rows per rank: plain Python over them, the same choices
        return _pack_rows_lists(order, tokens, rank_of, rpr, [[cap] * rpr for _ in range(dp)])
    free = np.full((dp, rpr), cap, dtype=np.int64)
    row = np.full(len(tokens), -1, dtype=np.int64)
    overflow = []
    for i in order.tolist():
        r = rank_of[i]
        fits = np.flatnonzero(free[r] >= tokens[i])
        if len(fits) == 0:
            overflow.append(i)
            continue
        j = fits[np.argmin(free[r][fits])]  # best fit
        free[r, j] -= tokens[i]
        row[i] = r * rpr + j
    return row, overflow


# up to this many rows per rank, a rank's rows are looked at in Python (numpy's calls on
# a few numbers cost more than the loop)
FEW_ROWS = 16


def _pack_rows_lists(
    order: np.ndarray, tokens: np.ndarray, rank_of: np.ndarray, rpr: int, free: list[list[int]]
) -> tuple[np.ndarray, list[int]]:
    """:func:`_pack_rows` over lists: ``free`` is each rank's rows' room (updated)."""
    toks, ranks = tokens.tolist(), rank_of.tolist()
    row = [-1] * len(toks)
    overflow = []
    for i in order.tolist():
        r, t = ranks[i], toks[i]
        room = free[r]
        best = -1
        for j in range(rpr):  # best fit: the least room that takes it, the first such
            if room[j] >= t and (best < 0 or room[j] < room[best]):
                best = j
        if best < 0:
            overflow.append(i)
            continue
        room[best] -= t
        row[i] = r * rpr + best
    return np.array(row, dtype=np.int64), overflow


def _place_least_loaded(
    items: list[int],
    tokens: np.ndarray,
    cost: np.ndarray,
    row: np.ndarray,
    loads: np.ndarray,
    free: np.ndarray,
) -> bool:
    """Put each item on the least loaded rank that has a row with room (best-fit row).

    A rank whose largest free row cannot take the item is parked, keyed by that
    room, and comes back as soon as an item small enough arrives: a full rank is
    looked at once, not once per item.
    """
    dp, rpr = free.shape
    room = free.max(axis=1)
    ready = [(float(loads[r]), r) for r in range(dp)]
    heapq.heapify(ready)
    parked: list[tuple[int, float, int]] = []  # (-room, load, rank)
    for i in items:
        t = int(tokens[i])
        while parked and -parked[0][0] >= t:
            _, load, r = heapq.heappop(parked)
            heapq.heappush(ready, (load, r))
        while ready:
            load, r = heapq.heappop(ready)
            if room[r] >= t:
                break
            heapq.heappush(parked, (-int(room[r]), load, r))
        else:
            return False
        fits = np.flatnonzero(free[r] >= t)
        j = fits[np.argmin(free[r][fits])]
        free[r, j] -= t
        room[r] = free[r].max()
        row[i] = r * rpr + j
        loads[r] += cost[i]
        heapq.heappush(ready, (float(loads[r]), r))
    return True


def lpt_rows(
    tokens: np.ndarray, cost: np.ndarray, dp: int, rpr: int, cap: int
) -> np.ndarray | None:
    """The ``lpt`` placement: global row of each item, or None where it finds no room.

    Items by decreasing cost, each to the least loaded of the ``dp`` ranks that
    has a row (``rpr`` rows of ``cap`` tokens each) with room, best-fit row.
    It can fail (None) when rows are nearly full: ``assign`` then keeps its
    whole-rows fallback.

    >>> lpt_rows(np.array([2, 2, 1]), np.array([4.0, 3.0, 1.0]), 2, 1, 3).tolist()
    [0, 1, 1]
    """
    order = np.lexsort((np.arange(len(cost)), -cost))
    row = np.full(len(cost), -1, dtype=np.int64)
    free = np.full((dp, rpr), cap, dtype=np.int64)
    ok = _place_least_loaded(order.tolist(), tokens, cost, row, np.zeros(dp), free)
    return row if ok else None


def kk_partition(cost: np.ndarray, k: int) -> np.ndarray:
    """Karmarkar-Karp k-way partition: the group (0..k-1) of each item.

    Each item starts as a k-tuple ``(c, 0, ..., 0)``. The two tuples with the
    largest spread are merged by pairing the largest sum of one with the
    smallest of the other, until one tuple is left. Merges are recorded as
    node pairs so that groups are recovered at the end without copying lists.

    >>> kk_partition(np.array([8.0, 7, 6, 5, 4]), 2).tolist()
    [1, 0, 1, 0, 0]
    """
    n = len(cost)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if k <= KK_PYTHON_K:
        return _kk_lists(np.asarray(cost, dtype=np.float64).tolist(), k)
    empty = -1
    # a tuple: (sums sorted descending, node id of each sum); leaves are items 0..n-1
    tuples: list[tuple[np.ndarray, np.ndarray]] = []
    heap: list[tuple[float, int]] = []
    for i in range(n):
        sums = np.zeros(k)
        sums[0] = cost[i]
        nodes = np.full(k, empty, dtype=np.int64)
        nodes[0] = i
        tuples.append((sums, nodes))
        heap.append((-float(cost[i]), i))
    heapq.heapify(heap)
    left: list[np.ndarray] = []
    right: list[np.ndarray] = []
    next_node = n
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        sa, na = tuples[a]
        sb, nb = tuples[b]
        sums = sa + sb[::-1]
        order = np.argsort(-sums, kind="stable")
        la, lb = na[order], nb[::-1][order]
        new = np.arange(next_node, next_node + k)
        # a merged node with one empty side is just the other side: no new node needed
        nodes = np.where(la == empty, lb, np.where(lb == empty, la, new))
        both = (la != empty) & (lb != empty)
        left.append(np.where(both, la, empty))
        right.append(np.where(both, lb, empty))
        next_node += k
        tuples[a] = (sums[order], nodes)
        tuples[b] = (sa[:0], na[:0])  # free memory
        heapq.heappush(heap, (-(float(sums.max() - sums.min())), a))
    _, last = heap[0]
    label = np.full(next_node, -1, dtype=np.int64)
    final = tuples[last][1]
    label[final[final != empty]] = np.flatnonzero(final != empty)
    for m in range(len(left) - 1, -1, -1):
        ids = np.arange(n + m * k, n + (m + 1) * k)
        keep = left[m] != empty
        label[left[m][keep]] = label[ids[keep]]
        label[right[m][keep]] = label[ids[keep]]
    return label[:n]


# up to this many groups, a merge's few sums cost less as Python floats than as numpy
# calls (about ten per merge); the same additions and the same stable order either way
KK_PYTHON_K = 32


def _kk_lists(cost: list[float], k: int) -> np.ndarray:
    """:func:`kk_partition` over Python lists: the same merges, ties and groups, for small ``k``.

    >>> _kk_lists([8.0, 7, 6, 5, 4], 2).tolist()
    [1, 0, 1, 0, 0]
    """
    n, empty = len(cost), -1
    sums_of: list[list[float]] = [[c] + [0.0] * (k - 1) for c in cost]
    nodes_of: list[list[int]] = [[i] + [empty] * (k - 1) for i in range(n)]
    heap = [(-c, i) for i, c in enumerate(cost)]
    heapq.heapify(heap)
    merged: list[tuple[list[int], list[int]]] = []  # each merge's node pairs (left, right)
    next_node = n
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        na, nb = nodes_of[a], nodes_of[b][::-1]
        sums = [x + y for x, y in zip(sums_of[a], sums_of[b][::-1])]
        order = sorted(range(k), key=lambda j: -sums[j])  # stable, as numpy's argsort
        nodes, left, right = [], [], []
        for t, j in enumerate(order):
            x, y = na[j], nb[j]
            both = x != empty and y != empty
            # a merged node with one empty side is just the other side: no new node needed
            nodes.append(next_node + t if both else y if x == empty else x)
            left.append(x if both else empty)
            right.append(y if both else empty)
        merged.append((left, right))
        next_node += k
        sums_of[a], nodes_of[a] = [sums[j] for j in order], nodes
        sums_of[b], nodes_of[b] = [], []  # free memory
        heapq.heappush(heap, (-(max(sums) - min(sums)), a))
    label = [empty] * next_node
    for g, node in enumerate(nodes_of[heap[0][1]]):
        if node != empty:
            label[node] = g
    for m in range(len(merged) - 1, -1, -1):
        base = n + m * k
        for t, (x, y) in enumerate(zip(*merged[m])):
            if x != empty:
                label[x] = label[y] = label[base + t]
    return np.array(label[:n], dtype=np.int64)


# Karmarkar-Karp runs on this many of a step's costliest items per rank (at least
# KK_MIN_ITEMS); the rest, small items, go to the least loaded rank. KK's merges cost
# O(dp) each, and small items gain nothing from differencing.
KK_ITEMS_PER_RANK = 4
KK_MIN_ITEMS = 256
KK_MAX_DP = 512
# a result further than this above the bound also tries placement keyed on attention cost
ATTENTION_KEYED_ABOVE = 1.005
# rows and items one local search examines at most (about 0.1-0.2 s of numpy): reached only
# where a group's whole rows are far from the bound and its items many (DP 512 with rows of
# 16K-64K: seconds a step unbounded); the other steps of benchmarks/planner_scale.py meet the
# bound before any search, and smaller searches (DP 64 with 4M tokens: tens of ms) stay whole
IMPROVE_BUDGET = 16_000_000


def kk_rows(tokens: np.ndarray, cost: np.ndarray, dp: int, rpr: int, cap: int) -> np.ndarray | None:
    """The ``kk`` placement: global row of each item, or None where the repair finds no room.

    Karmarkar-Karp partitions the costliest items (``KK_ITEMS_PER_RANK`` per rank,
    at least ``KK_MIN_ITEMS``; none past ``KK_MAX_DP`` ranks) into ``dp`` ranks,
    the rest go to the least loaded rank; each rank's items are then packed
    first-fit decreasing into its ``rpr`` rows of ``cap`` tokens, and items that
    do not fit move to the least loaded rank with room.

    >>> kk_rows(np.array([2, 2, 1]), np.array([4.0, 3.0, 1.0]), 2, 1, 3).tolist()
    [0, 1, 1]
    """
    by_cost = np.lexsort((np.arange(len(cost)), -cost))
    # KK's tuples hold dp sums each: past KK_MAX_DP ranks its memory and time grow as dp**2,
    # and the greedy placement below gives the same makespans there (benchmarks/planner_scale)
    head = by_cost[: max(KK_MIN_ITEMS, KK_ITEMS_PER_RANK * dp)] if dp <= KK_MAX_DP else by_cost[:0]
    rank_of = np.empty(len(cost), dtype=np.int64)
    rank_of[head] = kk_partition(cost[head], dp)
    loads = np.bincount(rank_of[head], weights=cost[head], minlength=dp)
    heap = [(float(loads[r]), r) for r in range(dp)]
    heapq.heapify(heap)
    for i in by_cost[len(head) :].tolist():
        load, r = heapq.heappop(heap)
        rank_of[i] = r
        heapq.heappush(heap, (load + float(cost[i]), r))
    order = np.lexsort((np.arange(len(cost)), -tokens))
    row, overflow = _pack_rows(order, tokens, rank_of, dp, rpr, cap)
    if not overflow:
        return row
    placed = row >= 0
    loads = np.bincount(row[placed] // rpr, weights=cost[placed], minlength=dp)
    free = np.full((dp, rpr), cap, dtype=np.int64)
    np.subtract.at(free.reshape(-1), row[placed], tokens[placed])
    overflow.sort(key=lambda i: (-cost[i], i))
    ok = _place_least_loaded(overflow, tokens, cost, row, loads, free)
    return row if ok else None


def _improve(
    row: np.ndarray,
    tokens: np.ndarray,
    cost: np.ndarray,
    dp: int,
    rpr: int,
    cap: int,
    budget: int | None = None,
) -> np.ndarray:
    """Local search on the most loaded rank: moves, then swaps, that lower it and fit the rows.

    Every accepted change lowers the most loaded rank and leaves every other rank
    below its old load, so the sorted loads decrease and the search ends.
    It also ends once it examined ``budget`` rows and items (``IMPROVE_BUDGET``
    by default; a row or an item looked at once is one unit): counted, not
    timed, so that where it ends is a pure function of the step.
    """
    budget = IMPROVE_BUDGET if budget is None else budget
    used = 0
    row = row.copy()
    row_rank = np.arange(dp * rpr) // rpr
    rank = row // rpr
    loads = np.bincount(rank, weights=cost, minlength=dp)
    free = cap - np.bincount(row, weights=tokens, minlength=dp * rpr).astype(np.int64)
    for _ in range(min(4 * dp, 512)):
        if used >= budget:
            break
        top = int(np.argmax(loads))
        peak = loads[top]
        mine = np.flatnonzero(rank == top)
        used += len(rank)
        mine = mine[np.argsort(-cost[mine], kind="stable")][:32]
        changed = False
        for i in mine.tolist():  # move an item to a row with room on a lighter rank
            used += len(free)
            ok = (free >= tokens[i]) & (loads[row_rank] + cost[i] < peak) & (row_rank != top)
            if ok.any():
                cand = np.flatnonzero(ok)
                j = int(cand[np.argmin(loads[row_rank[cand]])])
                free[row[i]] += tokens[i]
                free[j] -= tokens[i]
                loads[top] -= cost[i]
                loads[row_rank[j]] += cost[i]
                row[i], rank[i] = j, row_rank[j]
                changed = True
                break
        if changed:
            continue
        others = np.flatnonzero(rank != top)
        used += len(rank)
        for i in mine.tolist():  # swap it with a cheaper item of another rank
            used += len(others)
            delta = cost[i] - cost[others]
            other_rank = rank[others]
            ok = (
                (delta > 0)
                & (loads[other_rank] + delta < peak)
                & (free[row[i]] + tokens[i] >= tokens[others])
                & (free[row[others]] + tokens[others] >= tokens[i])
            )
            if not ok.any():
                continue
            cand = np.flatnonzero(ok)
            after = np.maximum(peak - delta[cand], loads[other_rank[cand]] + delta[cand])
            j = int(others[cand[np.argmin(after)]])
            ri, rj = row[i], row[j]
            free[ri] += tokens[i] - tokens[j]
            free[rj] += tokens[j] - tokens[i]
            loads[top] -= cost[i] - cost[j]
            loads[rank[j]] += cost[i] - cost[j]
            row[i], row[j] = rj, ri
            rank[i], rank[j] = rank[j], top
            changed = True
            break
        if not changed:
            break
    return row


def _rows_balanced(row_cost: np.ndarray, dp: int, rpr: int) -> np.ndarray:
    """Whole rows to ranks, ``rpr`` each, costliest first to the least loaded rank.

    The rule is a heap of (load, rank) popped row by row; it runs a round of
    ``dp`` rows at a time with numpy while a round is *plain*: every rank
    popped once, in (load, rank) order, because each rank's new load exceeds
    every load still waiting in the round (the last round pushes nothing back).
    From the first round that is not plain on, the heap runs row by row.
    """
    order = np.lexsort((np.arange(len(row_cost)), -row_cost))
    target = np.empty(len(row_cost), dtype=np.int64)
    if dp == 1:  # every round is plain: the rows in pop order, costliest first
        target[order] = np.arange(len(row_cost))
        return target
    loads = np.zeros(dp)
    ranks = np.arange(dp)
    k = 0
    while k < rpr:
        by = np.lexsort((ranks, loads))  # the heap's pop order: least load, then lowest rank
        before = loads[by]
        after = before + row_cost[order[k * dp : (k + 1) * dp]]
        if k < rpr - 1 and dp > 1 and not after[:-1].min() > before[-1]:
            break
        target[order[k * dp : (k + 1) * dp]] = by * rpr + k
        loads[by] = after
        k += 1
    if k == rpr:
        return target
    heap = [(float(loads[r]), r) for r in range(dp)]
    heapq.heapify(heap)
    count = [k] * dp
    for j in order[k * dp :].tolist():
        load, r = heapq.heappop(heap)
        target[j] = r * rpr + count[r]
        count[r] += 1
        if count[r] < rpr:
            heapq.heappush(heap, (load + float(row_cost[j]), r))
    return target


def whole_rows(cost: np.ndarray, ref_row: np.ndarray, dp: int, rows_per_rank: int) -> np.ndarray:
    """The reference rows balanced whole: the global row of each item (always feasible).

    Each of the ``dp * rows_per_rank`` reference rows (``ref_row``, the step's
    reference packing) moves as a whole, costliest first, to the least loaded
    rank that still has a free row. ``assign``'s ``kk`` and ``lpt`` start from
    this and never return anything worse.

    >>> whole_rows(np.array([5.0, 1.0, 1.0, 3.0]), np.array([0, 1, 2, 3]), 2, 2).tolist()
    [0, 3, 1, 2]
    """
    rows = dp * rows_per_rank
    row_cost = np.bincount(ref_row, weights=cost, minlength=rows)
    return _rows_balanced(row_cost, dp, rows_per_rank)[ref_row]


def assign(
    tokens: np.ndarray,
    cost: np.ndarray,
    ref_row: np.ndarray,
    dp: int,
    rows_per_rank: int,
    capacity: int,
    method: BalanceMethod,
    good_enough: float = 0.0,
) -> np.ndarray:
    """Global row (rank = row // rows_per_rank) of each item of a step.

    ``ref_row`` is the DP-independent reference packing of the step (``dp *
    rows_per_rank`` rows); it is the fallback and the ``none`` baseline. The
    search stops at a makespan of ``good_enough`` (a group of a hierarchical
    step: :mod:`overlord.plan.hierarchy`) or at the pigeonhole bound.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    cost = np.asarray(cost, dtype=np.float64)
    ref_row = np.asarray(ref_row, dtype=np.int64)
    if method is BalanceMethod.NONE or len(tokens) == 0:
        return ref_row
    fallback = whole_rows(cost, ref_row, dp, rows_per_rank)
    if dp == 1:
        # one rank costs the sum of every item however its rows are packed, and the
        # bound below is at least that sum: the fallback is returned, so skip the search
        return fallback
    bound = pigeonhole_bound(tokens, cost, dp, rows_per_rank * capacity) * (1 + 1e-9)
    bound = max(bound, good_enough)
    span = rank_costs(cost, fallback, dp, rows_per_rank).max()
    if span <= bound:
        return fallback  # already optimal (e.g. full-length chunks set the bound)
    best = _improve(fallback, tokens, cost, dp, rows_per_rank, capacity)
    span = rank_costs(cost, best, dp, rows_per_rank).max()
    if span <= bound:
        return best
    solver = kk_rows if method is BalanceMethod.KK else lpt_rows
    candidates = [solver(tokens, cost, dp, rows_per_rank, capacity)]
    if span > bound * ATTENTION_KEYED_ABOVE:
        # rows nearly full give every rank about the same tokens, so what is left to
        # balance is the superlinear (attention) part: place by it alone, then refine
        per_token = float(np.min(cost / np.maximum(tokens, 1)))
        candidates.append(lpt_rows(tokens, cost - per_token * tokens, dp, rows_per_rank, capacity))
    for row in candidates:
        if row is None:
            continue
        row = _improve(row, tokens, cost, dp, rows_per_rank, capacity)
        mine = rank_costs(cost, row, dp, rows_per_rank).max()
        if mine < span:
            best, span = row, mine
    return best
