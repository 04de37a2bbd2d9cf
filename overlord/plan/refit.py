"""The rules that turn trainers' reports into a new cost model or new mixture weights.

Pure functions over arrays; :mod:`overlord.roles.feedback` collects the reports,
decides when to call them, and records what they return.

**The refit.** A rank's step is predicted from its documents' sums
``S1 = sum L`` and ``S2 = sum L**2`` (``alpha * S1 + beta * S2``); its
measured seconds give the same equation in seconds
(:func:`overlord.plan.cost.fit_sums`). Balancing depends only on the ratio
``beta / alpha``, so the refit keeps the plan's ``alpha`` and moves ``beta``:
the new model is ``alpha0`` and ``alpha0 * rho``, where ``rho`` is the fitted
``beta / alpha``, held within :data:`REFIT_FACTOR` times the plan's ratio both
ways (within ``[0, REFIT_FACTOR / max_seq_len]`` for a plan whose beta is 0, a
quadratic term at most that many times the linear one at a full row). Where
the free fit falls outside those bounds (or below zero), the best fit on the
bound is taken: the model stays monotone and cannot run away on noise. The
seconds per unit of cost (``scale``) is kept to report predictions in seconds.

**The adaptive mixture** follows the exponentiated-gradient rule of DoReMi
(Xie et al. 2023, arXiv 2305.10429) and Online Data Mixing (Albalak et al.
2023, arXiv 2312.02406): each source's log-weight grows by ``eta`` times its
excess loss, here its mean reported loss over the mixture's mean loss minus
one, so a source whose loss stays high gains weight. The weights in force at a
step are the schedule's (the prior) times ``exp(log-weight)``, normalized,
mixed with ``smoothing`` of the prior, then held within each source's bounds
and above the floor (:func:`bounded`). A source the schedule gives no weight
keeps none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from overlord.plan.cost import CostModel, fit_sums

# the refitted beta/alpha stays within this factor of the plan's, both ways
REFIT_FACTOR = 16.0
# a log-weight never moves past this (exp stays finite, a source can come back)
LOG_LIMIT = 30.0


@dataclass(frozen=True)
class Refit:
    """What a refit found: the model to balance with, and how well it fits.

    ``alpha`` and ``beta`` are in the plan's units (``alpha`` is the plan's);
    ``scale`` is seconds per unit of cost; ``error`` the fit's root mean
    square relative error over its samples; ``bounded`` whether the free fit
    was outside the bounds (or negative) and the bound was taken.
    """

    alpha: float
    beta: float
    scale: float
    samples: int
    error: float
    bounded: bool


def ratio_bounds(plan: CostModel, max_seq_len: int) -> tuple[float, float]:
    """The range the refitted ``beta / alpha`` stays within (see the module docstring).

    >>> ratio_bounds(CostModel(1.0, 0.5), 8)
    (0.03125, 8.0)
    >>> ratio_bounds(CostModel(1.0, 0.0), 8)
    (0.0, 2.0)
    """
    if plan.beta > 0:
        rho = plan.beta / plan.alpha
        return rho / REFIT_FACTOR, rho * REFIT_FACTOR
    return 0.0, REFIT_FACTOR / max_seq_len


def refit_cost(
    s1: np.ndarray, s2: np.ndarray, seconds: np.ndarray, plan: CostModel, max_seq_len: int
) -> Refit | None:
    """Refit ``plan``'s ``beta`` to measured ``seconds`` of ranks whose sums are ``s1``, ``s2``.

    None where the samples cannot tell alpha from beta (every rank's
    ``S2 / S1`` alike), or ``plan`` has no linear term (``alpha`` 0: nothing
    to move beta against). ``seconds`` must be positive and finite.

    >>> s1 = np.array([100.0, 100.0, 200.0]); s2 = np.array([1000.0, 5000.0, 4000.0])
    >>> r = refit_cost(s1, s2, 2 * s1 + 0.1 * s2, CostModel(1.0, 0.02), 64)
    >>> round(r.beta, 9), round(r.scale, 9), r.bounded
    (0.05, 2.0, False)
    """
    if plan.alpha <= 0:
        return None
    lo, hi = ratio_bounds(plan, max_seq_len)
    s1, s2, t = (np.asarray(x, dtype=np.float64) for x in (s1, s2, seconds))
    try:
        free = fit_sums(s1, s2, t, monotone=False).model
    except ValueError:
        return None  # S1 and S2 move together: no information on their ratio
    p, q = free.alpha, free.beta
    if p > 0 and lo <= q / p <= hi:
        return _refit(plan, q / p, p, s1, s2, t, bounded=False)
    best: Refit | None = None
    for rho in (lo, hi):  # a convex fit outside a cone: its best is on a boundary ray
        x = (s1 + rho * s2) / t
        scale = float(x.sum() / (x * x).sum())
        found = _refit(plan, rho, scale * plan.alpha, s1, s2, t, bounded=True)
        if best is None or found.error < best.error:
            best = found
    return best


def _refit(
    plan: CostModel, rho: float, p: float, s1: np.ndarray, s2: np.ndarray, t: np.ndarray,
    bounded: bool,
) -> Refit:
    """The refit at ratio ``rho`` whose seconds per token is ``p``."""
    residual = p * (s1 + rho * s2) / t - 1.0
    error = float(np.sqrt(np.mean(residual * residual)))
    return Refit(plan.alpha, plan.alpha * rho, p / plan.alpha, len(t), error, bounded)


def excess_loss(losses: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Each source's mean loss over the mixture's mean loss, minus one (0 where not reported).

    ``losses`` holds NaN for a source without reports; the mixture's mean is
    weighted by ``prior`` over the reported sources.

    >>> excess_loss(np.array([2.0, 1.0, np.nan]), np.array([0.5, 0.5, 0.0])).round(4).tolist()
    [0.3333, -0.3333, 0.0]
    """
    seen = ~np.isnan(losses)
    w = np.where(seen, prior, 0.0)
    if not seen.any() or w.sum() <= 0:
        return np.zeros(len(losses))
    mean = float((np.where(seen, losses, 0.0) * w).sum() / w.sum())
    if mean <= 0:
        return np.zeros(len(losses))
    return np.where(seen, losses / mean - 1.0, 0.0)


