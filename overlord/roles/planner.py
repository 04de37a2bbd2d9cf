"""Planner: turns metadata into step plans, and owns the state a checkpoint holds.

For each step it selects the items (mixing, DP-independent), assigns them to
ranks and rows (balancing), and keeps the step's plan, as columns sorted by
rank and row, until every rank has consumed it; a rank's plan is a slice cut
when asked. It sees metadata only. Its loaders belong to its
:class:`~overlord.roles.loader_pool.LoaderPool`, which it asks for metadata
and hands what every rank consumed. Its state before each step is kept until
every rank consumed the step; with a journal (:mod:`overlord.state.journal`) a
restarted planner resumes there and re-plans the steps after it identically.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.errors import ActorDiedError, LoaderError, RanksApart
from overlord.monitor.figures import Figures
from overlord.monitor.prometheus import MetricsServer
from overlord.plan.balance import lower_bound, rank_costs
from overlord.plan.columns import rank_sums, stable_order
from overlord.plan.cost import CostModel
from overlord.plan.hierarchy import assign_step, group_count, step_bound
from overlord.plan.hybrid import assign_modules, module_costs
from overlord.plan.mesh import resolved_layout
from overlord.plan.schedule import Schedule
from overlord.plan.select import MixState, select_items
from overlord.plan.spec import BalanceMethod, Plan
from overlord.roles.api import LoaderRole, PlannerRole
from overlord.roles.assigner import Assigners
from overlord.roles.cursor import SourceCursor
from overlord.roles.loader_pool import LoaderPool, PoolConfig, partitions
from overlord.roles.monitoring import planner_figures
from overlord.roles.peers import PeerConsumption
from overlord.roles.rewind import TrainerRewind
from overlord.runtime.base import Handle, RoleOptions, Runtime
from overlord.sources.catalog import SourceFiles
from overlord.state import format as statefmt
from overlord.state.journal import Journal

log = logging.getLogger("overlord.planner")

HISTORY_STEPS = 100_000  # per-step statistics kept for reports
TRAIN_EMA = 0.2  # weight of the newest step in the trainer's step-time average
# what the planner needs of each chosen item, gathered from the cursors
_COLUMNS = ("key", "loader", "file_index", "row", "chunk", "patches")
# what a rank's plan holds of the step's columns
_RANK_COLUMNS = ("source", "tokens", "row", "loader", "key", "file_index", "chunk", "rec_row")
# what a rank's plan sums of the step's columns, and where the step keeps every rank's sum
_SUMS = {c: f"{c}_by_rank" for c in ("cost", "cost_llm", "cost_encoder")}


def _parts(llm: np.ndarray, enc: np.ndarray) -> tuple[tuple[str, np.ndarray], ...]:
    """Per-rank cost terms a vision plan's history keeps (overlord.plan.hybrid)."""
    return (("rank_cost_llm", llm), ("rank_cost_encoder", enc))


