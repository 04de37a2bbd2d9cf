"""Autoscaler: how many SourceLoaders, and reader threads in each, every source needs.

Sources differ by orders of magnitude in what one token costs to read, decode
and tokenize, and the mixture schedule moves their shares during training. The
Planner runs this policy every few steps on figures its loaders measured; the
policy is pure arithmetic on those figures, so it is tested on recorded
numbers, never on a running job. Its only state is a hysteresis timer per
source, saved as JSON with the Planner's state.

The policy, per source ``s``:

1. **Demand looks ahead.** The schedule is known in advance, so demand is the
   largest share over the next steps, not the current one:
   ``demand = max_i weights_ahead[i, s] * tokens_per_step / step_time_s``. A
   source whose weight rises in 40 steps is scaled up now, before the trainer
   starts waiting for it.
2. **Capacity model.** A reader thread delivers ``efficiency / cpu_s_per_token``
   tokens/s. Each extra thread of the same loader adds ``thread_efficiency`` of
   that (1 when reading releases the GIL: Arrow, Rust tokenizers,
   decompression; near 0 when pure-Python work holds it). So a shape of ``L``
   loaders x ``T`` threads supplies ``L * (1 + (T - 1) * thread_efficiency)``
   thread-rates.
3. **Shape.** Among the shapes that supply ``demand * headroom``, the cheapest
   wins, each priced by the share of the budget it takes: the cores it burns
   (item 5) over ``budget.cpus`` plus ``L*memory_bytes_per_loader /
   budget.memory_bytes``. Every shape that meets the need burns the same, so
   memory decides: loaders cost memory and threads do not, so a loader is
   filled with threads before another is added; when threads do not scale
   (``thread_efficiency`` near 0), a second thread buys nothing and loaders
   are added instead. Ties go to fewer loaders (fewer processes to start and
   reshard), then fewer threads.
4. **Hysteresis.** Scale up at once when the current capacity is below demand
   (the headroom is the margin spent before acting). Scale down only when the
   needed capacity (demand x headroom) has stayed below ``down_threshold`` of
   the current capacity for ``cooldown_steps`` training steps. In between the
   size is kept, so noise in the measurements changes nothing.
5. **Budget.** ``Budget.cpus`` counts the cores the readers are expected to
   burn together at the horizon's peak demand, with headroom: a source burns
   ``min(capacity, demand * headroom) * cpu_s_per_token``, however many
   loaders it has, since an idle reader burns none (an unmeasured source
   counts one core per reader thread). Loaders cost memory, so a cheap
   source's loader takes a sliver of the CPUs but its whole memory; the reader
   threads may add up to more than ``cpus`` (loaders that are mostly idle),
   and a short burst (filling the read-ahead at start) can use more cores for
   a moment. If the chosen sizes do not fit ``Budget.cpus`` and
   ``Budget.memory_bytes``, sources kept above their need by hysteresis are
   shrunk first. If that is not enough, the budget is re-divided from every
   source's minimum (``min_loaders`` x 1 thread), always growing the source
   whose capacity/demand ratio is lowest (max-min fairness): the trainer waits
   on the worst-supplied source, so raising the lowest ratio is what raises
   throughput. A re-division replaces the current sizes only if it raises that
   lowest ratio by ``rebalance_gain``, so a short budget does not flap either.
   The source left furthest below its demand is named as the ``bottleneck``.

Sources without a measured cost yet (``cpu_s_per_token`` 0 or NaN) keep their
current size, with a reason saying so.

>>> scaler = Autoscaler(Budget(cpus=16, memory_bytes=8e9))
>>> web = SourceProfile("web", cpu_s_per_token=1e-5, memory_bytes_per_loader=1e9,
...                     loaders=1, threads=1)
>>> d = scaler.decide(0, [web], np.array([[1.0]]), tokens_per_step=2e5, step_time_s=1.0)
>>> (d.source("web").loaders, d.source("web").threads)
(1, 3)
>>> print(d.source("web").reason)
web: demand 200k tok/s now (weight 1.00) needs 2.5 CPUs; 1 loader x 1 thread (100k tok/s) \
-> 1 loader x 3 threads (300k tok/s)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from overlord.plan.sizing import Budget, Decision, SourceDecision, SourceProfile, check_all

__all__ = ["Autoscaler", "Budget", "Decision", "SourceDecision", "SourceProfile"]

STATE_VERSION = 1
VERSION_KEY, LOW_SINCE_KEY = "version", "low_since"
_EPS = 1e-9  # relative slack, so that 6.000000000001 threads' worth is still 6


class Shape(NamedTuple):
    """Loaders of a source and reader threads in each."""

    loaders: int
    threads: int

    @property
    def cpus(self) -> int:
        """Reader threads in all."""
        return self.loaders * self.threads

    def __str__(self) -> str:
        ls, ts = "s" * (self.loaders != 1), "s" * (self.threads != 1)
        return f"{self.loaders} loader{ls} x {self.threads} thread{ts}"


@dataclass(frozen=True)
class _Source:
    """A profile with its demand over the horizon and the arithmetic of its shapes."""

    profile: SourceProfile
    demand: float  # tokens/s, the horizon's peak
    peak_offset: int  # steps from now to that peak
    peak_weight: float
    rate: float  # tokens/s of one reader thread (0 while unmeasured)
    lo: int  # fewest loaders
    hi: int | None  # most loaders

    def capacity(self, shape: Shape) -> float:
        gain = 1.0 + (shape.threads - 1) * self.profile.thread_efficiency
        return shape.loaders * gain * self.rate

    def memory(self, shape: Shape) -> float:
        return shape.loaders * self.profile.memory_bytes_per_loader

    def cpu_use(self, shape: Shape, headroom: float) -> float:
        """Cores the readers burn at peak demand: tokens made x cost; unmeasured, threads."""
        if not self.profile.measured:
            return float(shape.cpus)
        made = min(self.capacity(shape), self.demand * headroom)
        return min(made * self.profile.cpu_s_per_token, float(shape.cpus))

    def clamp(self, shape: Shape, max_threads: int) -> Shape:
        loaders = max(shape.loaders, self.lo)
        loaders = loaders if self.hi is None else min(loaders, self.hi)
        return Shape(loaders, min(shape.threads, max_threads))


# ---- the policy -----------------------------------------------------------------------------


class Autoscaler:
    """Sizes every source's loaders for the schedule's demand, within a budget.

    ``headroom`` is the capacity kept above demand; ``down_threshold`` and
    ``cooldown_steps`` say how far and for how long the need must fall before
    a source shrinks; ``horizon_steps`` is how far ahead :meth:`weights_ahead`
    looks (at least a new loader's start-up time, in steps); ``efficiency`` is
    the part of a core one reader thread gets in practice; ``rebalance_gain``
    is the least improvement of the worst capacity/demand ratio for which a
    short budget is re-divided. See the module docstring for the policy.
    """

    def __init__(
        self,
        budget: Budget,
        *,
        headroom: float = 1.25,
        down_threshold: float = 0.6,
        cooldown_steps: int = 20,
        horizon_steps: int = 50,
        efficiency: float = 1.0,
        rebalance_gain: float = 0.1,
    ):
        check_all("autoscaler", [
            (1 <= headroom < math.inf, f"headroom must be >= 1 and finite, found {headroom}"),
            (0 < down_threshold <= 1, f"down_threshold must be in (0, 1], found {down_threshold}"),
            (cooldown_steps >= 0, f"cooldown_steps must be >= 0, found {cooldown_steps}"),
            (horizon_steps >= 0, f"horizon_steps must be >= 0, found {horizon_steps}"),
            (0 < efficiency <= 1, f"efficiency must be in (0, 1], found {efficiency}"),
            (rebalance_gain >= 0, f"rebalance_gain must be >= 0, found {rebalance_gain}"),
        ])  # fmt: skip
        self.budget = budget
        self.headroom, self.down_threshold = headroom, down_threshold
        self.cooldown_steps, self.horizon_steps = cooldown_steps, horizon_steps
        self.efficiency, self.rebalance_gain = efficiency, rebalance_gain
        # source name -> first step of the current run of decisions whose need was low
        self._low_since: dict[str, int] = {}

    # ---- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The hysteresis timers, as plain JSON data keyed by source name."""
        return {VERSION_KEY: STATE_VERSION, LOW_SINCE_KEY: dict(sorted(self._low_since.items()))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (after a JSON round trip)."""
        if not isinstance(state, Mapping) or state.get(VERSION_KEY) != STATE_VERSION:
            found = state.get(VERSION_KEY) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"autoscaler state: expected version {STATE_VERSION}, found {found!r}; "
                "pass what Autoscaler.state_dict() returned"
            )
        low = state.get(LOW_SINCE_KEY)
        if not isinstance(low, Mapping) or not all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in low.items()
        ):
            raise ValueError(
                f"autoscaler state: expected {LOW_SINCE_KEY!r} to map source names to steps >= 0, "
                f"found {low!r}"
            )
        self._low_since = dict(low)

    # ---- the decision ---------------------------------------------------------------------

    def weights_ahead(self, weights: Callable[[int], np.ndarray], step: int) -> np.ndarray:
        """Rows ``weights(step + i)``, ``i`` in ``0..horizon_steps``; ``Schedule(plan).weights``.

        The columns are in the order ``weights`` returns (plan order for a
        Schedule), which is the order :meth:`decide` expects its profiles in.
        """
        rows = [
            np.asarray(weights(step + i), dtype=np.float64) for i in range(self.horizon_steps + 1)
        ]
        return np.stack(rows)

    def decide(
        self,
        step: int,
        profiles: Sequence[SourceProfile],
        weights_ahead: np.ndarray,
        tokens_per_step: float,
        step_time_s: float,
    ) -> Decision:
        """Choose every source's loaders and threads at training step ``step``.

        ``weights_ahead[i, s]`` is source ``s``'s token share at ``step + i``
        (columns in the order of ``profiles``; see :meth:`weights_ahead`).
        ``step_time_s`` is the trainer's step time *without* waiting for data:
        a time that includes data stalls under-states demand exactly when
        supply falls short. Updates the hysteresis timers.
        """
        srcs = self._sources(step, profiles, weights_ahead, tokens_per_step, step_time_s)
        maxt = self.budget.max_threads_per_loader
        current = [s.clamp(Shape(s.profile.loaders, s.profile.threads), maxt) for s in srcs]
        target = [
            self._shape_for(s, s.demand * self.headroom) if s.profile.measured else c
            for s, c in zip(srcs, current)
        ]
        low = [
            s.profile.measured and s.demand * self.headroom < self.down_threshold * s.capacity(c)
            for s, c in zip(srcs, current)
        ]

        # 1. hysteresis alone: up at once when short, down once low for the cooldown
        notes = [""] * len(srcs)
        chosen = list(current)
        for i, s in enumerate(srcs):
            if not s.profile.measured:
                continue
            waited = step - min(self._low_since.get(s.profile.name, step), step)
            if s.capacity(current[i]) < s.demand * (1 - _EPS):
                chosen[i] = target[i]
            elif low[i] and target[i] != current[i] and waited >= self.cooldown_steps:
                chosen[i] = target[i]
                notes[i] = f" after {waited} steps below {self.down_threshold:.0%} of capacity"
            elif low[i] and target[i] != current[i]:
                notes[i] = (
                    f"; needs under {self.down_threshold:.0%} of its capacity for "
                    f"{waited} of {self.cooldown_steps} steps before shrinking"
                )

        pressure = ""  # how a short budget was met: "fair" (re-divided) or "kept"
        if not self._fits(srcs, chosen):
            # 2. give up what hysteresis kept above the need
            for i, s in enumerate(srcs):
                if chosen[i] == current[i] and s.capacity(target[i]) < s.capacity(current[i]):
                    chosen[i] = target[i]
                    notes[i] = "; shrunk at once to fit the budget"
        if not self._fits(srcs, chosen):
            # 3. re-divide the budget, max-min fair, unless that gains too little
            fair = self._water_fill(srcs, current)
            worst_now = self._worst(srcs, current)
            kept = self._fits(srcs, current) and (
                self._worst(srcs, fair) < worst_now * (1 + self.rebalance_gain)
            )
            chosen, pressure = (list(current), "kept") if kept else (fair, "fair")
            notes = [""] * len(srcs)

        # a run of low need lasts only while the size stays put
        self._low_since = {
            s.profile.name: min(self._low_since.get(s.profile.name, step), step)
            for s, lo, new, cur in zip(srcs, low, chosen, current)
            if lo and new == cur
        }
        return self._explain(step, srcs, target, chosen, notes, pressure)

    # ---- helpers --------------------------------------------------------------------------

    def _sources(
        self,
        step: int,
        profiles: Sequence[SourceProfile],
        weights_ahead: np.ndarray,
        tokens_per_step: float,
        step_time_s: float,
    ) -> list[_Source]:
        """Validate the inputs (every problem at once) and model each source."""
        names = [p.name for p in profiles]
        dup = sorted({n for n in names if names.count(n) > 1})
        w = np.asarray(weights_ahead, dtype=np.float64)
        shape_ok = w.ndim == 2 and w.shape[0] >= 1 and w.shape[1] == len(profiles)
        check_all("Autoscaler.decide", [
            (bool(profiles), "no source profiles: pass one per source"),
            (not dup, f"source names must be unique, found {dup} more than once"),
            (step >= 0, f"step must be >= 0, found {step}"),
            (0 < tokens_per_step < math.inf,
             f"tokens_per_step must be > 0 and finite, found {tokens_per_step}"),
            (0 < step_time_s < math.inf,
             f"step_time_s must be > 0 and finite, found {step_time_s}"),
            (shape_ok, f"weights_ahead must have shape (steps >= 1, {len(profiles)} sources), "
                       f"found {w.shape}; one row per step ahead, one column per profile"),
            (not shape_ok or bool(np.isfinite(w).all() and (w >= 0).all()),
             "weights_ahead must be finite and >= 0, found NaN, inf or < 0"),
        ])  # fmt: skip
        b = self.budget
        rates = w * (tokens_per_step / step_time_s)
        peak = np.argmax(rates, axis=0)  # the first peak: the soonest the source must be ready
        srcs = [
            _Source(
                profile=p,
                demand=float(rates[peak[i], i]),
                peak_offset=int(peak[i]),
                peak_weight=float(w[peak[i], i]),
                rate=self.efficiency / p.cpu_s_per_token if p.measured else 0.0,
                lo=min(b.min_loaders, p.max_loaders or b.min_loaders),
                hi=p.max_loaders,
            )
            for i, p in enumerate(profiles)
        ]
        minimum = [Shape(s.lo, 1) for s in srcs]
        if not self._fits(srcs, minimum):
            raise ValueError(
                f"budget of {b.cpus:g} CPUs and {_bytes(b.memory_bytes)} cannot hold the minimum "
                f"of {b.min_loaders} loader(s) x 1 thread for each of {len(srcs)} sources, "
                f"which takes {self._cpus(srcs, minimum):g} CPUs and "
                f"{_bytes(sum(s.memory(m) for s, m in zip(srcs, minimum)))}; "
                "raise the budget or lower min_loaders"
            )
        return srcs

    def _price(self, s: _Source, shape: Shape) -> float:
        """The share of the budget a shape takes, cores burned and memory added up."""
        b = self.budget
        return s.cpu_use(shape, self.headroom) / b.cpus + s.memory(shape) / b.memory_bytes

    def _shape_for(self, s: _Source, need: float) -> Shape:
        """The cheapest shape whose capacity reaches ``need``, else the largest possible."""
        best, best_key = Shape(s.lo, 1), (True, 0.0, math.inf, 0, 0)
        for t in range(1, self.budget.max_threads_per_loader + 1):
            loaders = max(s.lo, math.ceil(need / s.capacity(Shape(1, t)) - _EPS))
            shape = Shape(loaders if s.hi is None else min(loaders, s.hi), t)
            cap = s.capacity(shape)
            short = cap < need * (1 - _EPS)
            # shapes that reach the need first, by price; if none does, the largest
            key = (short, -cap if short else 0.0, self._price(s, shape), shape.loaders, t)
            if key < best_key:
                best, best_key = shape, key
        return best

    def _cpus(self, srcs: Sequence[_Source], shapes: Sequence[Shape]) -> float:
        """Cores the readers of ``shapes`` burn together (see :meth:`_Source.cpu_use`)."""
        return sum(s.cpu_use(x, self.headroom) for s, x in zip(srcs, shapes))

    def _fits(self, srcs: Sequence[_Source], shapes: Sequence[Shape]) -> bool:
        b, mem = self.budget, sum(s.memory(x) for s, x in zip(srcs, shapes))
        return self._cpus(srcs, shapes) <= b.cpus + _EPS and mem <= b.memory_bytes * (1 + _EPS)

    def _worst(self, srcs: Sequence[_Source], shapes: Sequence[Shape]) -> float:
        """The lowest capacity/demand ratio: the trainer waits on that source."""
        return min(
            (s.capacity(x) / s.demand for s, x in zip(srcs, shapes) if s.rate and s.demand > 0),
            default=math.inf,
        )

    def _water_fill(self, srcs: Sequence[_Source], current: Sequence[Shape]) -> list[Shape]:
        """Grow from every source's minimum, always the lowest capacity/demand ratio first.

        Each move takes the growing source to its cheapest shape of larger
        capacity that still fits; a source that cannot grow stops there, and a
        source stops at demand x headroom. Unmeasured sources keep their size
        unless even that leaves no room for the others' minimum.
        """
        alloc = [Shape(s.lo, 1) if s.profile.measured else current[i] for i, s in enumerate(srcs)]
        if not self._fits(srcs, alloc):
            alloc = [Shape(s.lo, 1) for s in srcs]
        heap = [
            (s.capacity(alloc[i]) / s.demand, i)
            for i, s in enumerate(srcs)
            if s.rate and s.demand > 0
        ]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            s, cur = srcs[i], alloc[i]
            cap = s.capacity(cur)
            if cap >= s.demand * self.headroom * (1 - _EPS):
                continue
            best: Shape | None = None
            best_key = (math.inf, 0.0, 0, 0)
            for t in range(1, self.budget.max_threads_per_loader + 1):
                # the fewest loaders of t threads that supply more than now
                shape = Shape(max(s.lo, math.floor(cap / s.capacity(Shape(1, t)) + _EPS) + 1), t)
                if s.hi is not None and shape.loaders > s.hi:
                    continue
                if not self._fits(srcs, [*alloc[:i], shape, *alloc[i + 1 :]]):
                    continue
                key = (self._price(s, shape), -s.capacity(shape), shape.loaders, t)
                if key < best_key:
                    best, best_key = shape, key
            if best is None:
                continue  # it cannot grow within the budget: it stays where it is
            alloc[i] = best
            heapq.heappush(heap, (s.capacity(best) / s.demand, i))
        return alloc

    def _explain(
        self,
        step: int,
        srcs: Sequence[_Source],
        target: Sequence[Shape],
        chosen: Sequence[Shape],
        notes: Sequence[str],
        pressure: str,
    ) -> Decision:
        """The decision, with a reason per source and one for the whole."""
        b, h = self.budget, self.headroom
        out = []
        for s, tgt, new, note in zip(srcs, target, chosen, notes):
            p, had = s.profile, Shape(s.profile.loaders, s.profile.threads)
            if not p.measured:
                cap, why = math.nan, f"{p.name}: no cost measured yet; "
                if new == had:
                    why += f"keeps {new}"
                elif new == s.clamp(had, b.max_threads_per_loader):
                    why += f"{had} -> {new} (within min_loaders and max_threads_per_loader)"
                else:
                    why += f"{had} -> {new} (shrunk to fit the budget)"
            else:
                cap, w, k = s.capacity(new), s.peak_weight, s.peak_offset
                when = f"at step {step + k} (weight {w:.2f} in {k} steps)" if k else "now"
                when += "" if k else f" (weight {w:.2f})"
                why = f"{p.name}: demand {_rate(s.demand)} {when} "
                why += f"needs {s.demand * h * p.cpu_s_per_token:.1f} CPUs; "
                if new == had:
                    why += f"keeps {new} ({_rate(cap)}){note}"
                else:
                    why += f"{had} ({_rate(s.capacity(had))}) -> {new} ({_rate(cap)}){note}"
                if new.loaders == s.hi and s.capacity(tgt) < s.demand * h * (1 - _EPS):
                    why += f"; capped at {s.hi} loaders (max_loaders)"
                if pressure and s.demand > 0 and cap < s.demand * h * (1 - _EPS):
                    why += f"; budget allows {cap / s.demand:.0%} of demand"
            use = s.cpu_use(new, h)
            out.append(SourceDecision(p.name, *new, s.demand, cap, s.memory(new), why, use))

        short = [
            (d.capacity_tokens_per_s / d.demand_tokens_per_s, i)
            for i, d in enumerate(out)
            if d.capacity_tokens_per_s < d.demand_tokens_per_s * (1 - _EPS)  # False for NaN
        ]
        neck = out[min(short)[1]] if short else None
        mem_budget = "no memory limit" if math.isinf(b.memory_bytes) else _bytes(b.memory_bytes)
        used = f"{sum(d.cpu_cores for d in out):.1f} of {b.cpus:g} CPUs, "
        used += f"{_bytes(sum(d.memory_bytes for d in out))} of {mem_budget}"
        if pressure:
            want = f"{self._cpus(srcs, target):.1f} CPUs and "
            want += _bytes(sum(s.memory(x) for s, x in zip(srcs, target)))
            how = "divided fairly"
            if pressure == "kept":
                how = f"kept as it is (re-dividing would gain under {self.rebalance_gain:.0%})"
            reason = (
                f"budget short: demand with {h - 1:.0%} headroom wants {want}; {how} into {used}"
            )
        else:
            reason = f"sized for demand with {h - 1:.0%} headroom on {used}"
        if neck is not None:
            c, d = neck.capacity_tokens_per_s, neck.demand_tokens_per_s
            reason += (
                f"; bottleneck {neck.name}: capacity {_rate(c)} for demand {_rate(d)} ({c / d:.0%})"
            )
        return Decision(step, tuple(out), neck.name if neck else None, reason)


# ---- formatting and errors ------------------------------------------------------------------


def _rate(x: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{unit} tok/s"
    return f"{x:.3g} tok/s"


def _bytes(x: float) -> str:
    if math.isinf(x):
        return "inf bytes"
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"
