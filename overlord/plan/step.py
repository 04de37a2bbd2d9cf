"""One step's plan from plain data: which items form it, and each one's rank and row.

:func:`plan_step` selects a step's items from each source's window (mixing,
DP-independent: :mod:`overlord.plan.select`), prices them with the cost
model (the LLM's and the encoder's, per CP rank: :mod:`overlord.plan.hybrid`),
balances them over the DP ranks' rows (:mod:`overlord.plan.hierarchy`) and
returns the step as columns sorted by rank and row, with every rank's sums.
A rank's plan is then a slice of each column (:func:`rank_slice`), cut when
the rank asks: nothing is built ahead per rank.

It sees metadata only. A window is whatever holds a source's pending items:
their tokens for the selector, and the columns of the items it chose (the
planner's :class:`~overlord.roles.cursor.SourceCursor`, or an array in a
test). The windows and the mixture state are advanced past the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from overlord.plan.balance import lower_bound, rank_costs
from overlord.plan.columns import rank_sums, stable_order
from overlord.plan.cost import CostModel
from overlord.plan.hierarchy import Runner, assign_step, run_here, step_bound
from overlord.plan.hybrid import assign_modules, module_costs
from overlord.plan.mesh import resolved_layout
from overlord.plan.select import MixState, Window, select_items
from overlord.plan.spec import Plan

# what the plan needs of each chosen item, taken from its window: the rows of the array a
# window's take answers, the item's key (its three parts) first
TAKEN_ROWS = ("epoch", "shard_pos", "index", "tokens", "loader", "file_index", "row", "chunk",
              "patches")  # fmt: skip
# what a rank's plan holds of the step's columns
RANK_COLUMNS = ("source", "tokens", "row", "loader", "key", "file_index", "chunk", "rec_row")
# what a rank's plan sums of the step's columns, and where the step keeps every rank's sum
SUMS = {c: f"{c}_by_rank" for c in ("cost", "cost_llm", "cost_encoder")}


class StepWindow(Window, Protocol):
    """A source's pending items, which also hands out the columns of the ones chosen."""

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Remove pending items ``indices``; their columns, in that order.

        One int64 array, a row per column of :data:`TAKEN_ROWS`
        (:func:`taken_columns` names them).
        """
        ...


@dataclass(frozen=True)
class StepColumns:
    """One step's plan.

    ``columns``: the step's items sorted by rank and row (``source``,
    ``tokens``, ``row`` within its rank, ``cost``, the taken columns with the
    record's row as ``rec_row``), ``bounds`` (rank ``r``'s items are
    ``bounds[r]:bounds[r + 1]``) and every rank's sums (``cost_by_rank``...).
    ``rank_cost``: each DP rank's predicted cost. ``stats``: what the
    planner's history keeps of the step (mixture, balance, fill).
    """

    columns: dict[str, np.ndarray]
    rank_cost: np.ndarray
    stats: dict[str, Any]


def _parts(llm: np.ndarray, enc: np.ndarray) -> tuple[tuple[str, np.ndarray], ...]:
    """Per-rank cost terms a vision plan's history keeps (overlord.plan.hybrid)."""
    return (("rank_cost_llm", llm), ("rank_cost_encoder", enc))


def take_columns(
    windows: Sequence[StepWindow], source: np.ndarray, pending: np.ndarray
) -> dict[str, np.ndarray]:
    """Take the chosen items from their windows: what the plan needs, in selection order.

    ``source[i]`` and ``pending[i]``: the window of the ``i``-th chosen item,
    and its index among that window's pending items. The windows' answers are
    joined and placed in the selection's order as one array, not column by column.
    """
    if len(source) and (source == source[0]).all():  # one window gave every item: in order
        rows = windows[int(source[0])].take(pending)
    else:
        # each window's chosen items, in selection order, by one sort: only the windows that
        # gave items are visited (a step of many sources takes from a few of them)
        order = np.argsort(source, kind="stable")
        ends = np.cumsum(np.bincount(source, minlength=len(windows))).tolist()
        parts, start = [], 0
        for s, end in enumerate(ends):
            if end > start:
                parts.append(windows[s].take(pending[order[start:end]]))
            start = end
        rows = np.empty((len(TAKEN_ROWS), len(source)), dtype=np.int64)
        if parts:
            rows[:, order] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return taken_columns(rows)


