"""The cost model: what one document costs the trainer, from metadata only.

``CostModel.fit`` (and ``fit_cost``, which also reports the fixed overhead)
measure alpha and beta from the trainer's own step times instead of the
model's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from overlord.plan.spec import CostSpec


@dataclass(frozen=True)
class CostModel:
    """``alpha * L + beta * L**2`` per document of L tokens, plus an image-encoder term.

    With a model shape, ``alpha = 6 * params`` (dense matmuls, forward and
    backward) and ``beta = 6 * layers * hidden * attention_factor`` (causal
    attention over a document-masked pack, where each document attends only to
    itself; attention kernels run fewer FLOP/s than matmuls, by the factor).

    >>> CostModel(alpha=1.0, beta=0.5).cost(np.array([2, 4])).tolist()
    [4.0, 12.0]
    """

    alpha: float
    beta: float
    patch_alpha: float = 0.0
    patch_beta: float = 0.0

    @classmethod
    def from_spec(cls, spec: CostSpec) -> CostModel:
        """Build from the plan's ``balance.cost``."""
        pa, pb = spec.patch_alpha, spec.patch_beta
        if spec.encoder is not None:  # overlord.plan.hybrid: attention within each image
            e = spec.encoder
            pa, pb = 6.0 * e.params, 6.0 * e.layers * e.hidden * e.attention_factor
        if spec.model is not None:
            m = spec.model
            beta = 6.0 * m.layers * m.hidden * m.attention_factor
            return cls(6.0 * m.params, beta, pa, pb)
        assert spec.alpha is not None and spec.beta is not None  # checked by plan validation
        return cls(spec.alpha, spec.beta, pa, pb)

    @classmethod
    def fit(
        cls, lengths: Sequence[ArrayLike], ms: ArrayLike, *, intercept: bool = False
    ) -> CostModel:
        """Alpha and beta fitted to measured times of packed micro-batches.

        ``lengths[i]`` holds the document lengths of micro-batch ``i`` and
        ``ms[i]`` its measured time (forward and backward). See ``fit_cost``,
        which this calls, for the fit, its units and the errors it raises; with
        ``intercept=True`` a fixed time per micro-batch is fitted and dropped.

        >>> docs = [[8], [4, 4], [2, 2, 2, 2], [8, 8]]
        >>> ms = [8 + 64 / 4, 8 + 32 / 4, 8 + 16 / 4, 16 + 128 / 4]
        >>> m = CostModel.fit(docs, ms)
        >>> round(m.alpha, 9), round(m.beta, 9)
        (1.0, 0.25)
        """
        return fit_cost(lengths, ms, intercept=intercept).model

    def cost(self, tokens: np.ndarray, patches: np.ndarray | None = None) -> np.ndarray:
        """Cost of each item (float64)."""
        t = tokens.astype(np.float64)
        c = self.alpha * t + self.beta * t * t
        if patches is not None and (self.patch_alpha or self.patch_beta):
            p = patches.astype(np.float64)
            c += self.patch_alpha * p + self.patch_beta * p * p
        return c


@dataclass(frozen=True)
class CostFit:
    """What ``fit_cost`` found: the cost model and the fixed time per micro-batch."""

    model: CostModel
    intercept: float  # time per micro-batch whatever it holds; 0.0 when not fitted