def adapt_log(log: np.ndarray, losses: np.ndarray, prior: np.ndarray, eta: float) -> np.ndarray:
    """The log-weights after one exponentiated-gradient step on reported ``losses``.

    >>> adapt_log(np.zeros(2), np.array([2.0, 1.0]), np.array([0.5, 0.5]), 1.0).round(3).tolist()
    [0.333, -0.333]
    """
    out = log + eta * excess_loss(losses, prior)
    return np.clip(out, -LOG_LIMIT, LOG_LIMIT)


def adapted(
    prior: np.ndarray,
    log: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    floor: float,
    smoothing: float,
) -> np.ndarray:
    """The weights in force: ``prior * exp(log)``, smoothed toward the prior, then bounded.

    >>> w = adapted(np.array([0.5, 0.5]), np.array([1.0, 0.0]), np.zeros(2), np.ones(2), 0, 0)
    >>> w.round(4).tolist()
    [0.7311, 0.2689]
    """
    prior = prior / prior.sum()
    raw = prior * np.exp(log - log.max())
    w = raw / raw.sum()
    w = (1.0 - smoothing) * w + smoothing * prior
    return bounded(w, np.maximum(lo, floor), hi, active=prior > 0)


def bounded(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, active: np.ndarray) -> np.ndarray:
    """``w`` held within ``[lo, hi]`` per source, summing to 1: ``clip(c * w, lo, hi)``.

    The sources at a bound stay there and the others share the rest in
    proportion to their weights (``c`` found by bisection: the sum grows with
    it). Inactive sources stay at 0; where the active bounds leave no room
    (their minimums sum above 1, or no ``c`` reaches 1), the minimums or
    maximums are scaled to sum to 1.

    >>> bounded(np.array([0.9, 0.1]), np.array([0.0, 0.3]), np.ones(2),
    ...         np.array([True, True])).round(6).tolist()
    [0.7, 0.3]
    """
    lo, hi = np.where(active, lo, 0.0), np.where(active, hi, 0.0)
    w = np.where(active, w, 0.0)
    if lo.sum() >= 1.0:
        return lo / lo.sum()
    top = np.where(w > 0, hi, lo)
    if top.sum() <= 1.0:
        return top / top.sum()
    a, b = 0.0, float((hi[w > 0] / w[w > 0]).max())
    for _ in range(200):  # to the float's precision, a fixed number of steps: reproducible
        c = 0.5 * (a + b)
        if np.clip(c * w, lo, hi).sum() < 1.0:
            a = c
        else:
            b = c
    out = np.clip(b * w, lo, hi)
    return out / out.sum()


def bounds_of(names: Sequence[str], bounds: dict[str, tuple[float, float]]) -> tuple[
    np.ndarray, np.ndarray
]:
    """Each source's ``[min, max]`` in plan order (``[0, 1]`` where not given)."""
    lo = np.array([float(bounds.get(n, (0.0, 1.0))[0]) for n in names])
    hi = np.array([float(bounds.get(n, (0.0, 1.0))[1]) for n in names])
    return lo, hi
