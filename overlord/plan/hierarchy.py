"""Hierarchical assignment: a step's rows split over groups of ranks, each group balanced alone.

Which items form a step, and their reference packing, is one decision made
before this (:mod:`overlord.plan.select`); what is split here is only who gets
them. With thousands of ranks one balancer over every item of a step is too
slow (its search grows with items times ranks), so:

1. **Split.** The reference rows are dealt whole to ``groups`` groups of
   ``dp / groups`` consecutive ranks, costliest first, each round's costliest
   row to the least loaded group: every group gets the same number of rows and
   about the same cost, and its rows stay a valid packing.
2. **Groups.** Each group is balanced on its own by :func:`~overlord.plan.balance.assign`
   over its items only, which stops searching once its most loaded rank is
   within ``GROUP_SLACK`` of the step's capacity-aware bound. Groups are
   independent, so they run in parallel wherever the runtime puts them
   (:mod:`overlord.roles.assigner`).
3. **Merge.** Group ``g``'s rows become the rows of ranks ``g * size ..``.

Everything is a pure function of the step's items, the topology and the cost
model: the result never depends on how many workers ran the groups, or where.
With one group (``dp <= group_ranks``) the result is exactly ``assign``'s over
the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from overlord.plan.balance import assign
from overlord.plan.bounds import capacity_bound, pigeonhole_bound
from overlord.plan.columns import stable_order
from overlord.plan.spec import BalanceMethod

# a group stops searching once its most loaded rank is within this share of the step's bound
GROUP_SLACK = 0.01
# swaps of whole rows across groups, at most, after the groups are merged
SWAP_LIMIT = 256

Job = dict[str, Any]  # one group's balancing problem: plain numpy arrays and numbers
Runner = Callable[[list[Job]], list[np.ndarray]]


def group_count(dp: int, group_ranks: int) -> int:
    """The fewest groups of equal size, at most ``group_ranks`` ranks each, that make ``dp``.

    >>> group_count(4096, 64), group_count(64, 64), group_count(1000, 64), group_count(7, 4)
    (64, 1, 20, 7)
    """
    need = -(-dp // group_ranks)
    return next(g for g in range(need, dp + 1) if dp % g == 0)


def step_bound(
    tokens: np.ndarray, cost: np.ndarray, dp: int, rank_capacity: int, alpha: float, beta: float
) -> float:
    """The tighter of the two capacity-aware lower bounds of :mod:`overlord.plan.bounds`."""
    return max(
        pigeonhole_bound(tokens, cost, dp, rank_capacity),
        capacity_bound(tokens, cost, alpha, beta, dp, rank_capacity),
    )


@dataclass(frozen=True)
class Split:
    """A step's items dealt to groups: ``order[bounds[g]:bounds[g+1]]`` are group g's items."""

    groups: int
    rows_per_group: int
    local_ref: np.ndarray  # each item's reference row within its group
    order: np.ndarray  # items by group, in step order within a group
    bounds: np.ndarray  # groups + 1 offsets into order


def split_rows(cost: np.ndarray, ref_row: np.ndarray, rows: int, groups: int) -> Split:
    """Deal the ``rows`` reference rows whole to ``groups`` groups, ``rows / groups`` each.

    Rows go costliest first, in rounds of one row per group: each round's
    costliest row to the group least loaded so far (lowest group among equals).

    >>> s = split_rows(np.array([4.0, 3.0, 2.0, 1.0]), np.array([0, 1, 2, 3]), 4, 2)
    >>> [s.order.tolist(), s.local_ref.tolist()]
    [[0, 3, 1, 2], [0, 0, 1, 1]]
    """
    per = rows // groups
    row_cost = np.bincount(ref_row, weights=cost, minlength=rows)
    by_cost = np.lexsort((np.arange(rows), -row_cost))
    dealt = by_cost[: per * groups]  # round k deals dealt[k * groups : (k + 1) * groups]
    costs = row_cost[dealt].reshape(per, groups)
    least = np.empty((per, groups), dtype=np.int64)
    loads = np.zeros(groups)
    for k in range(per):
        order = loads.argsort(kind="stable")
        loads[order] += costs[k]
        least[k] = order
    row_group = np.empty(rows, dtype=np.int64)
    row_slot = np.empty(rows, dtype=np.int64)
    row_group[dealt] = least.reshape(-1)
    row_slot[dealt] = np.repeat(np.arange(per), groups)
    group = row_group[ref_row]
    order = stable_order(group)
    bounds = np.searchsorted(group[order], np.arange(groups + 1))
    return Split(groups, per, row_slot[ref_row], order, bounds)


def assign_group(job: Job) -> np.ndarray:
    """Balance one group: the row of each of its items, among the group's own rows."""
    return assign(
        job["tokens"],
        job["cost"],
        job["ref_row"],
        job["ranks"],
        job["rows_per_rank"],
        job["capacity"],
        BalanceMethod(job["method"]),
        good_enough=job["good_enough"],
    )


