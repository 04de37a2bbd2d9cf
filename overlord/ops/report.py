"""The demo's report: figures of a run as text, as Markdown, and as two PNG plots.

Everything is computed from the run summary (:func:`overlord.ops.run.summarize`)
and the planner's per-step history, so the report shows what the trainer got.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from overlord.errors import LoaderError
from overlord.plan.spec import Plan

PHASES = 3  # the curriculum is reported as its first, middle and last third, then overall


@dataclass
class Report:
    """What the demo measured, and where it writes the report."""

    out: Path
    plan: Plan
    manifest: dict[str, Any]  # per source: format, shards, records, bytes
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    corpus_seconds: float | None  # None: an earlier demo's corpus was reused
    peak_rss_mib: float

    @property
    def names(self) -> list[str]:
        """Source names, in plan order."""
        return self.plan.source_names

    def tokens(self) -> np.ndarray:
        """Tokens per step and source, shape (steps, sources)."""
        return np.array([h["tokens"] for h in self.history], dtype=np.float64)

    def weights(self) -> np.ndarray:
        """Target share per step and source, shape (steps, sources)."""
        w = np.array([h["weights"] for h in self.history], dtype=np.float64)
        return w / w.sum(axis=1, keepdims=True)

    def balance(self) -> tuple[np.ndarray, np.ndarray]:
        """Most loaded rank's cost over the lower bound per step: balanced, and the baseline."""
        lb = np.array([h["lower_bound"] or 1.0 for h in self.history])
        kk = np.array([h["max_cost"] for h in self.history]) / lb
        base = np.array([h["baseline_max_cost"] for h in self.history]) / lb
        return kk, base


def _table(header: list[str], rows: list[list[str]], md: bool) -> list[str]:
    if md:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        # the blank line ends the table: a text line right after it would become a row
        return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    # names left-aligned, figures right-aligned
    return [
        "  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]


def mixture_rows(r: Report) -> list[list[str]]:
    """Realized (target) share of tokens per source, per third of the run and overall."""
    tok, want = r.tokens(), r.weights()
    steps = [h["step"] for h in r.history]
    spans = [(a[0], a[-1]) for a in np.array_split(np.arange(len(steps)), PHASES) if len(a)]
    rows = []
    for label, (a, b) in [*(("", s) for s in spans), ("all ", (0, len(steps) - 1))]:
        t, w = tok[a : b + 1], want[a : b + 1]
        per_step = t.sum(axis=1, keepdims=True)
        real = t.sum(axis=0) / max(t.sum(), 1.0)
        target = (w * per_step).sum(axis=0) / max(per_step.sum(), 1.0)
        cells = [f"{100 * x:.1f}% ({100 * y:.1f}%)" for x, y in zip(real, target)]
        rows.append([f"{label}{steps[a]}-{steps[b]}", *cells])
    return rows


def cumulative_gap(r: Report) -> float:
    """Largest gap, in tokens, between a source's cumulative realized and target tokens."""
    tok = r.tokens()
    want = r.weights() * tok.sum(axis=1, keepdims=True)
    if not len(tok):
        return 0.0
    return float(np.abs(tok.cumsum(axis=0) - want.cumsum(axis=0)).max())


def corpus_rows(r: Report) -> list[list[str]]:
    """One row per source: format, shards, records, size, and how often the run read it."""
    delivered = r.tokens().sum(axis=0)
    rows = []
    for name, got in zip(r.names, delivered):
        m = r.manifest[name]
        passes = got / max(m["bytes"] + m["records"], 1)  # bytes tokenizer: a token per byte
        rows.append(
            [
                name,
                m["format"],
                str(m["shards"]),
                f"{m['records']:,}",
                f"{m['bytes'] / 1e6:.1f}",
                f"{passes:.1f}",
            ]
        )
    return rows


def balance_rows(r: Report) -> list[list[str]]:
    """Mean, p95 and worst of max/LB over the steps, for the plan's method and the baseline."""
    method = r.summary["balance_method"]
    return [
        [label, f"{x.mean():.4f}", f"{np.percentile(x, 95):.4f}", f"{x.max():.4f}"]
        for label, x in zip([f"overlord ({method})", "per-rank loader (none)"], r.balance())
    ]


def render(r: Report, md: bool) -> str:
    """The whole report, as plain text (``md=False``) or Markdown."""
    s, p = r.summary, r.plan
    h2 = (lambda t: f"\n## {t}\n") if md else (lambda t: f"{t}:")
    n_steps = s["steps"][1] - s["steps"][0]
    lines = [
        "# overlord demo\n" if md else "overlord demo report",
        f"{n_steps} steps x {p.world.dp} DP ranks, {p.batch.tokens_per_step:,} tokens per step "
        f"({p.rows_per_step} rows of {p.batch.max_seq_len}, {p.rows_per_rank} per rank), "
        f"{p.tokenizer.kind.value} tokenizer, balance {s['balance_method']}.",
    ]
    lines += [h2("Corpus")]
    lines += _table(["source", "format", "shards", "records", "MB", "passes"], corpus_rows(r), md)
    lines += [
        h2("Throughput"),
        f"{s['tokens']:,} tokens delivered in {s['seconds']:.1f} s: "
        f"{s['tokens_per_s'] / 1e6:.2f} M tokens/s to the trainer ({p.world.dp} ranks together); "
        f"rows {100 * s['fill_mean']:.1f}% full. " + _corpus_time(r),
        h2("Mixture: realized share of tokens (target) along the curriculum"),
    ]
    lines += _table(["steps", *r.names], mixture_rows(r), md)
    gap = cumulative_gap(r)
    lines += [
        f"Largest gap between a source's cumulative realized and target tokens: {gap:,.0f} tokens "
        f"({gap / p.batch.max_seq_len:.2f} rows).",
        h2("Balance: most loaded rank's cost / lower bound (1 is perfect)"),
    ]
    lines += _table(["assignment", "mean", "p95", "max"], balance_rows(r), md)
    slower = s["baseline_balance_mean"] / s["balance_mean"] - 1
    lines += [
        f"A step lasts as long as its most loaded rank: without balancing it would take "
        f"{100 * slower:.1f}% longer on average (cost model: {_cost_text(p)}).",
        h2("Resources"),
        f"Peak memory {r.peak_rss_mib:,.0f} MiB (RSS of this process"
        + (", building the corpus included" if r.corpus_seconds is not None else "")
        + f"); checkpoint "
        f"{s['checkpoint_bytes']:,} bytes of JSON.",
    ]
    if s["skipped_records"] or s["dropped_docs"]:
        lines.append(
            f"Skipped {s['skipped_records']} bad record(s) (on_error: skip); "
            f"dropped {s['dropped_docs']} document(s) (too long)."
        )
    if md:
        lines += [h2("Plots"), "![mixture](mixture.png)", "", "![balance](balance.png)"]
    else:
        lines += [
            f"Written to {r.out}/: report.md, mixture.png, balance.png, plan.yaml, "
            "checkpoints/, data/."
        ]
    text = "\n".join(lines) + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)  # one blank line between blocks


