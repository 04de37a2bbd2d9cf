"""The hybrid cost: what an item costs the vision encoder and the LLM, apart.

An image of ``n`` patches costs the encoder ``alpha_e * n + beta_e * n**2``
(attention within the image; ``alpha_e = 6 * params`` and ``beta_e = 6 *
layers * hidden`` of the encoder, ``balance.cost.encoder``); the fused
sequence of ``L`` tokens costs the LLM ``alpha * L + beta * L**2``. The two run
one after the other, so a rank's step time is their sum: ``balance.modules:
hybrid`` balances that sum, ``llm`` the LLM term alone (the usual baseline).
"""

from __future__ import annotations

import numpy as np

from overlord.plan.cost import CostModel
from overlord.plan.cp import cp_cost
from overlord.plan.vision import Modules
from overlord.world import CPLayout


def encoder_model(cost: CostModel) -> CostModel:
    """The encoder's cost per image as a CostModel over patch counts."""
    return CostModel(cost.patch_alpha, cost.patch_beta)


def module_costs(
    model: CostModel,
    tokens: np.ndarray,
    patches: np.ndarray,
    cp: int,
    layout: CPLayout | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each item's LLM cost and encoder cost to one rank of its CP group.

    Under CP each rank of the group holds ``1/cp`` of the group's work, the
    encoder's too (its images are split among the CP ranks).

    >>> m = CostModel(1.0, 0.0, patch_alpha=2.0, patch_beta=1.0)
    >>> llm, enc = module_costs(m, np.array([4, 4]), np.array([0, 3]), 1, None)
    >>> llm.tolist(), enc.tolist()
    ([4.0, 4.0], [0.0, 15.0])
    """
    llm = cp_cost(CostModel(model.alpha, model.beta), tokens, None, cp, layout)
    enc = encoder_model(model).cost(np.asarray(patches)) / max(cp, 1)
    return llm, enc


def balance_cost(modules: Modules, llm: np.ndarray, encoder: np.ndarray) -> np.ndarray:
    """The cost the balancer minimises the most loaded rank's sum of.

    >>> balance_cost(Modules.LLM, np.array([1.0]), np.array([2.0])).tolist()
    [1.0]
    """
    return llm + encoder if modules is Modules.HYBRID else llm
