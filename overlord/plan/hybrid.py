"""The hybrid cost: what an item costs the vision encoder and the LLM, apart.

An image of ``n`` patches costs the encoder ``alpha_e * n + beta_e * n**2``
(attention within the image; ``alpha_e = 6 * params`` and ``beta_e = 6 *
layers * hidden`` of the encoder, ``balance.cost.encoder``); the fused
sequence of ``L`` tokens costs the LLM ``alpha * L + beta * L**2``. The two run
one after the other, so a rank's step time is their sum: ``balance.modules:
hybrid`` balances that sum, ``llm`` the LLM term alone (the usual baseline).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from overlord.plan.balance import rank_costs
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
    per_rank: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each item's LLM cost and encoder cost to one rank of its CP group.

    Under CP each rank of the group holds ``1/cp`` of the group's work, the
    encoder's too (its images are split among the CP ranks). ``per_rank``:
    ``cp: dynamic`` (see :func:`overlord.plan.cp.cp_cost`).

    >>> m = CostModel(1.0, 0.0, patch_alpha=2.0, patch_beta=1.0)
    >>> llm, enc = module_costs(m, np.array([4, 4]), np.array([0, 3]), 1, None)
    >>> llm.tolist(), enc.tolist()
    ([4.0, 4.0], [0.0, 15.0])
    """
    llm = cp_cost(CostModel(model.alpha, model.beta), tokens, None, cp, layout, per_rank)
    enc = encoder_model(model).cost(np.asarray(patches)) / max(cp, 1)
    return llm, enc


def assign_modules(
    modules: Modules,
    llm: np.ndarray,
    enc: np.ndarray,
    dp: int,
    rows_per_rank: int,
    assign_by: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """Each item's global row, balancing what ``modules`` says; ``assign_by(cost)`` balances.

    ``hybrid`` balances the sum of both costs, and also the LLM's alone, and
    keeps whichever assignment leaves the most loaded rank's *sum* lower: it
    is never worse than ``llm`` on the step's cost, whatever the heuristic
    does. With no image in the step it is one assignment, as for text.
    """
    if modules is Modules.LLM or not enc.any():
        return assign_by(llm)
    total = llm + enc
    both, alone = assign_by(total), assign_by(llm)
    worst = [rank_costs(total, r, dp, rows_per_rank).max() for r in (both, alone)]
    return both if worst[0] <= worst[1] else alone