class Planner(PeerConsumption, TrainerRewind):  # overlord.roles.peers, overlord.roles.rewind
    """Plans steps on demand and tracks what each DP rank consumed.

    ``wait_for_ranks``: a rank too far ahead of the others is told to wait
    (None) when each rank is its own process; in one process that consumes
    every rank, waiting would never end, so it is an error instead.

    ``assigners``: how many assigner roles balance a step's groups (0: here;
    the wiring's ``assigner_count``).
    """

    def __init__(
        self,
        plan: Plan,
        files: dict[str, SourceFiles],
        runtime: Runtime,
        config: PoolConfig,
        state: dict[str, Any] | None = None,
        journal: str | None = None,
        wait_for_ranks: bool = False,
        pad_id: int = 0,
        assigners: int = 0,
    ):
        self.plan, self.files, self.pad_id = plan, files, pad_id
        self.wait_for_ranks = wait_for_ranks
        # asked at every rank's call for its plan: read once (a plan never changes)
        self._dp, self._rows_per_rank = plan.world.dp, plan.rows_per_rank
        self._ahead = plan.batch.prefetch_steps + 1
        self.names = plan.source_names
        self.schedule = Schedule(plan)
        self.cost = CostModel.from_spec(plan.balance.cost)
        # ranks are balanced in groups planned in parallel, on assigners (overlord.plan.hierarchy)
        self.groups = group_count(plan.world.dp, plan.balance.group_ranks)
        self.assigners = Assigners(
            runtime, assigners, RoleOptions(plan.placement.planner_cpus, 1, restartable=True)
        )
        self._files = {n: files[n].record() for n in self.names}  # constant for the job
        self._train_s: float | None = None  # moving average of the trainer's step time
        self.figures = Figures(self.names, plan.world.dp)  # what monitoring shows
        self._metrics: MetricsServer | None = None
        self.journal = Journal(journal, plan.recovery.fsync) if journal is not None else None
        recovered = self.journal.resume(self.schedule.named) if self.journal else None
        self.pool = LoaderPool(
            *(plan, files, runtime, config),
            consumed=self._consumed_cursor,
            clock=lambda: self.next_step,
            journal=self.journal,
        )
        self._build(recovered.state if recovered is not None else state)
        self._started = recovered is not None and recovered.loaders is not None
        if recovered is not None:
            for problem in recovered.problems:
                log.error("%s", problem)
            log.warning("planner restarted from its journal at step %d", recovered.step)
            if recovered.loaders is not None:
                self.pool.restore(recovered.loaders)
            self.pool.events.append(recovered.event())
            self.pool.rewind({n: self._consumed_cursor(n) for n in self.names})
            try:  # a restarted planner serves its metrics again (start is not called again)
                self._serve_metrics()
            except LoaderError as e:
                log.error("%s", e)

    def _serve_metrics(self) -> None:
        port = self.plan.monitoring.port
        if port is not None and self._metrics is None:
            self._metrics = MetricsServer(port, self.monitor)

    def start(self) -> None:
        """Spawn the loaders (a restarted planner found its own in the journal); serve metrics.

        Not in the constructor: a runtime restarts a planner whose constructor
        failed, forever; an error here is the caller's to see.
        """
        self._serve_metrics()
        if self._started:
            return
        self.pool.start()
        self._started = True
        if self.journal is not None:
            self.journal.snapshot(self._snapshot(), self.start_step - 1, self.pool.record())

    def _build(self, state: dict[str, Any] | None) -> None:
        sources = (state or {}).get("sources", {})
        self.cursors = [
            SourceCursor(
                n,
                lambda epoch, n=n: len(self.files[n].at(epoch)),  # type: ignore[misc]
                lambda k, n=n: self.pool.metadata(n, k, self.plan.loading.timeout_s),  # type: ignore[misc]
                lambda n=n: partitions(self.pool.parts[n]),  # type: ignore[misc]
                sources.get(n, {}).get("cursor"),
            )
            for n in self.names
        ]
        self.mix = MixState(
            np.array([float(sources.get(n, {}).get("target", 0.0)) for n in self.names]),
            np.array([float(sources.get(n, {}).get("placed", 0.0)) for n in self.names]),
        )
        self.start_step = int((state or {}).get("step", 0))
        self.next_step = self.start_step
        self.consumed = [self.start_step - 1] * self.plan.world.dp
        # the step every rank consumed, and how many ranks are still there: kept as ranks
        # move, so that a step's calls cost O(1) each, not O(dp)
        self.done, self._at_done = self.start_step - 1, self.plan.world.dp
        self.plans: dict[int, dict[str, Any]] = {}  # step -> its columns, by rank and row
        self.snapshots: dict[int, dict[str, Any]] = {self.start_step: self._snapshot()}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_STEPS)

    # ---- state -----------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {
            "step": self.next_step,
            "sources": {
                n: {
                    "fingerprint": self.plan.source_fingerprint(n),
                    "cursor": c.state(),
                    "target": float(self.mix.target[i]),
                    "placed": float(self.mix.placed[i]),
                    "files": self._files[n],
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
            step = self.done + 1
        self.checkpointed(step)  # a state handed out: trainers may rewind the job to it
        while self.next_step < step and step > max(self.snapshots):
            # not planned here yet (a rank received it from batches built before a rewind):
            # the state of a later step is the plan's, so plan up to it
            self._plan_next()
        if step not in self.snapshots:
            raise LoaderError(
                f"no state for step {step}: states are kept from step {min(self.snapshots)} "
                f"to {max(self.snapshots)} (steps not yet consumed by every rank)"
            )
        return {
            "version": statefmt.STATE_VERSION,
            "fingerprint": self.plan.stream_fingerprint(),
            **self.snapshots[step],
        }

    def _consumed_step(self) -> int:
        """The step after the last one every rank consumed (or the next to plan, if earlier).

        A restarted planner may learn that ranks consumed steps it has not
        re-planned yet; its state is then the one before the next step to plan.
        """
        return min(self.done + 1, self.next_step)

    def _consumed_cursor(self, source: str) -> dict[str, Any]:
        """Where ``source``'s order stands once every rank consumed what it received."""
        cursor: dict[str, Any] = self.snapshots[self._consumed_step()]["sources"][source]["cursor"]
        return cursor

    # ---- planning --------------------------------------------------------------------------

    def _plan_next(self) -> None:
        p = self.plan
        step = self.next_step
        t0 = time.perf_counter()
        weights = self.schedule.weights(step)
        sel = select_items(
            self.cursors, weights, self.mix, p.rows_per_step, p.batch.max_seq_len, p.batch.lookahead
        )
        n = len(sel.source)
        src, tokens, ref_row, pending = (
            np.fromiter(x, dtype=np.int64, count=n)
            for x in (sel.source, sel.tokens, sel.ref_row, sel.pending_index)
        )
        cols = self._take(src, pending)

        # what each item costs one rank of its DP group's CP ranks (overlord.plan.cp)
        cp, layout = p.world.cp, resolved_layout(p.world.cp, p.batch.cp_layout)
        per_cp_rank = p.world.tokens_per_cp_rank  # cp: dynamic (cp is then cp_max)
        llm, enc = module_costs(self.cost, tokens, cols["patches"], cp, layout, per_cp_rank)
        cost = llm + enc  # the encoder's and the LLM's (overlord.plan.hybrid)
        dp, rpr, cap = p.world.dp, p.rows_per_rank, p.batch.max_seq_len

        def assign_by(c: np.ndarray) -> np.ndarray:  # in groups of ranks past group_ranks
            return assign_step(
                *(tokens, c, ref_row, dp, rpr, cap, p.balance.method, self.groups),
                # a CP group shares a document's cost: the bound's terms too (padding aside)
                lambda: step_bound(
                    tokens, c, dp, rpr * cap, *(self.cost.alpha / cp, self.cost.beta / cp)
                ),
                self.assigners.run,
            )

        row = assign_modules(p.balance.modules, llm, enc, dp, rpr, assign_by)
        by_row = stable_order(row)  # items grouped by rank, rows in order
        self.plans[step] = {
            "source": src[by_row],
            "tokens": tokens[by_row],
            "row": row[by_row] % rpr,  # within its rank
            "cost": cost[by_row],
            **{c: cols[c][by_row] for c in ("loader", "key", "file_index", "chunk")},
            "rec_row": cols["row"][by_row],
            "bounds": np.searchsorted(row[by_row], np.arange(dp + 1) * rpr),
        }
        cols = self.plans[step]
        if p.vision is not None:
            cols.update(cost_llm=llm[by_row], cost_encoder=enc[by_row])
        for c in _SUMS:  # each rank's sums, computed at once: a rank's plan is then a slice
            if c in cols:
                cols[_SUMS[c]] = rank_sums(cols[c], cols["bounds"])
        per_rank = rank_costs(cost, row, dp, rpr)
        baseline = rank_costs(cost, ref_row, dp, rpr)
        self.figures.planned(step, time.perf_counter() - t0, per_rank)
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
                **(
                    {c: rank_costs(x, row, dp, rpr).tolist() for c, x in _parts(llm, enc)}
                    if p.vision is not None
                    else {}
                ),
            }
        )
        self.next_step += 1
        self.snapshots[self.next_step] = self._snapshot()
        journaled = self.journal is not None and self.journal.planned(
            step, self.snapshots[step], self.snapshots[step + 1]
        )  # a re-planned step is checked against the journal instead
        if journaled and self.next_step % p.recovery.snapshot_every == 0:
            assert self.journal is not None
            self.journal.snapshot(self._snapshot(), self.done, self.pool.record())
        if step <= self.done:
            # a restarted planner re-plans a step every rank had consumed already
            self._release(self.plans.pop(step))
            self._prune()

    def _take(self, src: np.ndarray, pending: np.ndarray) -> dict[str, np.ndarray]:
        """Take the chosen items from their cursors: what the plan needs, in selection order."""
        cols = {c: np.empty(len(src), dtype=np.int64) for c in _COLUMNS if c != "key"}
        cols["key"] = np.empty((len(src), 3), dtype=np.int64)
        for s, cursor in enumerate(self.cursors):
            mine = np.flatnonzero(src == s)
            if len(mine):
                taken = cursor.take(pending[mine])
                for c in _COLUMNS:
                    cols[c][mine] = taken[c]
        return cols

    def rank_plan(self, step: int, rank: int) -> dict[str, Any] | None:
        """The plan of one rank for one step, planning up to it if needed.

        None means "ask again later": other ranks must consume first.
        """
        dp = self._dp
        if not 0 <= rank < dp:
            raise LoaderError(f"rank {rank} is outside the plan's world (dp={dp})")
        lag = self.done
        if step > lag + self._ahead:
            if self.wait_for_ranks:
                return None
            slow = self.consumed.index(lag)
            raise RanksApart(
                f"rank {rank} asked for step {step} while rank {slow} has consumed only up to "
                f"step {lag}: ranks may run at most batch.prefetch_steps+1={self._ahead} steps "
                "apart (consume every rank's batch of a step before the next step)"
            )
        if step < self.start_step or step <= self.consumed[rank] and step not in self.plans:
            raise LoaderError(f"step {step} of rank {rank} was consumed already")
        while self.next_step <= step:
            self._plan_next()
        cols = self.plans[step]
        bounds = cols["bounds"]
        lo, hi = int(bounds[rank]), int(bounds[rank + 1])
        out: dict[str, Any] = {"step": step, "rank": rank, "rows": self._rows_per_rank}
        for c, by_rank in _SUMS.items():
            if by_rank in cols:
                out[c] = float(cols[by_rank][rank])
        for c in _RANK_COLUMNS:  # slices: nothing built ahead
            out[c] = cols[c][lo:hi]
        return out

    def dry_run(self, steps: int) -> list[dict[str, Any]]:
        """Plan ``steps`` steps without building batches; returns their statistics."""
        out = []
        for _ in range(steps):
            self._plan_next()
            self.plans.pop(self.next_step - 1)
            self.snapshots.pop(self.next_step - 1, None)
            out.append(self.history[-1])
        return out

    def mark_consumed(
        self,
        rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """Record that ``rank`` received step ``step``; release what every rank has consumed.

        ``train_s`` is the time the trainer spent on its last step before asking
        for this one (not waiting for data): the autoscaler's demand. ``wait_s``
        is how long it waited for this one (monitoring). ``since`` is the step
        the sender's client started at: a notice of a client that started
        before the last rewind comes from a trainer that was killed (it arrives
        late, one-way) and is dropped.
        """
        if self.stale(since):
            return
        self.figures.trainer(rank, step, train_s, wait_s)
        if train_s is not None and train_s >= 0:
            old = self._train_s
            self._train_s = train_s if old is None else old + TRAIN_EMA * (train_s - old)
        before, was = self.done, self.consumed[rank]
        if step <= was:
            return
        self.consumed[rank] = step
        if was == before:
            self._at_done -= 1
            if self._at_done == 0:  # the last rank at the old minimum moved: once per step
                self.done = min(self.consumed)
                self._at_done = self.consumed.count(self.done)
        done = self.done
        if done <= before:
            return
        if self.journal is not None:
            self.journal.consumed(done)  # before the loaders forget the items
        for s in range(before + 1, done + 1):
            if s in self.plans:  # (a restarted planner may not have re-planned it yet)
                self.figures.consumed(self.plans[s]["source"], self.plans[s]["tokens"])
        keep = self.keep_from(done + 1)  # steps kept for trainers that rewind
        for s in sorted(s for s in self.plans if s < keep):
            self._release(self.plans.pop(s))
        self._prune()
        self.pool.retire()
        every = self.plan.autoscale.every
        if self._train_s and (done + 1) // every > (before + 1) // every:
            try:
                self.pool.autoscale(done + 1, self._train_s, self.schedule.weights)
            except ActorDiedError as e:  # a loader died: decide next time, after its failover
                log.warning("autoscaler skipped a decision at step %d: %s", done + 1, e)

    def _prune(self) -> None:
        first = self.keep_from(self._consumed_step())
        for s in [s for s in self.snapshots if s < first]:
            del self.snapshots[s]

    def _release(self, cols: dict[str, Any]) -> None:
        self.pool.release(cols["source"], cols["loader"], cols["key"])

    # ---- what the other roles ask ----------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """What a trainer that connects needs: the plan, its files and loaders, the ranks."""
        return {
            "plan": self.plan.model_dump(mode="json"),
            "base_dir": str(self.plan.base_dir),
            "files": dict(self._files),
            "loaders": {n: self.pool.primaries(n) for n in self.names},
            "dp": self.plan.world.dp,
            "ranks_per_constructor": self.plan.placement.ranks_per_constructor,
            "constructors": self.plan.placement.constructors.value,
            "pad_id": self.pad_id,
        }

    def position(self, rank: int) -> int:
        """The next step ``rank`` should consume."""
        return self.consumed[rank] + 1

    def failover(self, source: str, k: int, dead: str) -> Handle[LoaderRole]:
        """Replace the dead primary ``dead`` of slot ``k`` of ``source``; the new primary."""
        return self.pool.failover(source, k, dead)

    def primaries(self, source: str) -> list[Handle[LoaderRole] | None]:
        """The primary of every slot of ``source`` (a constructor meets a new partition)."""
        return self.pool.primaries(source)

    def slots(self) -> dict[str, list[list[Handle[LoaderRole]]]]:
        """Every slot's replicas, primary first, per source (to watch or kill them)."""
        return {n: [list(slot) for slot in slots] for n, slots in self.pool.slots.items()}

    def repartition(self, source: str, count: int) -> list[int] | None:
        """Read ``source`` with ``count`` loaders from a shard boundary on; the boundary."""
        at = self.pool.repartition(source, count)
        return None if at is None else list(at)

    def set_threads(self, source: str, threads: int) -> None:
        """Reader threads of every current loader of ``source``."""
        self.pool.set_threads(source, threads)

    # ---- the rest --------------------------------------------------------------------------

    def pid(self) -> int:
        """The process the planner runs in (chaos tests kill it)."""
        return os.getpid()

    def metrics_url(self) -> str | None:
        """Where the Prometheus endpoint is (None: ``monitoring.port`` is not set)."""
        return None if self._metrics is None else self._metrics.url

    def monitor(self) -> dict[str, Any]:
        """What monitoring shows (:func:`overlord.roles.monitoring.planner_figures`)."""
        return planner_figures(self)

    def epoch_of(self, source: str) -> int:
        """The epoch of ``source`` that the trainers consume."""
        return int(self._consumed_cursor(source)["epoch"])

    def close(self) -> None:
        """Stop serving metrics; close the journal (kept: only the job's owner removes it)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.journal is not None:
            self.journal.close()

    def stats(self) -> dict[str, Any]:
        """Per-step history (mixture, balance), where each rank is, faults and the journal."""
        return {
            "sources": self.names,
            "history": list(self.history),
            "consumed": list(self.consumed),
            "method": BalanceMethod(self.plan.balance.method).value,
            "events": list(self.pool.events),
            "scaling": list(self.pool.scaling),
            "journal": self.journal.stats() if self.journal is not None else None,
            "loaders": self.pool.stats(),
            "autoscaler": self.pool.scaling_state(),
        }


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[PlannerRole] = Planner
