"""CostModel.fit: alpha and beta from measured micro-batch times; the benchmarks.cost_fit run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from overlord.plan.cost import CostModel, fit_cost

ROOT = Path(__file__).resolve().parent.parent


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def rows(rng: np.random.Generator, contexts=(1024, 2048, 4096), per_context: int = 12) -> list:
    """Rows of each context's tokens cut into documents, from one document to many short ones."""
    out = []
    for cap in contexts:
        for _ in range(per_context):
            cuts = np.sort(rng.choice(np.arange(1, cap), size=rng.integers(0, 40), replace=False))
            out.append(np.diff(np.concatenate(([0], cuts, [cap]))))
    return out


def times(docs: list, alpha: float, beta: float, c: float = 0.0) -> np.ndarray:
    return np.array([alpha * d.sum() + beta * (d.astype(float) ** 2).sum() + c for d in docs])


def test_fit_recovers_alpha_and_beta_from_noiseless_times():
    docs = rows(np.random.default_rng(0))
    m = CostModel.fit(docs, times(docs, 3e-3, 2e-6))
    assert m.alpha == pytest.approx(3e-3, rel=1e-9)
    assert m.beta == pytest.approx(2e-6, rel=1e-9)
    assert (m.patch_alpha, m.patch_beta) == (0.0, 0.0)


def test_fit_with_intercept_reports_the_overhead_and_leaves_it_out_of_the_model():
    docs = rows(np.random.default_rng(1))
    f = fit_cost(docs, times(docs, 3e-3, 2e-6, c=0.7), intercept=True)
    assert f.model.alpha == pytest.approx(3e-3, rel=1e-8)
    assert f.model.beta == pytest.approx(2e-6, rel=1e-8)
    assert f.intercept == pytest.approx(0.7, rel=1e-8)
    assert CostModel.fit(docs, times(docs, 3e-3, 2e-6, c=0.7), intercept=True) == f.model
    assert fit_cost(docs, times(docs, 3e-3, 2e-6)).intercept == 0.0


def test_fit_recovers_alpha_and_beta_from_noisy_times():
    rng = np.random.default_rng(2)
    docs = rows(rng, per_context=40)
    t = times(docs, 3e-3, 2e-6) * (1 + 0.02 * rng.standard_normal(len(docs)))  # 2% noise
    m = CostModel.fit(docs, t)
    assert m.alpha == pytest.approx(3e-3, rel=0.02)
    assert m.beta == pytest.approx(2e-6, rel=0.1)
    # the fitted model ranks rows as the true one does where they differ clearly
    true = CostModel(3e-3, 2e-6)
    one_doc, many = np.array([4096]), np.full(128, 32)
    assert m.cost(one_doc).sum() > 2 * m.cost(many).sum()
    assert true.cost(one_doc).sum() > 2 * true.cost(many).sum()


def test_fit_takes_plain_lists_and_the_units_of_the_times():
    docs = [[8], [4, 4], [2, 2, 2, 2], [8, 8]]
    ms = [8 + 64 / 4, 8 + 32 / 4, 8 + 16 / 4, 16 + 128 / 4]
    m = CostModel.fit(docs, ms)
    assert (m.alpha, m.beta) == pytest.approx((1.0, 0.25))
    seconds = CostModel.fit(docs, [x / 1000 for x in ms])
    assert (seconds.alpha, seconds.beta) == pytest.approx((1e-3, 2.5e-4))


@pytest.mark.parametrize(
    ("docs", "ms", "message"),
    [
        ([[8], [4, 4]], [1.0, 2.0, 3.0], "one time per micro-batch"),
        ([[8], [4, 4]], [[1.0, 2.0]], "one time per micro-batch"),
        ([[8]], [1.0], "1 micro-batches cannot fit 2 parameters"),
        ([[8], [4, 4]], [1.0, 2.0], "2 micro-batches cannot fit 3 parameters"),
        ([[8], [4, 4]], [1.0, float("nan")], r"ms\[1\] = nan"),
        ([[8], [4, 4]], [1.0, 0.0], "positive and finite"),
        ([[8], [4, -4]], [1.0, 2.0], "lengths must be >= 0"),
        ([[4, 4], [4, 4, 4, 4]], [1.0, 2.0], "cannot tell alpha, beta apart"),
    ],
)
def test_fit_rejects_bad_input(docs, ms, message):
    intercept = "3 parameters" in message  # the one case fitted with an intercept
    with pytest.raises(ValueError, match=message):
        fit_cost(docs, ms, intercept=intercept)