def fit_cost(lengths: Sequence[ArrayLike], ms: ArrayLike, *, intercept: bool = False) -> CostFit:
    """Fit ``ms = alpha * S1 + beta * S2 (+ c)`` per micro-batch by least squares.

    For micro-batch ``i``, ``S1 = sum(L)`` and ``S2 = sum(L**2)`` over the
    lengths ``L`` of its documents (``lengths[i]``), and ``ms[i]`` is its
    measured time. The fit minimises the squared *relative* error, so short
    and long micro-batches weigh alike. Alpha and beta come out in the time
    unit of ``ms`` per token and per token squared; only their ratio matters to
    balancing, so any unit will do.

    To separate alpha from beta the micro-batches must not all have the same
    S2 / S1: measure rows of the same tokens split into documents of different
    lengths (one long document, many short ones). To separate the intercept
    as well, measure at two or more token counts.

    Parameters
    ----------
    lengths : sequence of array_like of int
        Per measured micro-batch, the lengths of its documents (padding that
        the trainer computes on counts as documents too).
    ms : array_like of float
        Per micro-batch, the measured time; positive and finite.
    intercept : bool
        Fit a fixed time per micro-batch too (kernel launches, optimizer-free
        overhead), reported in ``CostFit.intercept`` and left out of the model.

    Returns
    -------
    CostFit
        ``model`` (alpha, beta; no image term) and ``intercept``.

    Raises
    ------
    ValueError
        When the inputs do not match (one time per micro-batch), a time is not
        positive and finite, a length is negative, there are fewer micro-batches
        than parameters, the micro-batches cannot tell the parameters apart, or
        the fit gives a negative alpha or beta (a cost that falls as documents
        grow: noise larger than the attention term, or too narrow a range of S2).

    Examples
    --------
    >>> docs = [[8], [4, 4], [2, 2, 2, 2], [16], [8, 8]]
    >>> ms = [2 + 8 + 64 / 4, 2 + 8 + 32 / 4, 2 + 8 + 16 / 4, 2 + 16 + 256 / 4, 2 + 16 + 128 / 4]
    >>> f = fit_cost(docs, ms, intercept=True)
    >>> round(f.model.alpha, 9), round(f.model.beta, 9), round(f.intercept, 9)
    (1.0, 0.25, 2.0)
    """
    t = np.asarray(ms, dtype=np.float64)
    if t.ndim != 1 or len(t) != len(lengths):
        raise ValueError(
            f"one time per micro-batch expected: {len(lengths)} micro-batches of lengths, "
            f"times of shape {t.shape}"
        )
    if not np.isfinite(t).all() or (t <= 0).any():
        bad = int(np.flatnonzero(~np.isfinite(t) | (t <= 0))[0])
        raise ValueError(
            f"every time must be positive and finite; ms[{bad}] = {t[bad]}: "
            "leave out micro-batches that were not measured"
        )
    s1 = np.zeros(len(t))
    s2 = np.zeros(len(t))
    for i, docs in enumerate(lengths):
        length = np.asarray(docs, dtype=np.float64).reshape(-1)
        if (length < 0).any():
            raise ValueError(f"document lengths must be >= 0; lengths[{i}] has {length.min()}")
        s1[i], s2[i] = length.sum(), (length * length).sum()
    return fit_sums(s1, s2, t, intercept=intercept)


def fit_sums(
    s1: np.ndarray, s2: np.ndarray, ms: np.ndarray, *, intercept: bool = False,
    monotone: bool = True,
) -> CostFit:
    """``fit_cost`` from each micro-batch's sums ``S1 = sum L`` and ``S2 = sum L**2``.

    What the planner knows of a rank's step without its lengths (the refit,
    :mod:`overlord.plan.refit`). ``ms`` must be positive and finite. With
    ``monotone=False`` a negative alpha or beta is returned instead of raised
    (the caller bounds it); a fit that cannot tell the parameters apart still
    raises ``ValueError``.

    >>> f = fit_sums(np.array([8.0, 8.0]), np.array([64.0, 16.0]), np.array([24.0, 12.0]))
    >>> round(f.model.alpha, 9), round(f.model.beta, 9)
    (1.0, 0.25)
    """
    t = np.asarray(ms, dtype=np.float64)
    names = ["alpha", "beta"] + (["intercept"] if intercept else [])
    cols = [s1, s2] + ([np.ones(len(t))] if intercept else [])
    if len(t) < len(cols):
        raise ValueError(
            f"{len(t)} micro-batches cannot fit {len(cols)} parameters ({', '.join(names)}): "
            f"measure at least {len(cols)}, better a few per token count"
        )
    a = np.stack(cols, axis=1) / t[:, None]  # relative error: divide each equation by its time
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    sv = np.linalg.svd(a / scale, compute_uv=False)
    if sv[-1] <= 1e-9 * sv[0]:
        raise ValueError(
            f"the micro-batches cannot tell {', '.join(names)} apart (S1 = sum L and "
            "S2 = sum L**2 move together"
            + (", or S1 is the same in all" if intercept else "")
            + "): measure rows of the same tokens cut into documents of different lengths"
            + (", at two or more token counts" if intercept else "")
        )
    coef, *_ = np.linalg.lstsq(a / scale, np.ones(len(t)), rcond=None)
    coef = coef / scale
    alpha, beta = float(coef[0]), float(coef[1])
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value < 0 and monotone:
            raise ValueError(
                f"the fit gives {name} = {value:.3g} < 0, a cost that falls as "
                + ("tokens" if name == "alpha" else "documents at the same tokens")
                + " grow: the noise in the times is larger than that term, or the range "
                "of S2 = sum L**2 is too narrow; measure more repetitions and rows from "
                "one long document down to many short ones"
                + ("" if intercept else ", or fit with intercept=True")
            )
    return CostFit(CostModel(alpha, beta), float(coef[2]) if intercept else 0.0)
