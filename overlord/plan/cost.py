"""The cost model: what one document costs the trainer, from metadata only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        if spec.model is not None:
            m = spec.model
            beta = 6.0 * m.layers * m.hidden * m.attention_factor
            return cls(6.0 * m.params, beta, spec.patch_alpha, spec.patch_beta)
        assert spec.alpha is not None and spec.beta is not None  # checked by plan validation
        return cls(spec.alpha, spec.beta, spec.patch_alpha, spec.patch_beta)

    def cost(self, tokens: np.ndarray, patches: np.ndarray | None = None) -> np.ndarray:
        """Cost of each item (float64)."""
        t = tokens.astype(np.float64)
        c = self.alpha * t + self.beta * t * t
        if patches is not None and (self.patch_alpha or self.patch_beta):
            p = patches.astype(np.float64)
            c += self.patch_alpha * p + self.patch_beta * p * p
        return c
