"""The planner's feedback loop: trainers' reports in, a refit cost model and mixture out.

A trainer reports each step's measured seconds, and optionally its mean loss per
source (:meth:`overlord.roles.client.Client.report`), one way. The planner hands
the report to its :class:`Feedback`, which pairs it with what it predicted for
that rank and step (the sums ``S1 = sum L`` and ``S2 = sum L**2`` of the rank's
documents, and their cost), and at the plan's steps decides:

- with ``balance.refit``, every ``every`` steps, a new ``beta`` from the last
  ``window`` reported steps (at least ``min_samples`` rank reports), by the rule
  of :func:`overlord.plan.refit.refit_cost`; the step planned next and those
  after it are balanced with it;
- with ``mixture.adapt``, every ``every`` steps, new log-weights from the losses
  reported since the last adaptation (:func:`overlord.plan.refit.adapt_log`);
  the weights in force at each step are the schedule's moved by them.

**What is recorded.** The decision for step ``t`` is taken once, when step
``t - 1`` is first planned, and recorded: in the planner's state before ``t``
(the ``feedback`` key of :mod:`overlord.state.format`, written only once
something was refit or adapted), so that a checkpoint, a resume or a replay
from that state plans ``t`` as the run did; and in the journal (a ``fit`` or
``mix`` record with the decision and a digest of its inputs, and each step's
delta). A step planned again (after
a planner restart from its journal, or a trainers' rewind) applies the
decision recorded for it and never decides anew, so the stream is a pure
function of the plan, the seed, the data and the recorded feedback. Each
reported step is also journaled, compactly (a ``rep`` record: every rank's
predicted cost and measured seconds), for :func:`reports` to read back.

Reports never stop training: one for a step that is not kept (too old, or not
planned) is counted in ``dropped`` and left out; a malformed one is refused at
the trainer's call (:func:`check_report`), before it is sent.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from overlord.monitor.figures import Figures
from overlord.plan.columns import rank_sums
from overlord.plan.cost import CostModel
from overlord.plan.refit import adapt_log, adapted, bounds_of, refit_cost
from overlord.plan.spec import Plan
from overlord.state.journal import Journal, read_segment, segments

KEEP_STEPS = 1024  # planned steps whose per-rank predictions are kept to pair with reports
HISTORY = 256  # refits and adaptations the state lists (older ones are in the journal)


def check_report(
    step: int,
    seconds: float,
    loss_by_source: Mapping[str, float] | None,
    names: Sequence[str],
) -> dict[str, float] | None:
    """A report's losses as plain floats; ``ValueError`` naming the field where it is malformed.

    ``names``: the plan's sources (empty: not checked here; the planner checks).

    >>> check_report(3, 0.25, {"web": 2.5}, ["web", "code"])
    {'web': 2.5}
    >>> check_report(3, -1.0, None, ["web"])
    Traceback (most recent call last):
    ...
    ValueError: report of step 3: seconds must be positive and finite, found -1.0 ...
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"report: step must be an int >= 0, found {step!r}")
    if not isinstance(seconds, (int, float, np.floating)) or not math.isfinite(seconds) or (
        seconds <= 0
    ):
        raise ValueError(
            f"report of step {step}: seconds must be positive and finite, found {seconds!r} "
            "(the rank's own time on the step: forward and backward, before the gradient "
            "all-reduce)"
        )
    if loss_by_source is None:
        return None
    if not isinstance(loss_by_source, Mapping):
        raise ValueError(
            f"report of step {step}: loss_by_source must be a mapping source name -> mean loss, "
            f"found {type(loss_by_source).__name__}"
        )
    out: dict[str, float] = {}
    for name, loss in loss_by_source.items():
        if names and name not in names:
            raise ValueError(
                f"report of step {step}: loss_by_source names '{name}', which is not a source "
                f"of the plan ({', '.join(names)}): use the names in the batch's source column"
            )
        if not isinstance(loss, (int, float, np.floating)) or not math.isfinite(loss) or loss < 0:
            raise ValueError(
                f"report of step {step}: loss_by_source['{name}'] must be a finite number "
                f">= 0, found {loss!r}"
            )
        out[str(name)] = float(loss)
    return out