def _corpus_time(r: Report) -> str:
    if r.corpus_seconds is None:
        return f"Corpus reused from {r.out / 'data'}."
    return f"Corpus built in {r.corpus_seconds:.1f} s."


def _cost_text(p: Plan) -> str:
    m = p.balance.cost.model
    if m is not None:
        return f"{m.params:.3g} parameters, {m.layers} layers, hidden {m.hidden}"
    return f"alpha {p.balance.cost.alpha}, beta {p.balance.cost.beta}"


def plot_mixture(r: Report, path: Path) -> None:
    """Realized token share per source and step (smoothed), with the target dashed."""
    plt = pyplot()

    tok, want = r.tokens(), r.weights()
    steps = np.array([h["step"] for h in r.history])
    share = tok / np.maximum(tok.sum(axis=1, keepdims=True), 1.0)
    k = max(1, min(10, len(steps) // 10))  # a step holds few documents: average over k steps
    kernel = np.ones(k) / k
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, name in enumerate(r.names):
        color = f"C{i}"
        if k > 1:
            ax.plot(steps, 100 * share[:, i], color=color, alpha=0.25, linewidth=0.8)
            smooth = np.convolve(share[:, i], kernel, mode="valid")
            ax.plot(steps[k - 1 :], 100 * smooth, color=color, linewidth=2, label=name)
        else:
            ax.plot(steps, 100 * share[:, i], color=color, linewidth=1.5, label=name)
        ax.plot(steps, 100 * want[:, i], color=color, linestyle="--", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("share of the step's tokens (%)")
    ax.set_title(
        f"Mixture: realized (faint: per step, solid: mean of {k}) vs target (dashed)"
        if k > 1
        else "Mixture: realized (solid) vs target (dashed)",
        fontsize=10,
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    save(fig, path)


def pyplot() -> Any:
    """Matplotlib's pyplot, drawing to files only (no display needed, none assumed)."""
    try:
        import matplotlib
    except ImportError:
        raise LoaderError(
            "the report's plots need matplotlib: pip install 'overlord-data[demo]'"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Lay a figure out, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)


def plot_balance(r: Report, path: Path) -> None:
    """Most loaded rank over the lower bound, per step, balanced and not."""
    plt = pyplot()

    kk, base = r.balance()
    steps = [h["step"] for h in r.history]
    method = r.summary["balance_method"]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    ax.plot(steps, base, color="C3", linewidth=1, label=f"per-rank loader: mean {base.mean():.3f}")
    ax.plot(steps, kk, color="C0", linewidth=1.5, label=f"overlord {method}: mean {kk.mean():.3f}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    top = max(float(base.max()), float(kk.max()), 1.0)
    ax.set_ylim(top=1.0 + 1.3 * (top - 1.0) + 1e-3)  # headroom for the legend
    ax.set_xlabel("step")
    ax.set_ylabel("most loaded rank / lower bound")
    ax.set_title(f"Balance over {r.plan.world.dp} DP ranks (1 = perfect)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    save(fig, path)


def write_report(r: Report) -> str:
    """Write ``report.md``, ``mixture.png`` and ``balance.png`` to ``r.out``; returns the text."""
    plot_mixture(r, r.out / "mixture.png")
    plot_balance(r, r.out / "balance.png")
    (r.out / "report.md").write_text(render(r, md=True))
    return render(r, md=False).rstrip("\n")
