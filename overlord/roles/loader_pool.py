"""LoaderPool: the one owner of every SourceLoader of a job.

A source is read by *slots*; slot ``k`` holds a primary loader and its
shadows (hot standbys reading the same shards), primary first. A slot belongs
to a *partition* of the source's order: loader ``k`` of ``n`` from shard
``start`` to ``limit``. The pool spawns the loaders, serves their metadata to
the planner's cursors (failing a dead primary over on the way), releases what
every rank consumed, re-partitions a source online, sizes it as the
autoscaler decides, closes partitions once consumed, and records all of it in
the planner's journal so that a restarted planner finds its loaders again.

It lives in the planner's process and never imports the planner: what it
needs of it (the state every rank consumed, the step being planned) comes
through two callables. Who reads which shard is
:mod:`overlord.plan.partition`; the autoscaler's measurements and actions are
:mod:`overlord.roles.scaling`. Constructors elsewhere use a
:class:`~overlord.roles.pool_view.PoolView`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from overlord.errors import ActorDiedError
from overlord.plan.autoscale import Decision
from overlord.plan.partition import Partition, Position, by_slot, group_rows
from overlord.plan.spec import Plan
from overlord.roles.api import SHARD_END, LoaderRole
from overlord.roles.scaling import Scaling
from overlord.roles.source_loader import SourceLoader
from overlord.runtime import call_each, spread
from overlord.runtime.base import Handle, OneWay, RoleOptions, Runtime
from overlord.sources.catalog import SourceFiles
from overlord.state.journal import Journal

log = logging.getLogger("overlord.pool")

# a shadow's releases go in one call per this many steps: it serves nothing until promoted,
# so items it holds a few steps longer cost memory only (a reader held by its budget lags,
# as a shadow may), and a loader process per source and standby saves a call per step
SHADOW_RELEASE_STEPS = 4


@dataclass(frozen=True)
class PoolConfig:
    """How a job's loaders are deployed (decided by the wiring, :class:`overlord.Loader`)."""

    shadows: dict[str, int]  # hot standbys per loader, per source
    options: dict[str, RoleOptions] = field(default_factory=dict)  # per source
    processes: int | None = None  # processes that hold the loaders (None: one each)
    keep_payloads: bool = True  # False: metadata only (``overlord plan``)
    measure_rss: bool = False  # loaders run in processes of their own, whose memory is theirs


