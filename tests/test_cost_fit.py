"""benchmarks/cost_fit.py in its quick CPU mode: the plumbing, not the fit (that needs a GPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.integration
def test_cost_fit_quick_cpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/cost_fit.py", "--quick", "--device", "cpu"]
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