def run_here(jobs: list[Job]) -> list[np.ndarray]:
    """Balance the groups one after the other, in this thread."""
    return [assign_group(j) for j in jobs]


def assign_step(
    tokens: np.ndarray,
    cost: np.ndarray,
    ref_row: np.ndarray,
    dp: int,
    rows_per_rank: int,
    capacity: int,
    method: BalanceMethod,
    groups: int,
    bound: Callable[[], float],
    run: Runner = run_here,
) -> np.ndarray:
    """Global row (rank = row // rows_per_rank) of each item, balanced in ``groups`` groups.

    ``bound`` gives the step's lower bound (asked only with several groups);
    ``run`` balances a list of groups and returns their rows in the same
    order, wherever it runs them. One group, or ``none``, is ``assign`` itself.
    """
    if groups <= 1 or method is BalanceMethod.NONE or len(tokens) == 0:
        return assign(tokens, cost, ref_row, dp, rows_per_rank, capacity, method)
    split = split_rows(cost, ref_row, dp * rows_per_rank, groups)
    good_enough = bound() * (1 + GROUP_SLACK)
    jobs = []
    for g in range(groups):
        mine = split.order[split.bounds[g] : split.bounds[g + 1]]
        jobs.append(
            {
                "tokens": tokens[mine],
                "cost": cost[mine],
                "ref_row": split.local_ref[mine],
                "ranks": dp // groups,
                "rows_per_rank": rows_per_rank,
                "capacity": capacity,
                "method": method.value,
                "good_enough": good_enough,
            }
        )
    row = np.empty(len(tokens), dtype=np.int64)
    for g, local in enumerate(run(jobs)):
        row[split.order[split.bounds[g] : split.bounds[g + 1]]] = local + g * split.rows_per_group
    return swap_rows(row, cost, dp, rows_per_rank, good_enough)


def swap_rows(
    row: np.ndarray, cost: np.ndarray, dp: int, rows_per_rank: int, target: float
) -> np.ndarray:
    """Across groups: the most loaded rank swaps whole rows with any other rank, until ``target``.

    Every row has the same capacity, so a row fits on any rank: a swap needs
    no packing. Each swap takes the pair (a row of the most loaded rank, a row
    of another) that leaves the larger of the two ranks least loaded, if that
    is below the old peak; the sorted loads so decrease, and the search ends.

    >>> swap_rows(np.array([0, 1, 2, 3]), np.array([4.0, 3.0, 1.0, 1.0]), 2, 2, 0.0).tolist()
    [2, 1, 0, 3]
    """
    rows = dp * rows_per_rank
    at = np.arange(rows)  # at[s]: the row of the groups' result that now fills slot s
    slot_cost = np.bincount(row, weights=cost, minlength=rows)
    load = slot_cost.reshape(dp, rows_per_rank).sum(axis=1)
    slot_rank = np.arange(rows) // rows_per_rank
    for _ in range(SWAP_LIMIT):
        top = int(np.argmax(load))
        peak = float(load[top])
        if peak <= target:
            break
        mine = np.arange(top * rows_per_rank, (top + 1) * rows_per_rank)
        # what the top rank sheds by swapping its slot a (rows) with slot c (columns)
        delta = slot_cost[mine][:, None] - slot_cost[None, :]
        after = np.maximum(peak - delta, load[slot_rank][None, :] + delta)
        after[:, slot_rank == top] = np.inf
        k = int(np.argmin(after))  # the first best pair, row-major: deterministic
        a, c = int(mine[k // rows]), k % rows
        if after.flat[k] >= peak:
            break
        d = slot_cost[a] - slot_cost[c]
        load[top] -= d
        load[slot_rank[c]] += d
        slot_cost[a], slot_cost[c] = slot_cost[c], slot_cost[a]
        at[a], at[c] = at[c], at[a]
    slot_of = np.empty(rows, dtype=np.int64)
    slot_of[at] = np.arange(rows)
    return slot_of[row]