class LoaderPool:
    """Every loader slot of every source of one job.

    ``consumed(source)`` is the source cursor's state that every rank has
    consumed (where a new loader starts); ``clock()`` is the step being planned
    (for the events it records).
    """

    def __init__(
        self,
        plan: Plan,
        files: dict[str, SourceFiles],
        runtime: Runtime,
        config: PoolConfig,
        consumed: Callable[[str], dict[str, Any]],
        clock: Callable[[], int],
        journal: Journal | None = None,
    ):
        self.plan = plan
        self.files = files
        self.runtime = runtime
        self.config = config
        self.shadows = config.shadows
        self.options = config.options
        self.journal = journal
        self._consumed = consumed
        self._clock = clock
        self.names = plan.source_names
        self.slots: dict[str, list[list[Handle[LoaderRole]]]] = {n: [] for n in self.names}
        self.parts: dict[str, list[Partition]] = {n: [] for n in self.names}  # per slot
        self._received: dict[tuple[str, int], list[int]] = {}  # end of the last block it got
        # blocks a loader sent with a process mate's, before its cursor asked (see metadata)
        self._polled: dict[tuple[str, int], list[dict[str, Any]]] = {}
        self._releases = OneWay("planner", ignore=(ActorDiedError,))
        # per slot, the keys released since its shadows were last told, and for how many steps
        self._shadow_keys: dict[tuple[str, int], list[np.ndarray]] = {}
        self._shadow_steps = 0
        self.events: list[dict[str, Any]] = []  # failovers and re-partitions
        # None: the sizes stay as planned (autoscale.cpus not set)
        self.autoscaler = Scaling.of(plan, files, config.measure_rss)

    # ---- the slots -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn every source's loaders (in ``config.processes`` shared processes, if set)."""
        for spec in self.plan.sources:
            self.parts[spec.name] = [
                Partition(k, spec.loaders, (0, 0), None) for k in range(spec.loaders)
            ]
        if self.config.processes is not None:
            self._start_grouped(self.config.processes)
            return
        for spec in self.plan.sources:
            copies = 1 + self.shadows[spec.name]
            self.slots[spec.name] = [
                [self._spawn(spec.name, k, s > 0) for s in range(copies)]
                for k in range(spec.loaders)
            ]

    def _start_grouped(self, processes: int) -> None:
        """SourceLoaders hosted in ``processes`` processes (their shadows in as many more).

        Shadow ``j`` of every loader of group ``g`` lives in host ``shadow{j}-group{g}``,
        so that a host's process dying never takes a slot's shadow with it.
        """
        specs = {s.name: s for s in self.plan.sources}
        wanted = [(s.name, k) for s in self.plan.sources for k in range(s.loaders)]
        copies = max(self.shadows.values())
        tag = uuid.uuid4().hex[:6]
        for name, spec in specs.items():
            self.slots[name] = [[] for _ in range(spec.loaders)]
        for g, group in enumerate(spread(wanted, processes)):
            # a host starts with the options of its first loader's source
            options = self.options.get(group[0][0], RoleOptions())
            for j in range(1 + copies):
                host = f"loader-group{g}-{tag}" if j == 0 else f"loader-shadow{j}-group{g}-{tag}"
                for src, k in group:
                    if j > self.shadows[src]:
                        continue
                    start, n = self._consumed(src), specs[src].loaders
                    args = (self.plan, self.files[src], src, k, n, start)
                    handle: Handle[LoaderRole] = self.runtime.spawn(
                        SourceLoader,
                        *(*args, self.config.keep_payloads, j > 0),
                        name=f"{src}-{k}",
                        options=replace(options, host=host),
                    )
                    self.slots[src][k].append(handle)

    def _spawn(self, source: str, k: int, shadow: bool) -> Handle[LoaderRole]:
        """A loader for slot ``k`` that starts where every rank has consumed (or its partition)."""
        part = self.parts[source][k]
        start = self._consumed(source)
        if (start["epoch"], start["shard_pos"]) < part.start:
            start = {"epoch": part.start[0], "shard_pos": part.start[1], "index": 0, "skip": []}
        limit = None if part.limit is None else list(part.limit)
        name = f"loader-{source}-{k}{'-shadow' if shadow else ''}-{uuid.uuid4().hex[:6]}"
        args = (self.plan, self.files[source], source, part.loader, part.loaders, start)
        handle: Handle[LoaderRole] = self.runtime.spawn(
            SourceLoader,
            *args,
            self.config.keep_payloads,
            shadow,
            limit,
            list(part.start),
            name=name,
            options=self.options.get(source, RoleOptions()),
        )
        return handle

    def primaries(self, source: str) -> list[Handle[LoaderRole] | None]:
        """The primary of every slot of ``source`` (None: a retired partition's)."""
        return [slot[0] if slot else None for slot in self.slots[source]]

    def current(self, source: str) -> list[int]:
        """The slots of the source's current partition (the one without an end)."""
        return [k for k, p in enumerate(self.parts[source]) if p.limit is None]

    # ---- data ------------------------------------------------------------------------------

    def metadata(self, source: str, k: int, timeout: float) -> list[dict[str, Any]]:
        """New metadata blocks of slot ``k``, failing over to a replica if its primary died.

        Loaders that share a process are asked in one call to it: slot ``k``
        waits for a block, the others hand over what they have queued, which
        is kept here until their cursors ask (one call per loader process
        per step, not one per source).
        """
        while True:
            kept = self._polled.pop((source, k), None)
            if kept:
                return kept
            handle = self.slots[source][k][0]
            try:
                blocks = self._ask(source, k, handle, timeout)
            except ActorDiedError:
                self.failover(source, k, handle.name)
                continue
            return blocks

    def _ask(
        self, source: str, k: int, handle: Handle[LoaderRole], timeout: float
    ) -> list[dict[str, Any]]:
        """Slot ``k``'s new blocks, and those its process's other primaries queued (kept)."""
        mates = self._mates(handle)
        if not mates:
            return self._got(source, k, handle.call(LoaderRole.metadata, timeout).result())
        calls = [(handle, timeout)] + [(h, 0.0) for _, _, h in mates]
        refs = call_each(LoaderRole.metadata, calls)
        try:
            blocks = refs[0].result()
        except ActorDiedError:  # this loader's, or another member's (killed): ask it alone
            return self._got(source, k, handle.call(LoaderRole.metadata, timeout).result())
        for (n, j, _), ref in zip(mates, refs[1:]):
            more = self._got(n, j, ref.result())
            if more:
                self._polled.setdefault((n, j), []).extend(more)
        return self._got(source, k, blocks)

    def _mates(self, handle: Handle[LoaderRole]) -> list[tuple[str, int, Handle[LoaderRole]]]:
        """The other primaries hosted in ``handle``'s process (none: not hosted)."""
        host = getattr(getattr(handle, "host", None), "name", None)
        if host is None:
            return []
        return [
            (n, j, slot[0])
            for n, slots in self.slots.items()
            for j, slot in enumerate(slots)
            if slot and slot[0] is not handle and getattr(slot[0], "host", None) is not None
            and slot[0].host.name == host  # type: ignore[attr-defined]
        ]  # fmt: skip

    def _got(self, source: str, k: int, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Blocks slot ``k`` of ``source`` sent: the end of the last one is what it sent."""
        if blocks:
            last = blocks[-1]
            end = SHARD_END if last["last"] else int(last["stop"])
            self._received[(source, k)] = [int(last["epoch"]), int(last["shard_pos"]), end]
        return blocks

    def release(self, source: np.ndarray, loader: np.ndarray, keys: np.ndarray) -> None:
        """Tell every replica of every slot that these items (of a consumed step) can go.

        Primaries are told at once, shadows every :data:`SHADOW_RELEASE_STEPS`
        calls (a slot's failover tells them first). One-way: the planner does
        not wait, and the error of a release (other than a dead replica's) is
        raised at the next release.
        """
        calls = []
        for s, k, mine in by_slot(source, loader):
            slot = self.slots[self.names[s]][k]
            mine_keys = group_rows(keys, mine)
            if slot:
                calls.append((slot[0], mine_keys))
            if len(slot) > 1:
                self._shadow_keys.setdefault((self.names[s], k), []).append(mine_keys)
        self._shadow_steps += 1
        if self._shadow_steps >= SHADOW_RELEASE_STEPS:
            calls += self._to_shadows(list(self._shadow_keys))
        self._send_releases(calls)

    def _to_shadows(self, slots: list[tuple[str, int]]) -> list[tuple[Handle[LoaderRole], Any]]:
        """The release calls that tell ``slots``' shadows what was released since they were told."""
        calls = []
        for name, k in slots:
            parts = self._shadow_keys.pop((name, k), [])
            if parts:
                keys = np.concatenate(parts)
                calls += [(replica, keys) for replica in self.slots[name][k][1:]]
        if not self._shadow_keys:
            self._shadow_steps = 0
        return calls

    def _send_releases(self, calls: list[tuple[Handle[LoaderRole], Any]]) -> None:
        # loaders that share a process are told in one call to it
        refs = call_each(LoaderRole.release, calls)
        self._releases.keep_each(
            (ref, f"{handle.name}.release") for (handle, _), ref in zip(calls, refs)
        )

    # ---- faults ----------------------------------------------------------------------------

    def failover(self, source: str, k: int, dead: str) -> Handle[LoaderRole]:
        """Replace slot ``k`` of ``source`` whose primary ``dead`` died; returns the new primary.

        Idempotent: a caller that learns late of a failover gets the current
        primary. The next shadow is promoted (it serves metadata after the last
        shard the planner received); without one, a new loader reads again from
        the state every rank consumed. A new shadow is then started.
        """
        slot = self.slots[source][k]
        if slot and slot[0].name != dead:
            return slot[0]
        t0 = time.perf_counter()
        after = self._received.get((source, k))
        if slot:
            slot.pop(0)
        how = "promoted its shadow"
        while slot:
            try:
                slot[0].call(LoaderRole.promote, after).result()
                break
            except ActorDiedError:
                slot.pop(0)
        if not slot:
            how = "started a new loader from the consumed state (no live shadow)"
            fresh = self._spawn(source, k, shadow=False)
            fresh.call(LoaderRole.promote, after).result()
            slot.append(fresh)
        while len(slot) < 1 + self.shadows[source]:
            slot.append(self._spawn(source, k, shadow=True))
        # the promoted shadow was not told of every release yet (nor were its peers)
        waiting = self._shadow_keys.pop((source, k), [])
        if waiting:
            keys = np.concatenate(waiting)
            self._send_releases([(replica, keys) for replica in slot])
        self._journal()
        self.events.append(
            {
                "event": "failover",
                "source": source,
                "loader": k,
                "dead": dead,
                "now": slot[0].name,
                "how": how,
                "step": self._clock(),
                "seconds": time.perf_counter() - t0,
            }
        )
        log.warning("SourceLoader %s[%d] (%s) died: %s", source, k, dead, how)
        return slot[0]

    # ---- partitions and sizes --------------------------------------------------------------

    def repartition(self, source: str, count: int) -> Position | None:
        """Read ``source`` with ``count`` loaders from a shard boundary on; the boundary.

        The current partition's loaders (shadows too) are frozen: none starts
        a new shard. The boundary is the first shard none of them has started;
        they read on up to it, and ``count`` new loaders read from it. Items
        keep their positions, so the order, and every step, stay the same.
        The old loaders are closed once every rank consumed their last items.
        """
        if count < 1:
            raise ValueError(f"a source needs at least one loader, got {count}")
        slots, parts = self.slots[source], self.parts[source]
        current = self.current(source)
        if count == len(current):
            return None
        frozen, nexts = [], []
        for k in current:
            for replica in slots[k]:
                with contextlib.suppress(ActorDiedError):  # failed over when next asked
                    nxt = replica.call(LoaderRole.freeze).result()
                    frozen.append(replica)
                    if nxt is not None:
                        nexts.append((nxt[0], nxt[1]))
        at = max(nexts, default=parts[current[0]].start)
        for replica in frozen:
            with contextlib.suppress(ActorDiedError):
                replica.call(LoaderRole.until, list(at)).result()
        for k in current:
            parts[k] = parts[k]._replace(limit=at)
        first = len(slots)
        parts += [Partition(j, count, at, None) for j in range(count)]
        for k in range(first, first + count):
            copies = 1 + self.shadows[source]
            slots.append([self._spawn(source, k, s > 0) for s in range(copies)])
        self._journal()
        self.events.append(
            {
                "event": "repartition",
                "source": source,
                "step": self._clock(),
                "at": list(at),
                "loaders": f"{len(current)} -> {count}",
            }
        )
        log.warning("source %s: %d -> %d loaders from shard %s", source, len(current), count, at)
        return at

    def set_threads(self, source: str, threads: int) -> None:
        """Reader threads of every current loader of ``source``."""
        for k in self.current(source):
            for replica in self.slots[source][k]:
                with contextlib.suppress(ActorDiedError):  # its replacement starts as planned
                    replica.call(LoaderRole.set_threads, threads).result()

    def retire(self) -> None:
        """Close partitions whose every item every rank has consumed."""
        for source, parts in self.parts.items():
            if len(parts) == 1 and parts[0].limit is None:  # it never ended: nothing to ask
                continue
            c = self._consumed(source)
            done = (c["epoch"], c["shard_pos"])
            for k, part in enumerate(parts):
                slot = self.slots[source][k]
                if slot and part.limit is not None and done >= part.limit:
                    for replica in slot:
                        with contextlib.suppress(Exception):  # gone already
                            self.runtime.kill(replica)
                    slot.clear()
                    self._polled.pop((source, k), None)
                    self._shadow_keys.pop((source, k), None)
                    self._journal()

    def autoscale(
        self, step: int, train_s: float, weights: Callable[[int], np.ndarray]
    ) -> Decision | None:
        """Measure every source's current loaders, decide, and re-size what the decision moved."""
        if self.autoscaler is None:
            return None
        decision = self.autoscaler.scale(self, step, train_s, weights)
        self._journal()  # the timers moved: a restarted planner keeps them
        return decision

    @property
    def scaling(self) -> list[dict[str, Any]]:
        """The autoscaler's decisions so far, with their reasons (the run summary's)."""
        return [] if self.autoscaler is None else self.autoscaler.decisions

    # ---- journal and restart ---------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """What a restarted planner needs: every slot's replicas by name, partitions, scaling."""
        record: dict[str, Any] = {
            "slots": {
                n: [[h.name for h in slot] for slot in slots] for n, slots in self.slots.items()
            },
            "parts": {n: [p.record() for p in parts] for n, parts in self.parts.items()},
        }
        if self.autoscaler is not None:
            record["autoscaler"] = self.autoscaler.state_dict()
        return record

    def scaling_state(self) -> dict[str, Any] | None:
        """The autoscaler's hysteresis timers and each source's measured cost (None: off)."""
        return None if self.autoscaler is None else self.autoscaler.state_dict()

    def restore(self, record: dict[str, Any]) -> None:
        """Find the loaders of a :meth:`record` again (a dead one fails over when asked)."""
        self.slots = {
            n: [[self.runtime.lookup(name) for name in slot] for slot in slots]
            for n, slots in record["slots"].items()
        }
        self.parts = {n: [Partition.of(r) for r in rs] for n, rs in record["parts"].items()}
        scaled = record.get("autoscaler")
        if scaled is not None and self.autoscaler is not None:
            self.autoscaler.load_state_dict(scaled)

    def forget_received(self) -> None:
        """Forget where each slot's last block ended (trainers rewound the job).

        A primary promoted from now on serves from the cursor's position that
        :meth:`rewind` gives, not from past the rewind.
        """
        self._received.clear()
        self._polled.clear()  # sent before the rewind: served again from the new position

    def rewind(self, cursors: dict[str, dict[str, Any]], seek: bool = False) -> None:
        """Have every replica serve again what the recovered state has not consumed.

        ``seek``: items the state needs were released (trainers rewound the
        job to an older state): the loaders read again from it. A partition
        retired before the state's position is needed again: its loaders are
        started anew, at the state.
        """
        calls = []
        self._polled.clear()  # blocks sent before the rewind: the loaders serve them again
        # releases of steps consumed before the rewind: a rewind releases what its state
        # consumed, and what comes after the state is needed again, so they are not sent
        self._shadow_keys.clear()
        self._shadow_steps = 0
        for name, slots in self.slots.items():
            at = (int(cursors[name]["epoch"]), int(cursors[name]["shard_pos"]))
            for k, slot in enumerate(slots):
                limit = self.parts[name][k].limit
                if not slot and limit is not None and at < limit:
                    copies = 1 + self.shadows[name]
                    slot += [self._spawn(name, k, s > 0) for s in range(copies)]
                    self._journal()
                    continue
                calls += [r.call(LoaderRole.rewind, cursors[name], seek) for r in slot]
        for ref in calls:
            with contextlib.suppress(ActorDiedError):  # failed over when next asked for data
                ref.result()

    def _journal(self) -> None:
        if self.journal is not None:
            self.journal.loaders(self.record())

    def stats(self) -> list[dict[str, Any]]:
        """Every primary's counters."""
        return [
            h.call(LoaderRole.stats).result()
            for n in self.names
            for h in self.primaries(n)
            if h is not None
        ]
