"""``overlord run --report DIR``: a Markdown report of a run, with PNG plots.

Four plots: each source's share of the tokens against its target over the
steps (the demo's :func:`overlord.ops.report.plot_mixture`), balance
(:func:`overlord.ops.report.plot_balance`), each rank's predicted cost and
measured wait per step, and each source's loaders (and reader threads) over
the steps; and a fifth where the trainers reported their step times
(``client.report``, or ``run_plan(train=...)``): the most loaded rank's
predicted seconds against its measured ones, per step. The run loop fills a
:class:`RunTrace` as it goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from overlord.errors import OutputError
from overlord.ops.report import (
    Report,
    balance_rows,
    mixture_rows,
    plot_balance,
    plot_mixture,
    pyplot,
    save,
)
from overlord.plan.spec import Plan


@dataclass
class RunTrace:
    """What a run measured per step: each rank's cost and wait, and samples of the loaders."""

    steps: list[int] = field(default_factory=list)
    cost: list[list[float]] = field(default_factory=list)  # per step, per rank
    wait_s: list[list[float]] = field(default_factory=list)  # per step, per rank
    loaders: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (step, monitor)
    # per step, the planner's feedback: {rank: {"seconds", "predicted", "predicted_seconds"}}
    reported: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)

    def step(self, step: int, cost: list[float], wait_s: list[float]) -> None:
        """Record one step's per-rank cost and wait."""
        self.steps.append(step)
        self.cost.append(cost)
        self.wait_s.append(wait_s)