def taken_columns(rows: np.ndarray) -> dict[str, np.ndarray]:
    """A take's rows (:data:`TAKEN_ROWS`) by name, ``key`` as ``(n, 3)``: views, no copies.

    >>> cols = taken_columns(np.arange(18).reshape(9, 2))
    >>> cols["key"].tolist(), cols["tokens"].tolist()
    ([[0, 2, 4], [1, 3, 5]], [6, 7])
    """
    cols = dict(zip(TAKEN_ROWS[3:], rows[3:]))
    cols["key"] = rows[:3].T  # epoch, shard position, index
    return cols


def plan_step(
    plan: Plan,
    windows: Sequence[StepWindow],
    weights: np.ndarray,
    mix: MixState,
    cost: CostModel,
    groups: int = 1,
    run: Runner = run_here,
    furthest: bool = False,
    select: str | None = None,
) -> StepColumns:
    """Plan one step: its items from ``windows`` at mixture ``weights``, balanced over the ranks.

    ``mix``: the mixture's account so far (advanced by the step); ``groups``:
    groups of ranks balanced apart (:func:`overlord.plan.hierarchy.group_count`),
    by ``run`` (where the groups are balanced: here, or on assigners).
    ``furthest``: the statistics also give each source's furthest item
    (``"last"``, what ``overlord simulate`` counts epochs by); a sort of the
    step's items that a run does not need. ``select``: how the items are selected
    (:func:`overlord.plan.select.select_items`; None: as ``OVERLORD_SELECT`` says now).
    """
    p = plan
    sel = select_items(
        windows, weights, mix, p.rows_per_step, p.batch.max_seq_len, p.batch.lookahead, select
    )
    n = len(sel.source)
    src, tokens, ref_row, pending = (
        np.fromiter(x, dtype=np.int64, count=n)
        for x in (sel.source, sel.tokens, sel.ref_row, sel.pending_index)
    )
    taken = take_columns(windows, src, pending)

    # what each item costs one rank of its DP group's CP ranks (overlord.plan.cp)
    cp, layout = p.world.cp, resolved_layout(p.world.cp, p.batch.cp_layout)
    per_cp_rank = p.world.tokens_per_cp_rank  # cp: dynamic (cp is then cp_max)
    llm, enc = module_costs(cost, tokens, taken["patches"], cp, layout, per_cp_rank)
    item_cost = llm + enc  # the encoder's and the LLM's (overlord.plan.hybrid)
    dp, rows_per_rank, capacity = p.world.dp, p.rows_per_rank, p.batch.max_seq_len

    def assign_by(c: np.ndarray) -> np.ndarray:  # in groups of ranks past group_ranks
        def bound() -> float:
            # a CP group shares a document's cost: the bound's terms too (padding aside)
            alpha, beta = cost.alpha / cp, cost.beta / cp
            return step_bound(tokens, c, dp, rows_per_rank * capacity, alpha, beta)

        method = p.balance.method
        args = (tokens, c, ref_row, dp, rows_per_rank, capacity, method, groups)
        return assign_step(*args, bound, run)

    row = assign_modules(p.balance.modules, llm, enc, dp, rows_per_rank, assign_by)
    by_row = stable_order(row)  # items grouped by rank, rows in order
    cols = {
        "source": src[by_row],
        "tokens": tokens[by_row],
        "row": row[by_row] % rows_per_rank,  # within its rank
        "cost": item_cost[by_row],
        **{c: taken[c][by_row] for c in ("loader", "key", "file_index", "chunk")},
        "rec_row": taken["row"][by_row],
        "bounds": np.searchsorted(row[by_row], np.arange(dp + 1) * rows_per_rank),
    }
    if p.vision is not None:
        cols.update(cost_llm=llm[by_row], cost_encoder=enc[by_row])
    for c in SUMS:  # each rank's sums, computed at once: a rank's plan is then a slice
        if c in cols:
            cols[SUMS[c]] = rank_sums(cols[c], cols["bounds"])
    per_rank = rank_costs(item_cost, row, dp, rows_per_rank)
    # one rank: the baselines hold its whole step too, summed in the same order
    baseline = per_rank if dp == 1 else rank_costs(item_cost, ref_row, dp, rows_per_rank)
    equal_docs = float(per_rank[0]) if dp == 1 else equal_docs_max_cost(item_cost, dp)
    stats = {
        "tokens": np.bincount(src, weights=tokens, minlength=len(windows)).tolist(),
        "samples": np.bincount(src, minlength=len(windows)).tolist(),
        "weights": weights.tolist(),
        "max_cost": float(per_rank.max()),
        "mean_cost": float(per_rank.mean()),
        "baseline_max_cost": float(baseline.max()),
        "equal_docs_max_cost": equal_docs,
        "lower_bound": lower_bound(item_cost, dp),
        "fill": float(tokens.sum()) / p.batch.tokens_per_step,
        **(
            {c: rank_costs(x, row, dp, rows_per_rank).tolist() for c, x in _parts(llm, enc)}
            if p.vision is not None
            else {}
        ),
    }
    if furthest:
        stats["last"] = last_keys(src, taken["key"], len(windows))
    return StepColumns(cols, per_rank, stats)


