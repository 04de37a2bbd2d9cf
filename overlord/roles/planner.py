"""Planner: turns metadata into step plans, and owns the state a checkpoint holds.

For each step it selects the items (mixing, DP-independent), assigns them to
ranks and rows (balancing), and keeps the plan until every rank has consumed
it. It sees metadata only; payloads go from loaders to constructors.

Its state before each step is snapshotted (a few numbers per source), so that
``state_dict()`` can describe exactly the last step every rank consumed.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from overlord.errors import LoaderError
from overlord.plan.balance import assign, lower_bound, rank_costs
from overlord.plan.cost import CostModel
from overlord.plan.schedule import Schedule
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod, validate_plan
from overlord.roles.cursor import SourceCursor
from overlord.runtime.base import Handle, Runtime
from overlord.sources.files import resolve_files

STATE_VERSION = 1
HISTORY_STEPS = 100_000  # per-step statistics kept for reports


class Planner:
    """Plans steps on demand and tracks what each DP rank consumed."""

    def __init__(
        self,
        plan_data: dict[str, Any],
        base_dir: str,
        loaders: dict[str, list[Handle]],
        runtime: Runtime,
        state: dict[str, Any] | None = None,
        wait_for_ranks: bool = False,
    ):
        # False: a rank too far ahead of the others is an error (one process consumes
        # every rank, so waiting would never end). True: it is told to wait (None).
        self.wait_for_ranks = wait_for_ranks
        self.plan_data, self.base_dir, self.loaders = plan_data, base_dir, loaders
        self.plan = validate_plan(plan_data, base_dir=base_dir)
        self.names = self.plan.source_names
        self.schedule = Schedule(self.plan)
        self.cost = CostModel.from_spec(self.plan.balance.cost)
        self.file_names = {
            s.name: [sh.name for sh in resolve_files(s, self.plan.base_dir)]
            for s in self.plan.sources
        }
        sources = (state or {}).get("sources", {})
        self.cursors = [
            SourceCursor(
                s.name,
                len(self.file_names[s.name]),
                loaders[s.name],
                runtime,
                self.plan.loading.timeout_s,
                sources.get(s.name, {}).get("cursor"),
            )
            for s in self.plan.sources
        ]
        self.mix = MixState(
            np.array([float(sources.get(n, {}).get("target", 0.0)) for n in self.names]),
            np.array([float(sources.get(n, {}).get("placed", 0.0)) for n in self.names]),
        )
        self.start_step = int((state or {}).get("step", 0))
        self.next_step = self.start_step
        dp = self.plan.world.dp
        self.consumed = [self.start_step - 1] * dp
        self.plans: dict[int, list[dict[str, Any]]] = {}
        self.snapshots: dict[int, dict[str, Any]] = {self.start_step: self._snapshot()}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_STEPS)

    # ---- state -----------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {
            "step": self.next_step,
            "sources": {
                n: {
                    "fingerprint": self.plan.source_fingerprint(n, self.file_names[n]),
                    "cursor": c.state(),
                    "target": float(self.mix.target[i]),
                    "placed": float(self.mix.placed[i]),
                }
                for i, (n, c) in enumerate(zip(self.names, self.cursors))
            },
        }

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """State before ``step`` (JSON-serializable).

        By default ``step`` is the one after the last step every rank consumed.
        A rank may ask for the state at its own position (synchronous training
        has every rank there when it checkpoints), which does not wait for the
        other ranks' consumption notices to arrive.
        """
        if step is None:
            step = min(self.consumed) + 1
        if step not in self.snapshots:
            raise LoaderError(
                f"no state for step {step}: states are kept from step {min(self.snapshots)} "
                f"to {max(self.snapshots)} (steps not yet consumed by every rank)"
            )
        return {
            "version": STATE_VERSION,
            "fingerprint": self.plan.stream_fingerprint(),
            **self.snapshots[step],
        }

    # ---- planning --------------------------------------------------------------------------

    def _plan_next(self) -> None:
        p = self.plan
        step = self.next_step
        weights = self.schedule.weights(step)
        sel = select_step(
            self.cursors, weights, self.mix, p.rows_per_step, p.batch.max_seq_len, p.batch.lookahead
        )
        src = np.asarray(sel.source, dtype=np.int64)
        tokens = np.asarray(sel.tokens, dtype=np.int64)
        ref_row = np.asarray(sel.ref_row, dtype=np.int64)
        # gather what the plan needs of every chosen item, in selection order
        cols: dict[str, list[Any]] = {}
        order = np.empty(len(src), dtype=np.int64)
        filled = 0
        for s, cursor in enumerate(self.cursors):
            mine = np.flatnonzero(src == s)
            if len(mine) == 0:
                continue
            got = cursor.take([sel.pending_index[j] for j in mine.tolist()])
            for k, v in got.items():
                cols.setdefault(k, []).extend(v)
            order[filled : filled + len(mine)] = mine
            filled += len(mine)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        keys = np.asarray(cols["key"], dtype=np.int64).reshape(-1, 3)[inverse]
        loader = np.asarray(cols["loader"], dtype=np.int64)[inverse]
        file_index = np.asarray(cols["file_index"], dtype=np.int64)[inverse]
        rec_row = np.asarray(cols["row"], dtype=np.int64)[inverse]
        chunk = np.asarray(cols["chunk"], dtype=np.int64)[inverse]
        patches = np.asarray(cols["patches"], dtype=np.int64)[inverse]

        cost = self.cost.cost(tokens, patches)
        dp, rpr = p.world.dp, p.rows_per_rank
        row = assign(tokens, cost, ref_row, dp, rpr, p.batch.max_seq_len, p.balance.method)
        rank_plans = []
        by_row = np.argsort(row, kind="stable")  # items grouped by rank, rows in order
        bounds = np.searchsorted(row[by_row], np.arange(dp + 1) * rpr)
        for r in range(dp):
            mine = by_row[bounds[r] : bounds[r + 1]]
            rank_plans.append(
                {
                    "step": step,
                    "rank": r,
                    "rows": rpr,
                    "source": src[mine],
                    "loader": loader[mine],
                    "key": keys[mine],
                    "tokens": tokens[mine],
                    "row": row[mine] - r * rpr,
                    "file_index": file_index[mine],
                    "rec_row": rec_row[mine],
                    "chunk": chunk[mine],
                    "cost": float(cost[mine].sum()),
                }
            )
        self.plans[step] = rank_plans
        per_rank = rank_costs(cost, row, dp, rpr)
        baseline = rank_costs(cost, ref_row, dp, rpr)
        self.history.append(
            {
                "step": step,
                "tokens": np.bincount(src, weights=tokens, minlength=len(self.names)).tolist(),
                "weights": weights.tolist(),
                "max_cost": float(per_rank.max()),
                "mean_cost": float(per_rank.mean()),
                "baseline_max_cost": float(baseline.max()),
                "lower_bound": lower_bound(cost, dp),
                "fill": float(tokens.sum()) / p.batch.tokens_per_step,
            }
        )
        self.next_step += 1
        self.snapshots[self.next_step] = self._snapshot()

    def rank_plan(self, step: int, rank: int) -> dict[str, Any] | None:
        """The plan of one rank for one step, planning up to it if needed.

        None means "ask again later": other ranks must consume first.
        """
        dp = self.plan.world.dp
        if not 0 <= rank < dp:
            raise LoaderError(f"rank {rank} is outside the plan's world (dp={dp})")
        lag = min(self.consumed)
        ahead = self.plan.batch.prefetch_steps + 1
        if step > lag + ahead:
            if self.wait_for_ranks:
                return None
            slow = self.consumed.index(lag)
            raise LoaderError(
                f"rank {rank} asked for step {step} while rank {slow} has consumed only up to "
                f"step {lag}: ranks may run at most batch.prefetch_steps+1={ahead} steps apart "
                "(consume every rank's batch of a step before the next step)"
            )
        if step < self.start_step or step <= self.consumed[rank] and step not in self.plans:
            raise LoaderError(f"step {step} of rank {rank} was consumed already")
        while self.next_step <= step:
            self._plan_next()
        return self.plans[step][rank]

    def layout(self) -> dict[str, Any]:
        """What a trainer that connects needs: the plan, its loaders, where constructors run."""
        return {
            "plan": self.plan_data,
            "base_dir": self.base_dir,
            "loaders": self.loaders,
            "dp": self.plan.world.dp,
            "ranks_per_constructor": self.plan.placement.ranks_per_constructor,
            "constructors": self.plan.placement.constructors.value,
        }

    def position(self, rank: int) -> int:
        """The next step ``rank`` should consume."""
        return self.consumed[rank] + 1

    def dry_run(self, steps: int) -> list[dict[str, Any]]:
        """Plan ``steps`` steps without building batches; returns their statistics."""
        out = []
        for _ in range(steps):
            self._plan_next()
            self.plans.pop(self.next_step - 1)
            self.snapshots.pop(self.next_step - 1, None)
            out.append(self.history[-1])
        return out

    def mark_consumed(self, rank: int, step: int) -> None:
        """Record that ``rank`` received step ``step``; free what every rank has consumed."""
        self.consumed[rank] = max(self.consumed[rank], step)
        done = min(self.consumed)
        for s in [s for s in self.plans if s <= done]:
            del self.plans[s]
        for s in [s for s in self.snapshots if s <= done]:
            del self.snapshots[s]

    def stats(self) -> dict[str, Any]:
        """Per-step history (mixture, balance) and where each rank is."""
        return {
            "sources": self.names,
            "history": list(self.history),
            "consumed": list(self.consumed),
            "method": BalanceMethod(self.plan.balance.method).value,
        }