def _digest(*arrays: np.ndarray) -> str:
    """A short digest of a decision's inputs (the journal's record of what it saw)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    return h.hexdigest()[:16]


class Feedback:
    """The planner's reports, its refits and adaptations (see the module docstring).

    ``plan_cost``: the plan's cost model (the refit's reference); ``figures``:
    the monitoring counters it fills from reports.
    """

    def __init__(
        self, plan: Plan, plan_cost: CostModel, journal: Journal | None, figures: Figures
    ):
        self.plan, self.names, self.dp = plan, plan.source_names, plan.world.dp
        self.refit_spec = plan.balance.refit
        self.adapt_spec = plan.mixture.adapt if plan.mixture is not None else None
        self.plan_cost, self.journal, self.figures = plan_cost, journal, figures
        self._lock = threading.Lock()  # monitoring reads on its own thread
        # step -> (S1, S2, predicted cost) per rank, and the seconds per cost of the model it
        # was planned with (NaN: the plan's, not refit); step -> measured seconds per rank (NaN)
        self._features: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray, float]] = (
            OrderedDict()
        )
        self._seconds: dict[int, np.ndarray] = {}
        n = len(self.names)
        self._loss_sum, self._loss_n = np.zeros(n), np.zeros(n)
        self.received = self.dropped = self.refits_total = 0
        self._slope = [0.0, 0.0]  # sum cost * seconds, sum cost**2: seconds per cost, unrefit
        self.error = math.nan  # the most loaded rank's relative error, last complete step
        # decisions by step, kept across rewinds: a step planned again applies its own
        self._cost_at: dict[int, list[float]] = {}  # step -> [alpha, beta, scale]
        self._log_at: dict[int, list[float]] = {}  # step -> log-weights (plan order)
        self._frontier = -1  # the last step decided: steps up to it are never decided anew
        self.lo, self.hi = bounds_of(self.names, self.adapt_spec.bounds if self.adapt_spec else {})
        self.restore(None)

    # ---- the state ------------------------------------------------------------------------

    def restore(self, section: Mapping[str, Any] | None) -> None:
        """Start from a state's ``feedback`` key (None: the plan's model and weights).

        What the plan no longer asks for is dropped: resumed without
        ``balance.refit``, the plan's model balances again; without
        ``mixture.adapt``, the schedule's weights hold.
        """
        section = dict(section or {})
        if self.refit_spec is None:
            section.pop("cost", None)
        if self.adapt_spec is None:
            section.pop("mix", None)
        cost, mix = section.get("cost") or {}, section.get("mix") or {}
        self.cost = self.plan_cost
        self.scale: float | None = None
        if cost:
            self.cost = _with(self.plan_cost, cost["alpha"], cost["beta"])
            self.scale = float(cost["scale"])
        self.refits: list[list[float]] = [list(r) for r in cost.get("refits", [])]
        logs = mix.get("log", {})
        self.log = np.array([float(logs.get(n, 0.0)) for n in self.names])
        self.adapts: list[list[Any]] = [list(a) for a in mix.get("adapts", [])]
        used = mix.get("weights")
        self.used = None if used is None else [float(used[n]) for n in self.names]
        self._section: dict[str, Any] | None = section or None

    def recorded(self, deltas: Mapping[int, Mapping[str, Any]]) -> None:
        """Decisions a journal recorded for steps planned again (a planner restarted on it).

        ``deltas``: the journal's deltas of the steps planned again; planning step
        ``s`` decided what holds from ``s + 1``.
        """
        for step, change in sorted(deltas.items()):
            self._frontier = max(self._frontier, step + 1)
            f = change.get("f") or {}
            for s, a, b, scale in (f.get("cost") or {}).get("refits", []):
                self._cost_at.setdefault(int(s), [a, b, scale])
            for s, logs in (f.get("mix") or {}).get("adapts", []):
                self._log_at.setdefault(int(s), [float(logs[n]) for n in self.names])

    def follow(self, found: Mapping[str, Mapping[int, Any]]) -> None:
        """Apply decisions another run recorded (:func:`decisions`) and decide nothing anew.

        Replaying a run: its steps get its refits and adaptations, at its steps,
        whatever this run's trainers report.
        """
        for step, (alpha, beta, scale) in found.get("cost", {}).items():
            self._cost_at[int(step)] = [alpha, beta, scale]
        for step, logs in found.get("mix", {}).items():
            self._log_at[int(step)] = [float(logs[n]) for n in self.names]
        self._frontier = 2**62  # every step is a recorded one

    def section(self) -> dict[str, Any] | None:
        """The state's ``feedback`` key before the next step (None: nothing refit or adapted)."""
        return self._section

    def _write_section(self) -> None:
        out: dict[str, Any] = {}
        if self.refits:
            alpha, beta, scale = self.cost.alpha, self.cost.beta, self.scale
            out["cost"] = {"alpha": alpha, "beta": beta, "scale": scale, "refits": self.refits}
        if self.adapt_spec is not None:
            out["mix"] = {
                "log": dict(zip(self.names, self.log.tolist())),
                "weights": dict(zip(self.names, self.used or [])),
                "adapts": self.adapts,
            }
        self._section = out or None

    # ---- before and after a step is planned -----------------------------------------------

    def before(self, step: int, prior: np.ndarray) -> tuple[CostModel, np.ndarray]:
        """The cost model and mixture weights to plan ``step`` with (``prior``: the schedule's)."""
        weights = prior
        if self.adapt_spec is not None:
            a = self.adapt_spec
            weights = adapted(prior, self.log, self.lo, self.hi, a.floor, a.smoothing)
            used = weights.tolist()
            if used != self.used:  # the state records the weights the step was planned with
                self.used = used
                self._write_section()
        return self.cost, weights

    def after(self, step: int, prior: Callable[[int], np.ndarray]) -> None:
        """``step`` was planned: decide (or apply the recorded) refit and adaptation due next.

        A decision for step ``t`` is taken once ``t - 1`` is planned, so that the
        state before ``t`` (a checkpoint's, a replay's) holds what ``t`` is
        planned with. ``prior``: the schedule's weights at a step.
        """
        t = step + 1
        fresh = t > self._frontier
        self._frontier = max(self._frontier, t)
        changed = False
        if t in self._cost_at:
            changed |= self._apply_cost(t, *self._cost_at[t])
        elif fresh and self._due(self.refit_spec, t):
            changed |= self._refit(t)
        if self.adapt_spec is not None:
            if t in self._log_at:
                changed |= self._apply_log(t, np.array(self._log_at[t]))
            elif fresh and self._due(self.adapt_spec, t):
                changed |= self._adapt(t, prior(t))
        if changed:
            self._write_section()

    @staticmethod
    def _due(spec: Any, step: int) -> bool:
        return spec is not None and step > 0 and step % spec.every == 0

    def planned(self, step: int, columns: Mapping[str, np.ndarray], rank_cost: np.ndarray) -> None:
        """Keep what ``step`` predicts per rank, to pair with the ranks' reports."""
        tokens = columns["tokens"].astype(np.float64)
        s1 = rank_sums(tokens, columns["bounds"])
        s2 = rank_sums(tokens * tokens, columns["bounds"])
        with self._lock:
            scale = math.nan if self.scale is None else self.scale
            self._features[step] = (s1, s2, np.asarray(rank_cost, dtype=np.float64), scale)
            while len(self._features) > KEEP_STEPS:
                old, (_, _, predicted, k) = self._features.popitem(last=False)
                seconds = self._seconds.pop(old, None)
                if seconds is not None and np.isnan(seconds).any():
                    self._journal_step(old, seconds, predicted, k)  # some ranks never reported

    # ---- reports --------------------------------------------------------------------------

    def report(
        self, rank: int, step: int, seconds: float, losses: Mapping[str, float] | None
    ) -> None:
        """Rank ``rank`` trained ``step`` in ``seconds``, with mean ``losses`` per source."""
        if not 0 <= rank < self.dp:
            raise ValueError(f"report: rank {rank} is outside the plan's world (dp={self.dp})")
        losses = check_report(step, seconds, losses, self.names)
        with self._lock:
            kept = self._features.get(step)
            if kept is None:  # too old, or a step not planned: nothing to pair it with
                self.dropped += 1
                return
            self.received += 1
            row = self._seconds.setdefault(step, np.full(self.dp, np.nan))
            # peers of one DP rank (CP, TP, PP) each report: the slowest is the rank's time
            row[rank] = seconds if np.isnan(row[rank]) else max(row[rank], seconds)
            for name, loss in (losses or {}).items():
                i = self.names.index(name)
                self._loss_sum[i] += loss
                self._loss_n[i] += 1
            predicted = kept[2][rank]
            if math.isnan(kept[3]):  # the plan's model: its seconds per cost, fitted as it goes
                self._slope[0] += predicted * seconds
                self._slope[1] += predicted * predicted
            complete = not np.isnan(row).any()
        self.figures.reported(rank, float(predicted), float(seconds))
        if complete:
            self._complete(step, row, kept[2], self._scale_of(kept[3]))

    def _complete(self, step: int, seconds: np.ndarray, predicted: np.ndarray, k: float) -> None:
        """Every rank reported ``step``: the model's error on its most loaded rank; journal it."""
        top = int(np.argmax(predicted))
        if not math.isnan(k):
            self.error = abs(predicted[top] * k - seconds[top]) / seconds[top]
        self.figures.model_error(self.error, self.refits_total)
        self._journal_step(step, seconds, predicted, k)

    def _journal_step(
        self, step: int, seconds: np.ndarray, predicted: np.ndarray, k: float
    ) -> None:
        """A reported step, compactly: each rank's seconds (None: no report), its prediction."""
        if self.journal is None:
            return
        sec = [None if math.isnan(s) else float(s) for s in seconds]
        rec: dict[str, Any] = {"t": "rep", "s": step, "sec": sec, "p": predicted.tolist()}
        k = self._scale_of(k)
        if not math.isnan(k):
            rec["k"] = k
        self.journal._write(rec)

    def _scale_of(self, planned: float) -> float:
        """Seconds per cost of a step planned with a refit of ``planned`` (NaN: not refit)."""
        if not math.isnan(planned):
            return planned
        return self._slope[0] / self._slope[1] if self._slope[1] > 0 else math.nan

    def seconds_per_cost(self) -> float:
        """Seconds per unit of the cost in force: the last refit's, else fitted from reports."""
        return self._scale_of(math.nan if self.scale is None else self.scale)

    # ---- decisions ------------------------------------------------------------------------

    def _samples(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reports of the last ``window`` reported steps before ``step``: S1, S2, seconds."""
        assert self.refit_spec is not None
        with self._lock:
            steps = sorted(s for s in self._seconds if s < step)[-self.refit_spec.window :]
            rows = [(self._features[s], self._seconds[s]) for s in steps if s in self._features]
        if not rows:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        s1 = np.concatenate([f[0] for f, _ in rows])
        s2 = np.concatenate([f[1] for f, _ in rows])
        t = np.concatenate([sec for _, sec in rows])
        ok = ~np.isnan(t) & (s1 > 0)
        return s1[ok], s2[ok], t[ok]

    def _refit(self, step: int) -> bool:
        assert self.refit_spec is not None
        s1, s2, t = self._samples(step)
        if len(t) < self.refit_spec.min_samples:
            return False
        found = refit_cost(s1, s2, t, self.plan_cost, self.plan.batch.max_seq_len)
        if found is None:
            return False
        if self.journal is not None:
            self.journal._write(
                {
                    "t": "fit", "s": step, "alpha": found.alpha, "beta": found.beta,
                    "scale": found.scale, "n": found.samples, "err": found.error,
                    "bounded": found.bounded, "in": _digest(s1, s2, t),
                }
            )  # fmt: skip
        return self._apply_cost(step, found.alpha, found.beta, found.scale)

    def _apply_cost(self, step: int, alpha: float, beta: float, scale: float) -> bool:
        self._cost_at[step] = [alpha, beta, scale]
        self.cost, self.scale = _with(self.plan_cost, alpha, beta), scale
        self.refits = [*self.refits, [step, alpha, beta, scale]][-HISTORY:]
        self.refits_total += 1
        self.figures.model_error(self.error, self.refits_total)
        return True

    def _adapt(self, step: int, prior: np.ndarray) -> bool:
        assert self.adapt_spec is not None
        with self._lock:
            reported = self._loss_n > 0
            losses = np.where(reported, self._loss_sum / np.maximum(self._loss_n, 1), np.nan)
            self._loss_sum[:], self._loss_n[:] = 0.0, 0.0
        if not reported.any():
            return False
        log = adapt_log(self.log, losses, prior / prior.sum(), self.adapt_spec.eta)
        if self.journal is not None:
            self.journal._write(
                {
                    "t": "mix", "s": step, "log": dict(zip(self.names, log.tolist())),
                    "in": _digest(np.nan_to_num(losses, nan=-1.0), prior),
                }
            )  # fmt: skip
        return self._apply_log(step, log)

    def _apply_log(self, step: int, log: np.ndarray) -> bool:
        self._log_at[step] = log.tolist()
        self.log = log
        self.adapts = [*self.adapts, [step, dict(zip(self.names, log.tolist()))]][-HISTORY:]
        return True

    def weights(self, prior: np.ndarray) -> np.ndarray:
        """The weights in force for a step whose schedule gives ``prior`` (monitoring)."""
        a = self.adapt_spec
        if a is None:
            return prior
        return adapted(prior, self.log, self.lo, self.hi, a.floor, a.smoothing)

    # ---- readings -------------------------------------------------------------------------

    def step_reports(self, step: int) -> dict[int, dict[str, float | None]] | None:
        """Each rank's predicted cost and reported seconds for ``step`` (None: not kept).

        ``{rank: {"seconds": s or None, "predicted": cost, "predicted_seconds": p}}``,
        the shape of :func:`reports`; ``predicted_seconds`` (the cost times the
        seconds per cost of the model the step was planned with) once known.
        """
        with self._lock:
            kept = self._features.get(step)
            if kept is None:
                return None
            seconds = self._seconds.get(step, np.full(self.dp, np.nan))
            k = self._scale_of(kept[3])
            return {
                r: {
                    "seconds": None if math.isnan(seconds[r]) else float(seconds[r]),
                    "predicted": float(kept[2][r]),
                    **({} if math.isnan(k) else {"predicted_seconds": float(kept[2][r] * k)}),
                }
                for r in range(self.dp)
            }

    def stats(self) -> dict[str, Any]:
        """Reports received and dropped, refits, the model in force and its error."""
        return {
            "received": self.received,
            "dropped": self.dropped,
            "refits": self.refits_total,
            "alpha": self.cost.alpha,
            "beta": self.cost.beta,
            "seconds_per_cost": self.seconds_per_cost(),
            "cost_model_error": self.error,
            "adapts": len(self.adapts),
        }


def _with(plan_cost: CostModel, alpha: float, beta: float) -> CostModel:
    """The plan's model with a refit's alpha and beta (its image terms as they were)."""
    return CostModel(float(alpha), float(beta), plan_cost.patch_alpha, plan_cost.patch_beta)


def reports(directory: str | Path) -> dict[int, dict[int, dict[str, float | None]]]:
    """Every reported step a planner's journal holds: predicted cost and measured seconds.

    Returns ``{step: {rank: {"seconds": s, "predicted": p}}}``: ``seconds`` is
    the rank's reported time on the step (None where it did not report),
    ``predicted`` the cost-model cost the planner balanced it with (in the
    plan's units; times ``seconds_per_cost`` gives seconds), and, where the
    journal knew it, ``"predicted_seconds"``. Steps are those the journal's
    segments still hold (a journal drops segments no recovery needs).
    """
    out: dict[int, dict[int, dict[str, float | None]]] = {}
    for path in segments(Path(directory)):
        records, _, _ = read_segment(path, strict=False)
        for rec in records:
            if rec.get("t") != "rep":
                continue
            predicted, k = rec["p"], rec.get("k")
            out[int(rec["s"])] = {
                r: {
                    "seconds": s,
                    "predicted": float(p),
                    **({"predicted_seconds": float(p) * k} if k is not None else {}),
                }
                for r, (s, p) in enumerate(zip(rec["sec"], predicted))
            }
    return dict(sorted(out.items()))


def decisions(directory: str | Path) -> dict[str, dict[int, Any]]:
    """The refits and adaptations a planner's journal recorded, by the step they hold from.

    ``{"cost": {step: [alpha, beta, seconds_per_cost]}, "mix": {step: {source:
    log-weight}}}``, from each segment's snapshot (the state lists the last
    :data:`HISTORY` of each) and the ``fit`` and ``mix`` records after it; what
    :meth:`Feedback.follow` applies to replay the run.
    """
    out: dict[str, dict[int, Any]] = {"cost": {}, "mix": {}}
    for path in segments(Path(directory)):
        records, _, _ = read_segment(path, strict=False)
        for rec in records:
            t = rec.get("t")
            if t == "snap":
                f = rec["state"].get("feedback") or {}
                for s, a, b, k in (f.get("cost") or {}).get("refits", []):
                    out["cost"][int(s)] = [a, b, k]
                for s, logs in (f.get("mix") or {}).get("adapts", []):
                    out["mix"][int(s)] = dict(logs)
            elif t == "fit":
                out["cost"][int(rec["s"])] = [rec["alpha"], rec["beta"], rec["scale"]]
            elif t == "mix":
                out["mix"][int(rec["s"])] = dict(rec["log"])
    return out
