"""``overlord.plan.cost``: the cost model of a document. Pure."""

from __future__ import annotations

import numpy as np

from overlord.plan.cost import CostModel
from overlord.plan.spec import CostSpec


def test_cost_model_from_model_shape():
    m = CostModel.from_spec(CostSpec(model={"params": 7e9, "layers": 32, "hidden": 4096}))
    assert m.alpha == 6 * 7e9 and m.beta == 6 * 32 * 4096
    np.testing.assert_allclose(m.cost(np.array([1000])), [6 * 7e9 * 1000 + 6 * 32 * 4096 * 1e6])
    shape = {"params": 7e9, "layers": 32, "hidden": 4096, "attention_factor": 2.0}
    slow_attention = CostModel.from_spec(CostSpec(model=shape))
    assert slow_attention.alpha == m.alpha and slow_attention.beta == 2 * m.beta
