"""The outputs: JSON-safe results, Markdown tables and the plot."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def clean(o: Any) -> Any:
    """JSON-safe: non-finite floats become null, numpy scalars Python numbers."""
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def ctx_label(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def summary_md(res: dict[str, Any]) -> str:
    cfg, fa, fb = res["config"], res["fits"].get("a"), res["fits"].get("b")
    lines = [
        "# Cost model against measured step time\n",
        f"{cfg['device_name']}, torch {cfg['torch']}, {cfg['dtype']}, attention `{cfg['attn']}` "
        f"({cfg['attn_check']}); {cfg['layers']} block(s) of hidden {cfg['hidden']}, "
        f"{cfg['heads']} heads, MLP {cfg['inter']}; P = {cfg['params']:,} parameters; "
        f"alpha = 6P = {cfg['alpha']:.4g}, beta = 6*layers*hidden = {cfg['beta']:.4g}; "
        f"median of {cfg['reps']} reps; {cfg['rows_measured']} rows measured in "
        f"{cfg['elapsed_s']:.0f} s"
        + (" (stopped by --budget-s)" if cfg["stopped_early"] else "")
        + ".\n",
    ]
    if cfg["attn_fallbacks"]:
        lines.append("Attention fallbacks: " + "; ".join(cfg["attn_fallbacks"]) + "\n")
    if fa and fb:
        lines += [
            "## Fits over all contexts\n",
            "| model | R^2 | mean abs % err | max abs % err | parameters |",
            "|---|---:|---:|---:|---|",
            f"| (a) k * (alpha S1 + beta S2) | {fa['r2']:.4f} | {100 * fa['mape']:.1f}% "
            f"| {100 * fa['max_ape']:.1f}% | 1/k = {fa['tflops']:.3g} model TFLOP/s |",
            f"| (b) a S1 + b S2 + c | {fb['r2']:.4f} | {100 * fb['mape']:.1f}% "
            f"| {100 * fb['max_ape']:.1f}% | b/a = {fb['b_over_a']:.3g} vs beta/alpha = "
            f"{fb['model_beta_over_alpha']:.3g} (x{fb['ratio_to_model']:.2f}); "
            f"c = {fb['c_ms']:.2f} ms"
            + ("" if fb["identifiable"] else " (one token count: c not fitted, a absorbs it)")
            + (f"; the fit failed: {fb['error']}" if "error" in fb else "")
            + " |",
            "",
            "## Per context, model (a) with the global k\n",
            "| context | rows | t min-max ms | S2/T^2 min-max | R^2 (a) | mean abs % err "
            "| max abs % err | attention weight measured/model |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [r for r in res["rows"] if r["group"] == "fit" and r["ms"] is not None]
        for c, e in fa["per_context"].items():
            mine = [r for r in rows if r["context"] == int(c)]
            ts = [r["ms"] for r in mine]
            sq = [r["S2"] / int(c) ** 2 for r in mine]
            w = f"{e['attn_weight']:.2f}" if e.get("attn_weight") is not None else "-"
            r2c = f"{e['r2']:.3f}" if e.get("r2") is not None else "-"
            lines.append(
                f"| {ctx_label(int(c))} | {e['n']} | {min(ts):.1f}-{max(ts):.1f} "
                f"| {min(sq):.4f}-{max(sq):.3f} | {r2c} | {100 * e['mape']:.1f}% "
                f"| {100 * e['max_ape']:.1f}% | {w} |"
            )
    else:
        lines.append("Too few rows measured to fit.\n")
    if res["balance"]:
        lines += [
            "\n## End to end: max-rank time, kk against none (measured rows)\n",
            "| context | step | DP x rows | items | none max ms | kk max ms | measured speed-up "
            "| model predicted | fit (b) predicted | none/kk mean ms | unfilled tokens none/kk |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for b in res["balance"]:
            fbs = f"{b['fit_b_speedup']:.3f}x" if "fit_b_speedup" in b else "-"
            lines.append(
                f"| {ctx_label(b['context'])} | {b['step']} | {b['dp']} x {b['rows_per_rank']} "
                f"| {b['items']} | {b['none']['max_ms']:.1f} | {b['kk']['max_ms']:.1f} "
                f"| {b['measured_speedup']:.3f}x | {b['predicted_speedup']:.3f}x | {fbs} "
                f"| {b['none']['mean_ms']:.1f}/{b['kk']['mean_ms']:.1f} "
                f"| {b['none']['unfilled_tokens']}/{b['kk']['unfilled_tokens']} |"
            )
        tot = res["balance_total"]
        how = "padded to T" if cfg["balance_rows_padded"] else "run at their own length"
        lines.append(
            f"\nAll {tot['steps']} step(s): measured {tot['measured_speedup']:.3f}x, "
            f"model {tot['predicted_speedup']:.3f}x (sums of makespans, none / kk). "
            f"Rows not full were {how}."
        )
        if "rank_a" in tot:
            ra = tot["rank_a"]
            r = tot.get("rank_pearson_r")
            lines.append(
                f"Per rank ({2 * sum(b['dp'] for b in res['balance'])}: both methods, all steps), "
                f"measured time "
                f"against overlord's model x k of fit (a): mean abs error {100 * ra['mape']:.1f}%, "
                f"max {100 * ra['max_ape']:.1f}%"
                + (f", Pearson r {r:.3f}" if r is not None else "")
                + ".\n"
            )
    else:
        lines.append("\nBalance check: not measured (budget or failures).\n")
    return "\n".join(lines)


def rows_md(res: dict[str, Any]) -> str:
    lines = [
        "## Every row\n",
        "| group | context | kind | docs | S2/T^2 | ms | (a) ms | (b) ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        f = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("ms", "pred_a", "pred_b")]
        lines.append(
            f"| {r['group']} | {ctx_label(r['context'])} | {r['kind']} | {r['n_docs']} "
            f"| {r['S2'] / r['context'] ** 2:.4f} | {f[0]} | {f[1]} | {f[2]} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("note: no matplotlib, no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rows = [r for r in res["rows"] if r.get("pred_a") is not None]
    if not rows:
        return
    fa, fb = res["fits"]["a"], res["fits"]["b"]
    ctxs = sorted({r["context"] for r in rows})
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(ctxs)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, key, title in (
        (
            axes[0],
            "pred_a",
            f"(a) overlord's model x k: R^2 {fa['r2']:.3f}, mean err {100 * fa['mape']:.1f}%",
        ),
        (
            axes[1],
            "pred_b",
            f"(b) a S1 + b S2 + c: R^2 {fb['r2']:.3f}, "
            f"b/a = {fb['ratio_to_model']:.2f} x beta/alpha",
        ),
    ):
        for c, col in zip(ctxs, colors):
            for group, marker in (("fit", "o"), ("balance", "x")):
                mine = [r for r in rows if r["context"] == c and r["group"] == group]
                if mine:
                    ax.scatter(
                        [r[key] for r in mine],
                        [r["ms"] for r in mine],
                        color=col,
                        marker=marker,
                        s=18,
                        label=ctx_label(c) + (" (balance rows)" if group == "balance" else ""),
                    )
        lo = min(min(r["ms"], r[key]) for r in rows) * 0.9
        hi = max(max(r["ms"], r[key]) for r in rows) * 1.1
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("predicted ms")
        ax.set_ylabel("measured ms (forward + backward)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8, title="context")
    cfg = res["config"]
    fig.suptitle(
        f"forward + backward of {cfg['layers']} block(s) of hidden {cfg['hidden']}, "
        f"{cfg['attn']} attention, {cfg['dtype']}, {cfg['device_name']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