def equal_docs_max_cost(cost: np.ndarray, dp: int) -> float:
    """The most loaded rank's cost under a loader that gives every rank the same number of items.

    The step's items in the order the mixture drew them, item ``i`` to rank
    ``i % dp`` (as a ``DistributedSampler`` strides), unpacked: each rank's
    count is within one of every other's, its tokens are whatever they add up
    to. The baseline "equal documents per rank" of ``benchmarks/balance_e2e.py``,
    on the step's own items.

    >>> equal_docs_max_cost(np.array([5.0, 1.0, 1.0, 1.0]), 2)
    6.0
    """
    if len(cost) == 0:
        return 0.0
    return float(np.bincount(np.arange(len(cost)) % dp, weights=cost, minlength=dp).max())


def last_keys(source: np.ndarray, key: np.ndarray, sources: int) -> list[list[int] | None]:
    """Per source, the furthest key ``[epoch, shard_pos, index]`` of its items; None: none taken.

    >>> last_keys(np.array([0, 0, 1]), np.array([[0, 2, 5], [1, 0, 3], [0, 0, 9]]), 3)
    [[1, 0, 3], [0, 0, 9], None]
    """
    out: list[list[int] | None] = [None] * sources
    if len(source):
        order = np.lexsort((key[:, 2], key[:, 1], key[:, 0], source))  # by source, then key
        ends = np.flatnonzero(np.diff(source[order], append=-1))  # each source's last
        for i in order[ends].tolist():
            out[int(source[i])] = [int(k) for k in key[i]]
    return out


def rank_slice(columns: dict[str, np.ndarray], rank: int) -> dict[str, Any]:
    """What rank ``rank``'s plan holds of a step's columns: its sums, and slices (no copies)."""
    bounds = columns["bounds"]
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    out: dict[str, Any] = {}
    for c, by_rank in SUMS.items():
        if by_rank in columns:
            out[c] = float(columns[by_rank][rank])
    for c in RANK_COLUMNS:  # slices: nothing built ahead
        out[c] = columns[c][lo:hi]
    return out


def ranks_slice(columns: dict[str, np.ndarray], first: int, count: int) -> dict[str, Any]:
    """:func:`rank_slice` of ranks ``first`` to ``first + count - 1`` at once.

    Their items are one slice of every column (a rank's items follow the
    previous rank's); ``bounds`` (``count + 1``) cuts it into each rank's, and
    each sum is an array of every rank's.
    """
    bounds = columns["bounds"][first : first + count + 1]
    lo, hi = int(bounds[0]), int(bounds[-1])
    out: dict[str, Any] = {"bounds": bounds - lo}
    for c, by_rank in SUMS.items():
        if by_rank in columns:
            out[c] = columns[by_rank][first : first + count]
    for c in RANK_COLUMNS:
        out[c] = columns[c][lo:hi]
    return out