def test_fit_rejects_an_intercept_it_cannot_separate_from_alpha():
    docs = rows(np.random.default_rng(3), contexts=(2048,))  # every row holds 2048 tokens
    with pytest.raises(ValueError, match="two or more token counts"):
        fit_cost(docs, times(docs, 3e-3, 2e-6, c=0.5), intercept=True)


def test_fit_rejects_a_negative_beta_and_says_why():
    # at the same tokens, the rows cut into more documents take longer: beta < 0
    docs = [[8], [4, 4], [2, 2, 2, 2], [16], [8, 8]]
    s2 = np.array([64, 32, 16, 256, 128])
    ms = np.array([8, 8, 8, 16, 16]) - 0.01 * s2
    with pytest.raises(ValueError, match="beta = .* < 0, a cost that falls as documents"):
        CostModel.fit(docs, ms)


@pytest.mark.integration
def test_cost_fit_benchmark_quick_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cost_fit", "--quick", "--device", "cpu"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# Cost model against measured step time" in proc.stdout
    res = json.loads((tmp_path / "cost_fit.json").read_text())
    assert (tmp_path / "cost_fit.md").stat().st_size > 0

    cfg = res["config"]
    assert cfg["attn"] == "sdpa-loop" and cfg["device"] == "cpu" and cfg["quick"]
    assert cfg["params"] > 0 and cfg["alpha"] == 6.0 * cfg["params"]
    assert cfg["beta"] == 6.0 * cfg["layers"] * cfg["hidden"]
    assert cfg["row_failures"] == 0

    rows = res["rows"]
    fit_rows = [r for r in rows if r["group"] == "fit"]
    assert {r["context"] for r in fit_rows} == set(cfg["contexts"])
    for r in rows:
        assert r["S1"] == sum(r["lengths"])
        assert r["S2"] == sum(n * n for n in r["lengths"])
        assert all(n > 0 for n in r["lengths"])
    for r in fit_rows:  # every fit row is full: S1 = T
        assert r["S1"] == r["context"]
    measured = [r for r in rows if r["ms"] is not None and r["lengths"]]
    assert len(measured) >= 2 * len(cfg["contexts"])
    for r in measured:
        assert finite(r["ms"]) and r["ms"] > 0 and finite(r["pred_a"]) and finite(r["pred_b"])
    # the extremes: one document of the whole row, and many tiny ones
    kinds = {(r["context"], r["kind"]) for r in fit_rows}
    for c in cfg["contexts"]:
        assert (c, f"equal-{c}") in kinds and (c, "equal-32") in kinds

    fa, fb = res["fits"]["a"], res["fits"]["b"]
    for key in ("k_ms_per_flop", "tflops", "r2", "mape", "max_ape"):
        assert finite(fa[key]), key
    # fit (b) is CostModel.fit, which refuses a negative coefficient (noisy CPU times):
    # then it says why instead of giving numbers
    if "error" in fb:
        assert "< 0" in fb["error"]
    else:
        for key in ("a_ms_per_token", "b_ms_per_token2", "c_ms", "r2", "mape", "b_over_a"):
            assert finite(fb[key]), key
    assert fb["model_beta_over_alpha"] == pytest.approx(cfg["beta"] / cfg["alpha"])
    assert set(fa["per_context"]) == {str(c) for c in cfg["contexts"]}

    # the balance check: both methods, each rank's time the sum of its rows
    assert res["balance"], "the balance step was not measured"
    for b in res["balance"]:
        for m in ("none", "kk"):
            assert len(b[m]["rank_ms"]) == b["dp"]
            assert b[m]["max_ms"] == pytest.approx(max(b[m]["rank_ms"]))
        assert finite(b["measured_speedup"]) and finite(b["predicted_speedup"])
        assert b["predicted_speedup"] >= 1.0 - 1e-9  # kk never worse than none, by the model
    tot = res["balance_total"]
    assert finite(tot["measured_speedup"]) and finite(tot["predicted_speedup"])