def plot_ranks(plan: Plan, trace: RunTrace, path: Path) -> None:
    """Predicted cost (top) and measured wait in ``next()`` (bottom) of each rank, per step."""
    plt = pyplot()
    steps = np.array(trace.steps)
    cost = np.array(trace.cost, dtype=np.float64).reshape(len(steps), -1)
    wait = np.array(trace.wait_s, dtype=np.float64).reshape(len(steps), -1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=110, sharex=True)
    for r in range(cost.shape[1]):
        top.plot(steps, cost[:, r], linewidth=1, label=f"rank {r}")
        bottom.plot(steps, 1e3 * wait[:, r], linewidth=1, label=f"rank {r}")
    top.set_ylabel("predicted cost")
    top.set_title(f"Per rank ({plan.world.dp} DP ranks): predicted cost and wait", fontsize=10)
    bottom.set_ylabel("wait in next() (ms)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    if cost.shape[1] <= 16:
        top.legend(loc="upper right", fontsize=8, ncol=4)
    save(fig, path)


def measured_rows(trace: RunTrace) -> list[tuple[int, float, float]]:
    """Per reported step: (step, the most loaded rank's predicted seconds, its measured ones).

    The most loaded rank is the one of the highest predicted cost; a step counts
    once every rank reported it and the planner knew its scale (seconds per cost).
    """
    rows = []
    for step in sorted(trace.reported):
        ranks = trace.reported[step]
        if not ranks or any(v.get("seconds") is None for v in ranks.values()):
            continue
        top = max(ranks.values(), key=lambda v: float(v["predicted"]))
        if top.get("predicted_seconds") is not None:
            rows.append((step, float(top["predicted_seconds"]), float(top["seconds"])))
    return rows


def plot_measured(trace: RunTrace, path: Path) -> None:
    """The most loaded rank's predicted and measured seconds (top), their error (bottom)."""
    plt = pyplot()
    rows = np.array(measured_rows(trace), dtype=np.float64).reshape(-1, 3)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=110, sharex=True)
    top.plot(rows[:, 0], rows[:, 1], linewidth=1, label="predicted")
    top.plot(rows[:, 0], rows[:, 2], linewidth=1, label="measured")
    top.set_ylabel("seconds")
    top.set_title("Most loaded rank: predicted against measured step time", fontsize=10)
    top.legend(loc="upper right", fontsize=8)
    bottom.plot(rows[:, 0], 100 * (rows[:, 1] - rows[:, 2]) / rows[:, 2], linewidth=1)
    bottom.set_ylabel("prediction error (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    save(fig, path)


def plot_loaders(plan: Plan, trace: RunTrace, path: Path) -> None:
    """Loaders (solid) and reader threads (dotted) of each source over the steps."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    steps = [s for s, _ in trace.loaders]
    for i, name in enumerate(plan.source_names):
        n = [m["sources"][name]["loaders"] for _, m in trace.loaders]
        t = [m["sources"][name]["threads"] for _, m in trace.loaders]
        ax.step(steps, n, where="post", color=f"C{i}", linewidth=1.5, label=f"{name}: loaders")
        ax.step(steps, t, where="post", color=f"C{i}", linewidth=1, linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("loaders (solid), threads (dotted)")
    ax.set_title("SourceLoaders per source over the run", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    save(fig, path)


def render(plan: Plan, summary: dict[str, Any], r: Report, trace: RunTrace) -> str:
    """The report's Markdown."""
    a, b = summary["steps"]
    wait = np.array(trace.wait_s, dtype=np.float64).reshape(len(trace.steps), -1)
    cost = np.array(trace.cost, dtype=np.float64).reshape(len(trace.steps), -1)
    lines = [
        "# overlord run\n",
        f"Steps {a}..{b - 1} x {plan.world.dp} DP ranks: {summary['tokens']:,} tokens in "
        f"{summary['seconds']:.2f} s ({summary['tokens_per_s']:,.0f} tokens/s), rows "
        f"{100 * summary['fill_mean']:.1f}% full.",
        "\n## Mixture: realized share of tokens (target)\n",
        "| steps | " + " | ".join(r.names) + " |",
        "|---|" + "---|" * len(r.names),
        *("| " + " | ".join(row) + " |" for row in mixture_rows(r)),
        "",
        "![mixture](mixture.png)",
        "\n## Balance: most loaded rank's cost / lower bound\n",
        "| assignment | mean | p95 | max |",
        "|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in balance_rows(r)),
        "",
        "![balance](balance.png)",
        "\n## Per rank: predicted cost and wait in next()\n",
        "| rank | mean cost | mean wait (ms) | p95 wait (ms) | max wait (ms) |",
        "|---|---|---|---|---|",
    ]
    for k in range(wait.shape[1]):
        w = 1e3 * wait[:, k]
        lines.append(
            f"| {k} | {cost[:, k].mean():.4g} | {w.mean():.3f} | {np.percentile(w, 95):.3f} "
            f"| {w.max():.3f} |"
        )
    lines += ["", "![ranks](ranks.png)", "\n## Loaders per source\n", "![loaders](loaders.png)"]
    rows = measured_rows(trace)
    if rows:
        err = np.array([abs(p - m) / m for _, p, m in rows])
        lines += [
            "\n## Predicted against measured step time\n",
            f"{len(rows)} steps reported by every rank. The most loaded rank's predicted "
            f"seconds were off its measured ones by {100 * err.mean():.1f}% on average, "
            f"{100 * err[-1]:.1f}% on the last step.",
            "",
            "![measured](measured.png)",
        ]
    if summary["faults"]:
        lines += ["\n## Faults\n", *(f"- {e}" for e in summary["faults"])]
    return "\n".join(lines) + "\n"


def write_run_report(
    out: str | Path,
    plan: Plan,
    summary: dict[str, Any],
    history: list[dict[str, Any]],
    trace: RunTrace,
) -> Path:
    """Write ``report.md`` and its four PNG plots to ``out``; the report's path.

    A file that cannot be written (a full disk) raises :class:`OutputError` naming it,
    and its torn part is removed.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    a, b = summary["steps"]
    hist = [h for h in history if a <= h["step"] < b]
    r = Report(out, plan, {}, summary, hist, None, 0.0)
    if hist:
        _written(out / "mixture.png", lambda p: plot_mixture(r, p))
        _written(out / "balance.png", lambda p: plot_balance(r, p))
    if trace.steps:
        _written(out / "ranks.png", lambda p: plot_ranks(plan, trace, p))
    if trace.loaders:
        _written(out / "loaders.png", lambda p: plot_loaders(plan, trace, p))
    if measured_rows(trace):
        _written(out / "measured.png", lambda p: plot_measured(trace, p))
    path = out / "report.md"
    _written(path, lambda p: p.write_text(render(plan, summary, r, trace)))
    return path


def _written(path: Path, write: Callable[[Path], object]) -> None:
    try:
        write(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            path.unlink()  # a torn plot or page is not left for a reader to take for whole
        raise OutputError(f"cannot write the report's {path}: {e.strerror or e}") from None
