"""The fits of measured times: (a) overlord's model scaled, (b) ``CostModel.fit``; balance."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.cost_fit.rows import (
    BalanceStep,
    Row,
)
from overlord.plan.cost import fit_cost


def r2(t: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((t - t.mean()) ** 2).sum())
    return 1.0 - float(((t - pred) ** 2).sum()) / ss if ss > 0 else float("nan")


def errors(t: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    ape = np.abs(pred - t) / t
    return {"r2": r2(t, pred), "mape": float(ape.mean()), "max_ape": float(ape.max())}


def fit_scale(x: np.ndarray, t: np.ndarray) -> float:
    """k minimizing sum ((k x - t) / t)**2."""
    return float((x / t).sum() / ((x / t) ** 2).sum())


def fits(rows: list[Row], alpha: float, beta: float) -> dict[str, Any]:
    """Fits (a) and (b) over the measured fit rows; sets every measured row's predictions."""
    ok = [r for r in rows if r.group == "fit" and math.isfinite(r.ms)]
    if len(ok) < 2:
        return {}
    s1 = np.array([r.s1 for r in ok], dtype=np.float64)
    s2 = np.array([r.s2 for r in ok], dtype=np.float64)
    t = np.array([r.ms for r in ok])
    ctxs = np.array([r.context for r in ok])
    x = alpha * s1 + beta * s2
    k = fit_scale(x, t)
    fa: dict[str, Any] = {"k_ms_per_flop": k, "tflops": 1e-9 / k, **errors(t, k * x), "n": len(ok)}
    per: dict[str, Any] = {}
    for c in sorted(set(ctxs.tolist())):
        m = ctxs == c
        entry: dict[str, Any] = {"n": int(m.sum()), **errors(t[m], k * x[m])}
        if len(set(s2[m].tolist())) >= 2:  # t = u + v * S2 within the context
            v, u = np.polyfit(s2[m], t[m], 1, w=1 / t[m])  # least relative error
            entry["attn_weight"] = float((v * c / u) / (beta / alpha))
            entry["line_r2"] = r2(t[m], u + v * s2[m])
        per[str(c)] = entry
    fa["per_context"] = per
    # (b) is overlord's CostModel.fit; with one token count (S1) the overhead c cannot be
    # told from a, so it is left out (a absorbs it)
    identifiable = len(set(s1.tolist())) >= 2
    try:
        got = fit_cost([r.lengths for r in ok], t, intercept=identifiable)
        a, b, c0 = got.model.alpha, got.model.beta, got.intercept
        fb: dict[str, Any] = {"a_ms_per_token": a, "b_ms_per_token2": b, "c_ms": c0}
    except ValueError as e:  # e.g. a negative beta from noisy CPU times: reported, not fitted
        print(f"note: fit (b) failed: {e}")
        a = b = c0 = float("nan")
        fb = {"error": str(e), "a_ms_per_token": a, "b_ms_per_token2": b, "c_ms": c0}
    fb |= {
        **errors(t, a * s1 + b * s2 + c0),
        "b_over_a": float(b / a) if a else float("nan"),
        "model_beta_over_alpha": beta / alpha,
        "identifiable": identifiable,
    }
    fb["ratio_to_model"] = fb["b_over_a"] / (beta / alpha)
    for r in rows:
        if math.isfinite(r.ms):
            r.pred_a = k * (alpha * r.s1 + beta * r.s2)
            r.pred_b = float(a * r.s1 + b * r.s2 + c0)
    return {"a": fa, "b": fb}


def balance_results(
    steps: list[BalanceStep], alpha: float, beta: float, fitted: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per step: each rank's measured time (the sum of its rows) against the predictions.

    overlord's model sees real documents only; fit (b) is applied to the rows as run
    (padding included). Returns the steps and totals over all of them.
    """
    fa, fb = fitted.get("a"), fitted.get("b")
    out: list[dict[str, Any]] = []
    ms_all, model_all = [], []
    for st in steps:
        if not all(math.isfinite(r.ms) for m in st.rows for r in st.rows[m]):
            continue  # not every row measured: no makespan
        entry: dict[str, Any] = {
            "context": st.context,
            "step": st.step,
            "dp": st.dp,
            "rows_per_rank": st.rpr,
            "items": len(st.items),
        }
        starts = np.arange(0, st.dp * st.rpr, st.rpr)
        for m, rows in st.rows.items():
            rank_ms = np.add.reduceat(np.array([r.ms for r in rows]), starts)
            model = np.array(
                [alpha * sum(r.real) + beta * sum(n * n for n in r.real) for r in rows]
            )
            rank_model = np.add.reduceat(model, starts)
            entry[m] = {
                "rank_ms": rank_ms.tolist(),
                "rank_model": rank_model.tolist(),
                "max_ms": float(rank_ms.max()),
                "mean_ms": float(rank_ms.mean()),
                "predicted_max": st.predicted[m],
                "unfilled_tokens": int(st.context * len(rows) - sum(st.real_tokens[m])),
            }
            ms_all += rank_ms.tolist()
            model_all += rank_model.tolist()
            if fb:  # an empty row is not run
                a, b, c = fb["a_ms_per_token"], fb["b_ms_per_token2"], fb["c_ms"]
                run = np.array([a * r.s1 + b * r.s2 + c if r.lengths else 0.0 for r in rows])
                entry[m]["fit_b_max_ms"] = float(np.add.reduceat(run, starts).max())
        entry["measured_speedup"] = entry["none"]["max_ms"] / entry["kk"]["max_ms"]
        entry["predicted_speedup"] = st.predicted["none"] / st.predicted["kk"]
        if fb:
            entry["fit_b_speedup"] = entry["none"]["fit_b_max_ms"] / entry["kk"]["fit_b_max_ms"]
        out.append(entry)
    total: dict[str, Any] = {}
    if out:
        total = {
            "steps": len(out),
            "measured_speedup": sum(b["none"]["max_ms"] for b in out)
            / sum(b["kk"]["max_ms"] for b in out),
            "predicted_speedup": sum(b["none"]["predicted_max"] for b in out)
            / sum(b["kk"]["predicted_max"] for b in out),
        }
        t, x = np.array(ms_all), np.array(model_all)
        if len(t) >= 3 and t.std() > 0 and x.std() > 0:
            total["rank_pearson_r"] = float(np.corrcoef(x, t)[0, 1])
        if fa:  # each rank's time by fit (a)'s k, fitted on the fit rows alone
            total["rank_a"] = errors(t, fa["k_ms_per_flop"] * x)
    return out, total
