"""Planner: turns metadata into step plans, and owns the state a checkpoint holds.

For each step it selects the items (mixing, DP-independent), assigns them to
ranks and rows (balancing), and keeps the plan until every rank has consumed
it. It sees metadata only; payloads go from loaders to constructors.

Its state before each step is snapshotted (a few numbers per source), so that
``state_dict()`` can describe exactly the last step every rank consumed.

Faults. The planner owns each loader *slot* (source, k): its primary and its
shadows. When a primary dies, whoever notices (the planner's cursor, or a
DataConstructor through :meth:`Planner.failover`) gets the next replica
promoted; a new shadow is started from the state every rank consumed, or,
without shadows, a new primary that reads that far again. With a journal
(:mod:`overlord.journal`), every planned step and every consumed step is
recorded before it takes effect, so a restarted planner resumes at the step
every rank consumed, re-plans the steps after it identically (and checks that
against the journal), and rewinds the loaders to serve those items again.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import time
import uuid
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from overlord.errors import ActorDiedError, LoaderError
from overlord.journal import Journal, recover
from overlord.plan.balance import assign, lower_bound, rank_costs
from overlord.plan.cost import CostModel
from overlord.plan.schedule import Schedule
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod, validate_plan
from overlord.roles.autoscaler import Autoscaler, Budget, SourceProfile
from overlord.roles.cursor import SourceCursor
from overlord.roles.loader_group import MemberHandle, replica_name
from overlord.roles.source_loader import SourceLoader, token_budget
from overlord.runtime.base import Handle, Runtime
from overlord.runtime.inline import DeadHandle
from overlord.sources.files import resolve_files

log = logging.getLogger("overlord.planner")

STATE_VERSION = 1
HISTORY_STEPS = 100_000  # per-step statistics kept for reports
TRAIN_EMA = 0.2  # weight of the newest step in the trainer's step-time average


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
        shadows: dict[str, list[list[Handle]]] | None = None,
        journal: str | None = None,
        keep_payloads: bool = True,
    ):
        # False: a rank too far ahead of the others is an error (one process consumes
        # every rank, so waiting would never end). True: it is told to wait (None).
        self.wait_for_ranks = wait_for_ranks
        self.plan_data, self.base_dir, self.runtime = plan_data, base_dir, runtime
        self.keep_payloads = keep_payloads
        self.plan = validate_plan(plan_data, base_dir=base_dir)
        self.names = self.plan.source_names
        self.schedule = Schedule(self.plan)
        self.cost = CostModel.from_spec(self.plan.balance.cost)
        self.file_names = {
            s.name: [sh.name for sh in resolve_files(s, self.plan.base_dir)]
            for s in self.plan.sources
        }
        # each loader slot: its primary, then its shadows in promotion order
        self.slots: dict[str, list[list[Handle]]] = {
            n: [[h, *((shadows or {}).get(n, [[]] * len(hs))[k])] for k, h in enumerate(hs)]
            for n, hs in loaders.items()
        }
        self.shadows = {n: len(slots[0]) - 1 for n, slots in self.slots.items()}
        # what each slot reads: loader ``loader`` of ``loaders``, from shard ``start`` to ``limit``
        self.parts: dict[str, list[Part]] = {
            n: [Part(k, len(hs), (0, 0), None) for k in range(len(hs))] for n, hs in loaders.items()
        }
        self.events: list[dict[str, Any]] = []  # failovers and recoveries, for the summary
        a = self.plan.autoscale
        self.scaler = None
        if a.cpus is not None:
            memory = math.inf if a.memory_gb is None else a.memory_gb * 2**30
            budget = Budget(a.cpus, memory, a.max_threads_per_loader, a.min_loaders)
            self.scaler = Autoscaler(
                budget,
                headroom=a.headroom,
                cooldown_steps=a.cooldown_steps,
                horizon_steps=a.horizon_steps,
            )
        self.scaling: list[dict[str, Any]] = []  # the autoscaler's decisions, with reasons
        # CPU seconds per token each source's loaders measured last: a source's cost, which
        # loaders just started by a re-partition have not measured yet
        self._cost: dict[str, float] = {}
        self._train_s: float | None = None  # moving average of the trainer's step time
        self.journal: Journal | None = None
        self._verify: dict[int, dict[str, Any]] = {}  # journaled deltas a restart re-plans
        recovered = None
        if journal is not None:
            self.journal = Journal(journal, self.plan.recovery.fsync)
            recovered = self._recover(journal)
            if recovered is not None:
                state = recovered
        self._build(state)
        if self.journal is not None and recovered is None:
            self.journal.snapshot(self._snapshot(), self.start_step - 1, self._layout_record())
        if recovered is not None:
            self._rewind_loaders()

    def _build(self, state: dict[str, Any] | None) -> None:
        sources = (state or {}).get("sources", {})
        self.cursors = [
            SourceCursor(
                s.name,
                len(self.file_names[s.name]),
                [slot[0] if slot else DeadHandle("retired") for slot in self.slots[s.name]],
                self.runtime,
                self.plan.loading.timeout_s,
                sources.get(s.name, {}).get("cursor"),
                failover=self._cursor_failover(s.name),
                partitions=_partitions(self.parts[s.name]),
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

    @property
    def loaders(self) -> dict[str, list[Handle | None]]:
        """The primary of every loader slot, per source (None: a retired partition's)."""
        return {n: [slot[0] if slot else None for slot in slots] for n, slots in self.slots.items()}

    def primaries(self, source: str) -> list[Handle | None]:
        """The primary of every slot of ``source`` (a constructor meets a new partition)."""
        return self.loaders[source]

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
        self._journal_step(step)
        if step <= min(self.consumed):
            # a restarted planner re-plans a step every rank had consumed already
            self._release(self.plans.pop(step))
            self._prune()

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

    def mark_consumed(self, rank: int, step: int, train_s: float | None = None) -> None:
        """Record that ``rank`` received step ``step``; release what every rank has consumed.

        ``train_s`` is the time the trainer spent on its last step before asking
        for this one (not waiting for data): the autoscaler's demand.
        """
        if train_s is not None and train_s >= 0:
            old = self._train_s
            self._train_s = train_s if old is None else old + TRAIN_EMA * (train_s - old)
        before = min(self.consumed)
        self.consumed[rank] = max(self.consumed[rank], step)
        done = min(self.consumed)
        if done <= before:
            return
        if self.journal is not None:
            self.journal.consumed(done)  # before the loaders forget the items
        for s in sorted(s for s in self.plans if s <= done):
            self._release(self.plans.pop(s))
        self._prune()
        self._retire()
        every = self.plan.autoscale.every
        if self.scaler is not None and (done + 1) // every > (before + 1) // every:
            try:
                self._autoscale(done + 1)
            except ActorDiedError as e:  # a loader died: decide next time, after its failover
                log.warning("autoscaler skipped a decision at step %d: %s", done + 1, e)

    def _consumed_step(self) -> int:
        """The step after the last one every rank consumed (or the next to plan, if earlier).

        A restarted planner may learn that ranks consumed steps it has not
        re-planned yet; its state is then the one before the next step to plan.
        """
        return min(min(self.consumed) + 1, self.next_step)

    def _prune(self) -> None:
        first = self._consumed_step()
        for s in [s for s in self.snapshots if s < first]:
            del self.snapshots[s]

    def _release(self, rank_plans: list[dict[str, Any]]) -> None:
        """Tell every replica of every slot that a consumed step's items can go."""
        keys: dict[tuple[int, int], list[np.ndarray]] = {}
        for rp in rank_plans:
            src, ldr = rp["source"], rp["loader"]
            for s, k in set(zip(src.tolist(), ldr.tolist())):
                keys.setdefault((s, k), []).append(rp["key"][(src == s) & (ldr == k)])
        grouped: dict[int, tuple[Handle, dict[str, np.ndarray]]] = {}
        for (s, k), parts in keys.items():
            mine = np.concatenate(parts)
            for replica in self.slots[self.names[s]][k]:
                if isinstance(replica, MemberHandle):
                    group = grouped.setdefault(id(replica.group), (replica.group, {}))
                    group[1][replica.name] = mine
                else:
                    replica.call("release", mine)  # no need to wait: a dead one is skipped
        for group_handle, asked in grouped.values():
            group_handle.call("release_many", asked)

    # ---- faults ----------------------------------------------------------------------------

    def _cursor_failover(self, source: str) -> Any:
        return lambda k, dead: self.failover(source, k, dead)

    def failover(self, source: str, k: int, dead: str) -> Handle:
        """Replace slot ``k`` of ``source`` whose primary ``dead`` died; returns the new primary.

        Idempotent: a caller that learns late of a failover gets the current
        primary. The next shadow is promoted (it serves metadata after the last
        shard the planner received); without one, a new loader reads again from
        the state every rank consumed. A new shadow is then started.
        """
        slot = self.slots[source][k]
        if replica_name(slot[0]) != dead:
            return slot[0]
        t0 = time.perf_counter()
        cursor = self.cursors[self.names.index(source)]
        after = cursor.received(k)
        slot.pop(0)
        how = "promoted its shadow"
        while slot:
            try:
                self.runtime.get(slot[0].call("promote", after))
                break
            except ActorDiedError:
                slot.pop(0)
        if not slot:
            how = "started a new loader from the consumed state (no live shadow)"
            fresh = self._spawn_loader(source, k, shadow=False)
            self.runtime.get(fresh.call("promote", after))
            slot.append(fresh)
        while len(slot) < 1 + self.shadows[source]:
            slot.append(self._spawn_loader(source, k, shadow=True))
        if self.journal is not None:
            self.journal.loaders(self._layout_record())
        event = {
            "event": "failover",
            "source": source,
            "loader": k,
            "dead": dead,
            "now": replica_name(slot[0]),
            "how": how,
            "step": self.next_step,
            "seconds": time.perf_counter() - t0,
        }
        self.events.append(event)
        log.warning("SourceLoader %s[%d] (%s) died: %s", source, k, dead, how)
        return slot[0]

    def _spawn_loader(self, source: str, k: int, shadow: bool) -> Handle:
        """A loader for slot ``k`` that starts where every rank has consumed (or its partition)."""
        part = self.parts[source][k]
        start = self.snapshots[self._consumed_step()]["sources"][source]["cursor"]
        if (start["epoch"], start["shard_pos"]) < part.start:
            start = {"epoch": part.start[0], "shard_pos": part.start[1], "index": 0, "skip": []}
        limit = None if part.limit is None else list(part.limit)
        name = f"loader-{source}-{k}-{uuid.uuid4().hex[:6]}"
        args = (self.plan_data, self.base_dir, source, part.loader, part.loaders, start)
        return self.runtime.spawn(SourceLoader, *args, self.keep_payloads, shadow, limit, name=name)

    def _layout_record(self) -> dict[str, Any]:
        """What a restarted planner needs besides the state.

        Every slot's replicas by name, its partition, and the autoscaler's
        hysteresis timers and measured costs.
        """
        record: dict[str, Any] = {
            "slots": {
                n: [[replica_name(h) for h in slot] for slot in slots]
                for n, slots in self.slots.items()
            },
            "parts": {n: [p.record() for p in parts] for n, parts in self.parts.items()},
        }
        if self.scaler is not None:
            record["autoscaler"] = {"policy": self.scaler.state_dict(), "cost": dict(self._cost)}
        return record

    # ---- partitions ------------------------------------------------------------------------

    def repartition(self, source: str, count: int) -> list[int] | None:
        """Read ``source`` with ``count`` loaders from a shard boundary on; the boundary.

        The current partition's loaders (shadows too) are frozen: none starts
        a new shard. The boundary is the first shard none of them has started;
        they read on up to it, and ``count`` new loaders read from it. Items
        keep their positions, so the order, and every step, stay the same.
        The old loaders are closed once every rank consumed their last items.
        """
        i = self.names.index(source)
        cursor, slots, parts = self.cursors[i], self.slots[source], self.parts[source]
        current = self._current(source)
        if count < 1:
            raise ValueError(f"a source needs at least one loader, got {count}")
        if count == len(current):
            return None
        frozen, nexts = [], []
        for k in current:
            for replica in slots[k]:
                with contextlib.suppress(ActorDiedError):  # failed over when next asked
                    nexts.append(tuple(self.runtime.get(replica.call("freeze"))))
                    frozen.append(replica)
        at = max(nexts, default=parts[current[0]].start)
        for replica in frozen:
            with contextlib.suppress(ActorDiedError):
                self.runtime.get(replica.call("until", list(at)))
        for k in current:
            parts[k] = parts[k]._replace(limit=at)
        first = len(slots)
        for j in range(count):
            parts.append(Part(j, count, at, None))
            slots.append([])
        for k in range(first, first + count):
            slots[k] += [
                self._spawn_loader(source, k, shadow=s > 0) for s in range(1 + self.shadows[source])
            ]
        cursor.add_partition(list(at), [slots[k][0] for k in range(first, first + count)])
        if self.journal is not None:
            self.journal.loaders(self._layout_record())
        self.events.append(
            {
                "event": "repartition",
                "source": source,
                "step": self.next_step,
                "at": list(at),
                "loaders": f"{len(current)} -> {count}",
            }
        )
        log.warning("source %s: %d -> %d loaders from shard %s", source, len(current), count, at)
        return list(at)

    def _autoscale(self, step: int) -> None:
        """Measure every source's current loaders, decide, and re-size what the decision moved."""
        assert self.scaler is not None
        if self._train_s is None or self._train_s <= 0:
            return  # no step time measured yet: no demand to size for
        a = self.plan.autoscale
        profiles, current = [], {}
        for name in self.names:
            mine = self._current(name)
            stats = [self.runtime.get(self.slots[name][k][0].call("stats")) for k in mine]
            costs = [
                s["cpu_s_per_token"] for s in stats if s["cpu_s_per_token"] == s["cpu_s_per_token"]
            ]
            if costs:
                self._cost[name] = float(np.mean(costs))
            own = [s["rss_bytes"] for s in stats if s["pid"] != os.getpid()]
            # in this process (embedded) a loader's own memory is what its budget lets it hold
            memory = float(np.mean(own)) if own else 4.0 * token_budget(self.plan, len(mine))
            threads = stats[0]["threads"] if stats else 1
            current[name] = (len(mine), threads)
            profiles.append(
                SourceProfile(
                    name,
                    self._cost.get(name, 0.0),
                    memory,
                    len(mine),
                    threads,
                    thread_efficiency=a.thread_efficiency,
                    max_loaders=len(self.file_names[name]),
                )
            )
        weights = self.scaler.weights_ahead(self.schedule.weights, step)
        decision = self.scaler.decide(
            step, profiles, weights, self.plan.batch.tokens_per_step, self._train_s
        )
        self.scaling.append(
            {
                "step": step,
                "step_time_s": self._train_s,
                "bottleneck": decision.bottleneck,
                "cpu_cores": decision.cpu_cores,
                "reason": decision.reason,
                "sources": {
                    d.name: {
                        "loaders": d.loaders,
                        "threads": d.threads,
                        "demand_tokens_per_s": d.demand_tokens_per_s,
                        "capacity_tokens_per_s": d.capacity_tokens_per_s,
                        "cpu_cores": d.cpu_cores,
                        "reason": d.reason,
                    }
                    for d in decision.sources
                },
            }
        )
        for d in decision.sources:
            loaders, threads = current[d.name]
            if d.loaders != loaders:
                self.repartition(d.name, d.loaders)
            if d.threads != threads or d.loaders != loaders:  # new loaders start with 1
                self.set_threads(d.name, d.threads)
            if (d.loaders, d.threads) != (loaders, threads):
                log.warning("autoscaler: %s", d.reason)
        if self.journal is not None:  # the timers moved: a restarted planner keeps them
            self.journal.loaders(self._layout_record())

    def set_threads(self, source: str, threads: int) -> None:
        """Reader threads of every current loader of ``source``."""
        for k in self._current(source):
            for replica in self.slots[source][k]:
                replica.call("set_threads", threads)

    def _current(self, source: str) -> list[int]:
        """The slots of the source's current partition (the one without an end)."""
        return [k for k, p in enumerate(self.parts[source]) if p.limit is None]

    def _retire(self) -> None:
        """Close partitions whose every item every rank has consumed."""
        state = self.snapshots[self._consumed_step()]["sources"]
        for source, parts in self.parts.items():
            c = state[source]["cursor"]
            done = (c["epoch"], c["shard_pos"])
            for k, part in enumerate(parts):
                slot = self.slots[source][k]
                if slot and part.limit is not None and done >= part.limit:
                    for replica in slot:
                        with contextlib.suppress(Exception):  # gone already
                            self.runtime.kill(replica)
                    slot.clear()
                    if self.journal is not None:
                        self.journal.loaders(self._layout_record())

    def _journal_step(self, step: int) -> None:
        """Journal what planning ``step`` changed (or check it against the journal)."""
        if self.journal is None:
            return
        delta = _delta(self.snapshots[step], self.snapshots[step + 1])
        if step in self._verify:
            if delta != self._verify.pop(step):
                raise LoaderError(
                    f"re-planning step {step} after a planner restart gave another plan than "
                    "the journal holds: a source's data changed while the job ran"
                )
            return
        self.journal.delta(step, delta)
        if self.next_step % self.plan.recovery.snapshot_every == 0:
            self.journal.snapshot(self._snapshot(), min(self.consumed), self._layout_record())

    def _recover(self, directory: str) -> dict[str, Any] | None:
        """The state before the step after the last consumed one, from the journal."""
        segments = recover(directory)
        if not segments:
            return None
        assert self.journal is not None
        consumed = max(r.consumed for r in segments)
        want = consumed + 1
        states: dict[int, dict[str, Any]] = {}
        deltas: dict[int, dict[str, Any]] = {}
        for r in segments:
            state = r.snapshot
            states.setdefault(state["step"], state)
            for d in r.deltas:
                step = state["step"]
                deltas[step] = d
                state = self._apply(state, d)
                states.setdefault(state["step"], state)
        problems = [p for r in segments for p in r.problems]
        for p in problems:
            log.error("%s", p)
        if want not in states:
            raise LoaderError(
                f"the planner's journal in {directory} cannot restore step {want} (every rank "
                f"consumed step {consumed}); it holds steps {min(states)}..{max(states)}"
                + (f". Problems: {'; '.join(problems)}" if problems else "")
            )
        last = segments[-1].loaders
        if last is not None:
            self.slots = {
                n: [[self._resolve(name) for name in slot] for slot in slots]
                for n, slots in last["slots"].items()
            }
            self.parts = {n: [Part.of(r) for r in rs] for n, rs in last["parts"].items()}
            scaled = last.get("autoscaler")
            if scaled is not None and self.scaler is not None:
                self.scaler.load_state_dict(scaled["policy"])
                self._cost = {n: float(c) for n, c in scaled["cost"].items()}
        self.journal.continue_after(segments[-1])
        self._verify = {s: d for s, d in deltas.items() if s >= want}
        self.events.append(
            {
                "event": "planner-recovered",
                "step": want,
                "replanned": len(self._verify),
                "problems": problems,
            }
        )
        log.warning("planner restarted from its journal at step %d", want)
        return states[want]

    def _apply(self, state: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
        """The state after planning step ``state["step"]``, from the step's delta."""
        out = copy.deepcopy(state)
        step = int(state["step"])
        out["step"] = step + 1
        for name, (epoch, shard_pos, index, skip) in delta.get("c", {}).items():
            cursor = {"epoch": epoch, "shard_pos": shard_pos, "index": index, "skip": skip}
            out["sources"][name]["cursor"] = cursor
        total = 0.0
        for name, inc in delta.get("p", {}).items():
            out["sources"][name]["placed"] += inc
            total += inc
        # the mixture target grows by each source's weight times the step's tokens,
        # exactly as select_step adds it
        w = [float(x) for x in self.schedule.weights(step)]
        for i, name in enumerate(self.names):
            out["sources"][name]["target"] = float(
                np.float64(out["sources"][name]["target"]) + np.float64(w[i]) * total
            )
        return out

    def _resolve(self, name: str) -> Handle:
        """The live replica called ``name``, or a dead stand-in that the cursor fails over."""
        actor, _, member = name.partition("/")
        try:
            handle: Handle = self.runtime.handle(actor)  # type: ignore[attr-defined]
        except (LoaderError, KeyError):
            return DeadHandle(name)
        return MemberHandle(handle, member) if member else handle

    def _rewind_loaders(self) -> None:
        """Have every replica serve again what the recovered state has not consumed."""
        snap = self.snapshots[self.start_step]["sources"]
        calls = [
            r.call("rewind", snap[name]["cursor"])
            for name, slots in self.slots.items()
            for slot in slots
            for r in slot
        ]
        for ref in calls:
            with contextlib.suppress(ActorDiedError):  # failed over when next asked for data
                self.runtime.get(ref)

    def pid(self) -> int:
        """The process the planner runs in (chaos tests kill it)."""
        return os.getpid()

    def close(self) -> None:
        """Close the journal (kept: only the job's owner removes it)."""
        if self.journal is not None:
            self.journal.close()

    def stats(self) -> dict[str, Any]:
        """Per-step history (mixture, balance), where each rank is, faults and the journal."""
        return {
            "sources": self.names,
            "history": list(self.history),
            "consumed": list(self.consumed),
            "method": BalanceMethod(self.plan.balance.method).value,
            "events": list(self.events),
            "scaling": list(self.scaling),
            "journal": self.journal.stats() if self.journal is not None else None,
        }


class Part(NamedTuple):
    """What a loader slot reads: loader ``loader`` of ``loaders``, shards ``start`` to ``limit``."""

    loader: int
    loaders: int
    start: tuple[int, int]
    limit: tuple[int, int] | None  # None: the source's current partition, without an end

    def record(self) -> list[Any]:
        """As JSON: ``[loader, loaders, start, limit]``."""
        limit = None if self.limit is None else list(self.limit)
        return [self.loader, self.loaders, list(self.start), limit]

    @classmethod
    def of(cls, record: list[Any]) -> Part:
        """From :meth:`record`."""
        loader, loaders, start, limit = record
        return cls(loader, loaders, tuple(start), None if limit is None else tuple(limit))


def _partitions(parts: list[Part]) -> list[tuple[tuple[int, int], int, int]]:
    """The cursor's partitions, ``(first shard, first slot, loaders)``, from the slots' parts."""
    out: list[tuple[tuple[int, int], int, int]] = []
    for k, p in enumerate(parts):
        if p.loader == 0:
            out.append((p.start, k, p.loaders))
    return out


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one step changed: the cursors that moved, and the tokens each source placed.

    A cursor is ``[epoch, shard_pos, index, skip]``.
    The mixture targets are left out: they follow from the placed tokens and
    the schedule (:meth:`Planner._apply`). JSON round trip, so that it compares
    equal to a delta read back from the journal.
    """
    cursors, placed = {}, {}
    for name, b in before["sources"].items():
        a = after["sources"][name]
        if a["cursor"] != b["cursor"]:
            c = a["cursor"]
            cursors[name] = [c["epoch"], c["shard_pos"], c["index"], c["skip"]]
        inc = a["placed"] - b["placed"]
        if inc:
            placed[name] = int(inc)
    out: dict[str, Any] = json.loads(json.dumps({"c": cursors, "p": placed}))
    return out
