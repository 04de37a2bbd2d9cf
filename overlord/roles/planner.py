"""Planner: turns metadata into step plans, and owns the state a checkpoint holds.

For each step it selects the items (mixing, DP-independent), assigns them to
ranks and rows (balancing), and keeps the step's plan, as columns sorted by
rank and row, until every rank has consumed it; a rank's plan is a slice cut
when asked. It sees metadata only. Its loaders belong to its
:class:`~overlord.roles.loader_pool.LoaderPool`, which it asks for metadata
and hands what every rank consumed. Its state before each step is kept until
every rank consumed the step; with a journal (:mod:`overlord.state.journal`) a
restarted planner resumes there and re-plans the steps after it identically.

The planner is composed of parts that each own their state: where planning
stands (its cursors and mixture, here), the states kept before each step
(:class:`~overlord.roles.ledger.Ledger`), what each rank consumed and the
rewinds of trainers that restart (:class:`~overlord.roles.consumption.Consumption`),
its loaders (:class:`~overlord.roles.loader_pool.LoaderPool`), its
monitoring counters (:class:`~overlord.monitor.figures.Figures`) and the
trainers' reports, with the refits and adaptations they bring
(:class:`~overlord.roles.feedback.Feedback`). It serves
three Protocols of :mod:`overlord.roles.api`: planning and consumption
(``PlannerRole``), the loaders (``PoolRole``) and operations (``OpsRole``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.errors import ActorDiedError, LoaderError, RanksApart
from overlord.monitor.figures import Figures
from overlord.monitor.prometheus import MetricsServer
from overlord.plan.cost import CostModel
from overlord.plan.hierarchy import group_count
from overlord.plan.partition import partitions
from overlord.plan.quarantine import entry
from overlord.plan.schedule import Schedule
from overlord.plan.select import MixState, select_how
from overlord.plan.spec import BalanceMethod, Plan
from overlord.plan.step import plan_step, rank_slice, ranks_slice
from overlord.roles.api import LoaderRole, OpsRole, PlannerRole, PoolRole
from overlord.roles.assigner import Assigners
from overlord.roles.consumption import Consumption
from overlord.roles.cursor import SourceCursor
from overlord.roles.feedback import Feedback
from overlord.roles.ledger import Ledger
from overlord.roles.loader_pool import LoaderPool, PoolConfig
from overlord.roles.quarantine import Quarantine, collect_dropped
from overlord.roles.rewind import Stamps
from overlord.runtime.base import Handle, RoleOptions, Runtime, calls_made
from overlord.sources.catalog import SourceFiles
from overlord.state.changes import dropped_sources
from overlord.state.journal import Journal

log = logging.getLogger("overlord.planner")

# per-step statistics kept: what monitoring shows of recent steps; a run's report gathers
# them as the run goes (overlord.ops.run), so the planner's memory does not grow with it
HISTORY_STEPS = 4096


class Planner:
    """Plans steps on demand and tracks what each DP rank consumed.

    ``wait_for_ranks``: a rank too far ahead of the others is told to wait
    (None) when each rank is its own process; in one process that consumes
    every rank, waiting would never end, so it is an error instead. Such a
    job is also one that trainers reconnect to: it stamps the states it hands
    out (:mod:`overlord.roles.rewind`), its key kept beside its journal.

    ``assigners``: how many assigner roles balance a step's groups (0: here;
    the wiring's ``assigner_count``). ``keep_journal``: the journal keeps every
    segment (a run's journal kept for replays), not only the newest usable.
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
        keep_journal: bool = False,
    ):
        self.plan, self.files, self.pad_id = plan, files, pad_id
        # how it plans: in dry_run (its steps' statistics give the furthest items), and how it
        # selects a step's items (OVERLORD_SELECT, read and checked once)
        self._dry, self._select = False, select_how()
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
        self.figures = Figures(self.names, plan.world.dp)  # what monitoring shows
        self._metrics: MetricsServer | None = None
        self.journal = (
            Journal(journal, plan.recovery.fsync, keep_journal) if journal is not None else None
        )
        recovered = self.journal.resume(self.schedule.named) if self.journal else None
        # the trainers' reports; a restarted planner applies the decisions its journal recorded
        self.loop = Feedback(plan, self.cost, self.journal, self.figures)
        if recovered is not None:
            self.loop.recorded(recovered.replan)
        self.ledger = Ledger(plan, self._files)
        self.stamps = Stamps(journal) if wait_for_ranks else None  # states trainers rewind to
        self.consumption = Consumption(
            plan,
            self.figures,
            self.ledger,
            planned=lambda: self.next_step,
            settle=self._settle,
            rewind=self._rewind_to,
            stamps=self.stamps,
        )
        self.pool = LoaderPool(
            *(plan, files, runtime, config),
            consumed=self.consumption.consumed_cursor,
            clock=lambda: self.next_step,
            journal=self.journal,
        )
        self.quarantine = Quarantine(self.names, files)  # its additions, kept across rewinds
        self._build(recovered.state if recovered is not None else state)
        self._started = recovered is not None and recovered.loaders is not None
        if recovered is not None:
            for problem in recovered.problems:
                log.error("%s", problem)
            log.warning("planner restarted from its journal at step %d", recovered.step)
            if recovered.loaders is not None:
                self.pool.restore(recovered.loaders)
            self.pool.events.append(recovered.event())
            self.pool.rewind({n: self.consumption.consumed_cursor(n) for n in self.names})
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
        """Start planning from ``state`` (None: the plan's start), at its step."""
        sources = (state or {}).get("sources", {})
        self.cursors = [
            SourceCursor(
                n,
                partial(self._shards, n),
                partial(self._fetch, n),
                partial(self._partitions, n),
                sources.get(n, {}).get("cursor"),
            )
            for n in self.names
        ]
        self.loop.restore((state or {}).get("feedback"))
        self.mix = MixState(
            np.array([float(sources.get(n, {}).get("target", 0.0)) for n in self.names]),
            np.array([float(sources.get(n, {}).get("placed", 0.0)) for n in self.names]),
        )
        self.start_step = int((state or {}).get("step", 0))
        # a resume that removed sources drops their state and records it (overlord.state.changes)
        self.ledger.dropped = dropped_sources(state, self.plan) if state else []
        self.next_step = self.start_step
        q = self.quarantine
        q.merge((state or {}).get("quarantine", []), "the state's quarantine")
        if self.plan.quarantine is not None:  # resumed: from the resume step on, at the earliest
            q.merge([entry(self.plan.quarantine)], "the plan's quarantine", self.start_step)
        if q.entries:
            self._arm(self.start_step, fresh=True)
        self.consumption.restart(self.start_step)
        self.plans: dict[int, dict[str, Any]] = {}  # step -> its columns, by rank and row
        # step -> the quarantined items its planning took out of the cursors (released with it)
        self.dropped: dict[int, dict[str, np.ndarray]] = {}
        self.ledger.restart(self.start_step, self._snapshot())
        self.consumption.origin = self.ledger.at(self.start_step)
        # the first step whose items no loader has released: a rewind to an earlier state
        # has the loaders seek and read again, a rewind from here on is served from memory
        self.held_from = self.start_step
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_STEPS)

    # what a source's cursor asks: its shards, its loaders' metadata, its partitions

    def _shards(self, source: str, epoch: int) -> int:
        return len(self.files[source].at(epoch))

    def _fetch(self, source: str, k: int) -> list[dict[str, Any]]:
        return self.pool.metadata(source, k, self.plan.loading.timeout_s)

    def _partitions(self, source: str) -> list[tuple[tuple[int, int], int, int]]:
        return partitions(self.pool.parts[source])

    # ---- state -----------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        """The state before the next step to plan."""
        return self.ledger.mark(
            self.next_step, self.cursors, self.mix, self.loop.section(), self.quarantine.record()
        ).state()

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """State before ``step`` (JSON-serializable).

        By default ``step`` is the one after the last step every rank consumed.
        A rank may ask for the state at its own position (synchronous training
        has every rank there when it checkpoints), which does not wait for the
        other ranks' consumption notices to arrive.
        """
        if step is None:
            step = self.consumption.done + 1
        self.consumption.checkpointed(step)  # a state handed out: trainers may rewind to it
        while self.next_step < step and step > self.ledger.last:
            # not planned here yet (a rank received it from batches built before a rewind):
            # the state of a later step is the plan's, so plan up to it
            self._plan_next()
        state = self.ledger.state_dict(step)
        return state if self.stamps is None else self.stamps.stamp(state)

    # ---- planning --------------------------------------------------------------------------

    def _plan_next(self) -> None:
        """Plan the next step (:func:`overlord.plan.step.plan_step`); keep its columns and state."""
        p = self.plan
        step = self.next_step
        t0 = time.perf_counter()
        # the cost model and weights in force: the plan's, or as reports moved them
        cost, weights = self.loop.before(step, self.schedule.weights(step))
        if self.quarantine.due(step):  # an addition comes into force at this step
            self._arm(step)
        run = self.assigners.run
        planned = plan_step(
            p, self.cursors, weights, self.mix, cost, self.groups, run, self._dry, self._select
        )
        self.plans[step] = planned.columns
        if self.quarantine.entries:  # the items it took out go back with the step's
            dropped = collect_dropped(self.cursors)
            if dropped is not None:
                self.dropped[step] = dropped
        self.loop.planned(step, planned.columns, planned.rank_cost)
        self.loop.after(step, self.schedule.weights)  # what the next step is planned with
        self.figures.planned(step, time.perf_counter() - t0, planned.rank_cost)
        self.history.append({"step": step, **planned.stats})
        self.next_step += 1
        # the state after it: built now for a journal, else only if a checkpoint asks for it
        after = self.ledger.mark(
            self.next_step, self.cursors, self.mix, self.loop.section(), self.quarantine.record()
        )
        self.ledger.keep(self.next_step, after)
        journaled = self.journal is not None and self.journal.planned(
            step, self.ledger.at(step), self.ledger.at(self.next_step)
        )  # a re-planned step is checked against the journal instead
        done = self.consumption.done
        if journaled and self.next_step % p.recovery.snapshot_every == 0:
            assert self.journal is not None
            self.journal.snapshot(self._snapshot(), done, self.pool.record())
        if step <= done:
            # a restarted planner re-plans a step every rank had consumed already
            self._release(step)
            self.held_from = max(self.held_from, step + 1)
            self.consumption.prune()

    def rank_plan(self, step: int, rank: int) -> dict[str, Any] | None:
        """The plan of one rank for one step, planning up to it if needed.

        None means "ask again later": other ranks must consume first.
        """
        dp = self._dp
        if not 0 <= rank < dp:
            raise LoaderError(f"rank {rank} is outside the plan's world (dp={dp})")
        lag = self.consumption.done
        if step > lag + self._ahead:
            if self.wait_for_ranks:
                return None
            slow = self.consumption.positions().index(lag)
            raise RanksApart(
                f"rank {rank} asked for step {step} while rank {slow} has consumed only up to "
                f"step {lag}: ranks may run at most batch.prefetch_steps+1={self._ahead} steps "
                "apart (consume every rank's batch of a step before the next step)"
            )
        consumed = step < self.consumption.position(rank)
        if self.consumption.waits(rank):  # it reconnected: the others have not yet
            if self.wait_for_ranks:
                return None
            raise LoaderError(
                f"rank {rank} asked for step {step} while a rewind waits for every DP rank to "
                "reconnect with its state: reconnect every rank before reading"
            )
        if step < self.start_step or consumed and step not in self.plans:
            raise LoaderError(f"step {step} of rank {rank} was consumed already")
        while self.next_step <= step:
            self._plan_next()
        out: dict[str, Any] = {"step": step, "rank": rank, "rows": self._rows_per_rank}
        out.update(rank_slice(self.plans[step], rank))  # slices of the step's columns
        return out

    def ranks_plan(self, step: int, rank: int, first: int, count: int) -> dict[str, Any] | None:
        """The plans of ranks ``first`` to ``first + count - 1`` for ``step``, asked by ``rank``.

        One answer for a constructor that builds its ranks' batches together
        (:func:`overlord.plan.step.ranks_slice`); ``rank`` is checked as
        :meth:`rank_plan` checks it. None means "ask again later".
        """
        if first < 0 or count < 1 or first + count > self._dp:
            raise LoaderError(
                f"ranks {first}..{first + count - 1} are outside the plan's world (dp={self._dp})"
            )
        if self.rank_plan(step, rank) is None:
            return None
        out: dict[str, Any] = {"step": step, "first": first, "rows": self._rows_per_rank}
        out.update(ranks_slice(self.plans[step], first, count))
        return out

    def dry_run(self, steps: int) -> list[dict[str, Any]]:
        """Plan ``steps`` more steps without building batches; returns their statistics.

        Each step's items are released once planned, as if every rank had
        consumed it, so that the loaders read on within their budget.
        """
        out = []
        self._dry = True  # its statistics say how far each source read (plan_step's furthest)
        try:
            for _ in range(steps):
                self._plan_next()
                self._release(self.next_step - 1)  # the loaders read on
                self.ledger.forget(self.next_step - 1)
                out.append(self.history[-1])
        finally:
            self._dry = False
        return out

    # ---- consumption (overlord.roles.consumption) ------------------------------------------

    def mark_consumed(
        self,
        rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """Record that ``rank`` received step ``step``; release what every rank has consumed.

        ``train_s``: the trainer's time on its last step (the autoscaler's
        demand); ``wait_s``: its wait for this one; ``since``: the step its
        client started at (see :meth:`Consumption.mark_consumed`).
        """
        self.consumption.mark_consumed(rank, step, train_s, wait_s, since)

    def attach(self, global_rank: int) -> int:
        """Count ``global_rank`` among its DP rank's readers; the next step it should consume."""
        return self.consumption.attach(global_rank)

    def mark_rank_consumed(
        self,
        global_rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """``global_rank`` received ``step``; its DP rank's step is consumed once all peers have."""
        self.consumption.mark_rank_consumed(global_rank, step, train_s, wait_s, since)

    def report(
        self, rank: int, step: int, seconds: float, losses: dict[str, float] | None = None
    ) -> None:
        """DP rank ``rank``'s trainer took ``seconds`` on ``step`` (see roles.feedback)."""
        self.loop.report(rank, step, seconds, losses)

    def position(self, rank: int) -> int:
        """The next step ``rank`` should consume."""
        return self.consumption.position(rank)

    def reconnect(self, rank: int, state: dict[str, Any]) -> int:
        """DP rank ``rank`` restarted from ``state``: rewind the job there, with every rank."""
        return self.consumption.reconnect(rank, state)

    def waiting(self, rank: int, step: int, since: int | None = None) -> None:
        """A trainer of ``rank`` has waited a while for ``step``: it is alive."""
        self.consumption.waiting(rank, step, since)

    def rewound(self, rank: int) -> bool:
        """Whether DP rank ``rank`` may be served (False: its rewind waits for other ranks)."""
        return not self.consumption.waits(rank)

    def _settle(self, before: int, done: int) -> None:
        """Every rank consumed up to ``done`` (up to ``before`` until now).

        The journal records it, the steps no trainer can rewind to are
        released, and the pool retires and scales its loaders.
        """
        if self.journal is not None:
            self.journal.consumed(done)  # before the loaders forget the items
        for s in range(before + 1, done + 1):
            if s in self.plans:  # (a restarted planner may not have re-planned it yet)
                self.figures.consumed(self.plans[s]["source"], self.plans[s]["tokens"])
            if s in self.dropped:
                self.figures.quarantined(self.dropped[s]["source"])
        keep = self.consumption.keep_from(done + 1)  # steps kept for trainers that rewind
        for s in sorted(s for s in self.plans if s < keep):
            self._release(s)
        self.held_from = max(self.held_from, keep)
        self.consumption.prune()
        self.pool.retire()
        every = self.plan.autoscale.every
        train_s = self.consumption.train_s
        if train_s and (done + 1) // every > (before + 1) // every:
            try:
                self.pool.autoscale(done + 1, train_s, self.schedule.weights)
            except ActorDiedError as e:  # a loader died: decide next time, after its failover
                log.warning("autoscaler skipped a decision at step %d: %s", done + 1, e)

    def _rewind_to(self, state: dict[str, Any]) -> None:
        """Plan again from ``state`` (a state of this job): trainers rewound the job there.

        Items of steps from ``held_from`` on are still held: a rewind there is
        served from memory; to an earlier state, the loaders seek to it and
        read again (:meth:`overlord.roles.source_loader.SourceLoader.rewind`).
        """
        step = int(state["step"])
        seek = step < self.held_from
        history = [h for h in self.history if h["step"] < step]
        self._build(state)
        self.history.extend(history)
        # what each slot last sent is past the rewind: a shadow promoted now serves from the
        # cursor's own position (the pool asks the cursor, as after a planner restart)
        self.pool.forget_received()
        self.pool.rewind({n: self.consumption.consumed_cursor(n) for n in self.names}, seek)
        if self.journal is not None:  # a planner restarted later resumes from here
            self.journal.restart(self._snapshot(), step - 1, self.pool.record())
        how = "seek" if seek else "memory"
        self.pool.events.append({"event": "trainers-rewound", "step": step, "served_from": how})

    def _release(self, step: int) -> None:
        """Let the loaders drop what ``step`` placed, and what its planning quarantined."""
        cols = self.plans.pop(step)
        dropped = self.dropped.pop(step, None)
        if dropped is not None:  # in the same call per loader
            cols = {c: np.concatenate([cols[c], dropped[c]]) for c in ("source", "loader", "key")}
        self.pool.release(cols["source"], cols["loader"], cols["key"])

    # ---- the quarantine (overlord.roles.quarantine) ----------------------------------------

    def _arm(self, step: int, fresh: bool = False) -> None:
        """Give the cursors the quarantine in force at ``step`` (``fresh``: new cursors, all)."""
        changed = self.quarantine.arm(step)
        for s in range(len(self.cursors)) if fresh else changed:
            self.cursors[s].drop = self.quarantine.dropper(s)
            self.cursors[s].purge()

    def add_quarantine(
        self, ids: list[str], files: list[str], from_step: int | None = None
    ) -> dict[str, Any]:
        """Quarantine ``ids`` and the files of ``files`` from ``from_step``; what was added.

        ``from_step`` None: the first step not planned yet.

        A step already planned (planning runs ``batch.prefetch_steps`` ahead) is refused,
        naming the earliest step it can take effect.
        """
        added = self.quarantine.addition(ids, files, from_step, self.next_step, self.plan)
        new = self.quarantine.add(added)
        if new:
            self.ledger.quarantine(self.quarantine.record())
            if self.journal is not None:
                self.journal.quarantined(added)
        return {**added, "added": new, "entries": len(self.quarantine.entries)}

    # ---- the loaders (PoolRole) ------------------------------------------------------------

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

    # ---- operations (OpsRole) --------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """What a trainer that connects needs: the plan, its files and loaders, the ranks."""
        return {
            "plan": self.plan.model_dump(mode="json"),
            "base_dir": str(self.plan.base_dir),
            "files": dict(self._files),
            "loaders": {n: self.pool.primaries(n) for n in self.names},
            "dp": self.plan.world.dp,
            # a trainer that connects is on Ray, where the default is one rank per constructor
            "ranks_per_constructor": self.plan.placement.ranks_per_constructor or 1,
            "constructors": self.plan.placement.constructors.value,
            "pad_id": self.pad_id,
        }

    def stats(self) -> dict[str, Any]:
        """Per-step history (mixture, balance), where each rank is, faults and the journal."""
        return {
            "sources": self.names,
            "history": list(self.history),
            "consumed": self.consumption.positions(),
            "method": BalanceMethod(self.plan.balance.method).value,
            "events": list(self.pool.events),
            "scaling": list(self.pool.scaling),
            "journal": self.journal.stats() if self.journal is not None else None,
            "loaders": self.pool.stats(),
            "autoscaler": self.pool.scaling_state(),
            "feedback": self.loop.stats(),
            **self._quarantine_stats(),
            # the calls the planner's process sent to other processes (Ray), by method
            "calls": {"pid": os.getpid(), "by_method": calls_made()},
        }

    def _quarantine_stats(self) -> dict[str, Any]:
        """The quarantine's additions and the samples it skipped in consumed steps (if any)."""
        if not self.quarantine.entries:
            return {}
        samples = self.figures.as_dict()["quarantined"]
        return {"quarantine": {"entries": self.quarantine.record(), "samples": samples}}

    def monitor(self) -> dict[str, Any]:
        """Everything monitoring shows: the planner's figures, its pool's and its loaders'.

        Loader counters are asked of the current primaries; a loader that
        cannot answer (dying, being replaced) is left out of this reading.
        """
        out = self.figures.as_dict()
        stats = self._loader_stats()
        weights = self.loop.weights(self.schedule.weights(self.consumption.done + 1))
        weights = weights / max(float(weights.sum()), 1e-300)
        sources: dict[str, dict[str, Any]] = {}
        for i, n in enumerate(self.names):
            current = set(self.pool.current(n))
            mine = [s for s in stats if s["source"] == n]
            sources[n] = {
                "tokens": out["tokens"][n],
                "samples": out["samples"][n],
                "share": out["share"][n],
                "target_share": float(weights[i]),
                "epoch": int(self.consumption.consumed_cursor(n)["epoch"]),
                "loaders": len(current),
                "threads": sum(int(s["threads"]) for s in mine if s["slot"] in current),
                "buffered_tokens": sum(int(s.get("held_tokens", 0)) for s in mine),
                "reads_in_flight": sum(int(s.get("reads_in_flight", 0)) for s in mine),
                "skipped": sum(int(s.get("skipped", 0)) for s in mine),
                "retries": sum(int(s.get("read_retries", 0)) for s in mine),
                "quarantined": out["quarantined"][n],
            }
        events = list(self.pool.events)
        out["sources"] = sources
        out["failovers"] = {
            "loader": sum(e.get("event") == "failover" for e in events),
            "planner": sum(e.get("event") == "planner-recovered" for e in events),
        }
        out["consumed"] = self.consumption.positions()
        out["next_step"] = self.next_step
        return out

    def _loader_stats(self) -> list[dict[str, Any]]:
        """The counters of every primary that answers, with its slot."""
        stats: list[dict[str, Any]] = []
        for n in self.names:
            for k, h in enumerate(list(self.pool.primaries(n))):
                if h is None:
                    continue
                try:
                    s = h.call(LoaderRole.stats).result(timeout=10)
                except Exception:  # noqa: BLE001 - a dying loader: left out of this reading
                    continue
                stats.append({**s, "slot": k})
        return stats

    def feedback(self, step: int) -> dict[int, dict[str, float | None]] | None:
        """Each rank's predicted cost and reported seconds for ``step`` (None: not kept).

        ``{rank: {"seconds": s or None, "predicted": cost}}``; what a journal
        keeps of it, :func:`overlord.roles.feedback.reports` reads.
        """
        return self.loop.step_reports(step)

    def metrics_url(self) -> str | None:
        """Where the Prometheus endpoint is (None: ``monitoring.port`` is not set)."""
        return None if self._metrics is None else self._metrics.url

    def replay_point(self, step: int) -> dict[str, Any]:
        """What ``overlord replay`` of a live job needs to rebuild ``step`` where it runs.

        The plan, the state before ``step`` if the ledger still keeps it (None
        otherwise), the journal's folder (None: no journal) and the steps planned
        so far (``next_step``: the first not yet planned). Read only: nothing changes.
        """
        kept = step < self.next_step and self.ledger.kept(step) is not None
        return {
            "plan": self.plan.model_dump(mode="json"),
            "base_dir": str(self.plan.base_dir),
            "state": self.ledger.state_dict(step) if kept else None,
            "journal": None if self.journal is None else str(self.journal.directory),
            "first": self.start_step,
            "next_step": self.next_step,
        }

    def pid(self) -> int:
        """The process the planner runs in (chaos tests kill it)."""
        return os.getpid()

    def close(self) -> None:
        """Stop serving metrics; close the journal (kept: only the job's owner removes it)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.journal is not None:
            self.journal.close()


if TYPE_CHECKING:  # the class answers every call of its three roles
    _role: type[PlannerRole] = Planner
    _pool_role: type[PoolRole] = Planner
    _ops_role: type[OpsRole] = Planner
