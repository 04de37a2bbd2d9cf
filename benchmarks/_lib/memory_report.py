"""The report of ``benchmarks/memory.py``: figures at the target, measured or carried there.

``at_target`` takes the measured runs to R x W x S (``linear`` in S, and R times one
trainer's loader memory for the baseline); ``crossover`` finds the state where overlord
starts to win; the rest print tables and draw the plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._lib.colocated import MiB, State, linear
from benchmarks._lib.procfs import CATEGORIES

TARGET = (8, 4, 32)  # (R, W, S): >= 13.5x less loader memory at 64 MB
INDEX_TARGET = (8, 2, 16)  # no worse than the baseline at index-only state


def mib(x: float) -> str:
    return f"{x / MiB:,.0f}"


def crossover(points: list[tuple[float, float]]) -> float | None:
    """Where the ratio first reaches 1, along ``(state bytes, ratio)`` sorted by bytes.

    Linear between the two states around it; the first state's bytes when it is already
    there; None when no state reaches it.
    """
    pts = sorted(points)
    for i, (x, y) in enumerate(pts):
        if y >= 1.0:
            if i == 0:
                return x
            x0, y0 = pts[i - 1]
            return x0 + (1.0 - y0) * (x - x0) / (y - y0)
    return None


def _loader(m: dict[str, Any], bare: dict[int, dict[str, Any]]) -> float:
    return float(m["total"] - bare[m["R"]]["total"])


def at_target(
    runs: list[dict[str, Any]],
    bare: dict[int, dict[str, Any]],
    state: str,
    shadows: int,
    target: tuple[int, int, int],
) -> dict[str, Any] | None:
    """Both designs' loader and total memory at ``target``, measured or carried there."""
    r, w, s = target
    b = [
        (x["S"], _loader(x, bare))
        for x in runs
        if x["kind"] == "baseline" and x["state"] == state and x["R"] == 1 and x["W"] == w
    ]
    o = [
        (x["S"], _loader(x, bare))
        for x in runs
        if x["kind"] == "overlord"
        and x["state"] == state
        and x["R"] == r
        and x["shadows"] == shadows
    ]
    if not b or not o:
        return None
    b = [p for p in b if p[0] == s] or b  # measured at the target's S: that, not a line
    o = [p for p in o if p[0] == s] or o

    def how(pts: list[tuple[int, float]], rr: int) -> str:
        at = "S=" + " and ".join(str(p[0]) for p in sorted(pts))
        line = "" if [p[0] for p in pts] == [s] else f", line to S={s}"
        return f"R={rr} {at}{line}" + (f", x{r}" if rr != r else "")

    bl, ol = r * linear([(float(a), c) for a, c in b], s), linear([(float(a), c) for a, c in o], s)
    t = bare[r]["total"]
    return {
        "state": state,
        "shadows": shadows,
        "baseline_loader": bl,
        "overlord_loader": ol,
        "baseline_total": bl + t,
        "overlord_total": ol + t,
        "ratio": bl / ol,
        "total_ratio": (bl + t) / (ol + t),
        "baseline_how": how(b, 1),
        "overlord_how": how(o, r),
    }


def measured_table(runs: list[dict[str, Any]], bare: dict[int, dict[str, Any]]) -> str:
    lines = [
        "| design | state | shadows | R | W | S | total MiB | loader MiB | "
        + " | ".join(CATEGORIES)
        + " | overlord held tokens MiB | s |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|",
    ]
    for x in runs:
        held = sum(h["held_tokens"] for h in x.get("loaders", [])) * 4
        cells = [f"{mib(x['parts'][c])} [{x['count'][c]}]" for c in CATEGORIES]
        loader = mib(_loader(x, bare)) if x["kind"] != "bare" else "-"
        lines.append(
            f"| {x['kind']} | {x['state'] or '-'} | "
            f"{x['shadows'] if x['kind'] == 'overlord' else '-'} | {x['R']} | {x['W']} | "
            f"{x['S']} | {mib(x['total'])} | {loader}"
            f" | {' | '.join(cells)} | {held / MiB:,.1f} | {x['seconds']:.0f} |"
        )
    return "\n".join(lines)


def target_table(rows: list[dict[str, Any]], target: tuple[int, int, int]) -> str:
    r, w, s = target
    lines = [
        f"At R x W x S = {r} x {w} x {s}:",
        "",
        "| state | shadows | baseline total MiB | overlord total MiB | total ratio "
        "| baseline loader MiB | overlord loader MiB | loader ratio | baseline from "
        "| overlord from |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for x in rows:
        lines.append(
            f"| {x['state']} | {x['shadows']} | {mib(x['baseline_total'])} "
            f"| {mib(x['overlord_total'])} | {x['total_ratio']:.2f}x "
            f"| {mib(x['baseline_loader'])} | {mib(x['overlord_loader'])} "
            f"| {x['ratio']:.2f}x | {x['baseline_how']} | {x['overlord_how']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], target: tuple[int, int, int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    states = list(dict.fromkeys(x["state"] for x in rows))
    xs = range(len(states))
    for sh, style in ((0, "o-"), (1, "s--")):
        pts = {x["state"]: x for x in rows if x["shadows"] == sh}
        if pts:
            ax.plot(
                [i for i, st in enumerate(states) if st in pts],
                [pts[st]["overlord_loader"] / MiB for st in states if st in pts],
                style,
                color="tab:blue",
                label=f"overlord loader, shadows {sh}",
            )
    base = {x["state"]: x["baseline_loader"] / MiB for x in rows}
    ax.plot(xs, [base[st] for st in states], "o-", color="tab:red", label="colocated loader")
    ax.set_xticks(list(xs), states)
    ax.set_yscale("log")
    ax.set_xlabel("per-source state of a colocated worker")
    ax.set_ylabel("loader memory, PSS MiB (run total - bare trainers)")
    ax.set_title(f"Loader memory at R x W x S = {' x '.join(map(str, target))}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(
    runs: list[dict[str, Any]],
    states: list[State],
    shadows: list[int],
    target: tuple[int, int, int],
) -> tuple[str, list[dict[str, Any]]]:
    bare = {x["R"]: x for x in runs if x["kind"] == "bare"}
    rows = [
        y
        for st in states
        for sh in shadows
        if (y := at_target(runs, bare, st.label, sh, target)) is not None
    ]
    out = [
        "Measured runs (PSS MiB; process count in brackets):",
        "",
        measured_table(runs, bare),
        "",
        target_table(rows, target),
    ]
    for sh in shadows:
        pts = [
            (float(st.bytes), y["ratio"])
            for st in states
            for y in rows
            if y["state"] == st.label and y["shadows"] == sh and st.kind != "images"
        ]
        if not pts:
            continue  # images only: no line of text states to cross
        x = crossover(pts)
        where = (
            "at no state swept"
            if x is None
            else "already at index"
            if x == 0
            else f"at about {x / MiB:.1f} MiB of state per source per worker"
        )
        out.append(f"\nshadows {sh}: overlord's loader memory is below the colocated one {where}.")
    ir, iw, is_ = INDEX_TARGET
    for sh in shadows:
        b = [
            x
            for x in runs
            if x["kind"] == "baseline"
            and x["state"] == "index"
            and (x["R"], x["W"], x["S"]) == INDEX_TARGET
        ]
        o = [
            x
            for x in runs
            if x["kind"] == "overlord"
            and x["state"] == "index"
            and (x["R"], x["S"]) == (ir, is_)
            and x["shadows"] == sh
        ]
        if b and o:
            lb, lo = _loader(b[0], bare), _loader(o[0], bare)
            out.append(
                f"index-only at {ir} x {iw} x {is_}, shadows {sh} (measured): baseline loader "
                f"{mib(lb)} MiB, overlord loader {mib(lo)} MiB: {lb / lo:.2f}x; totals "
                f"{mib(b[0]['total'])} and {mib(o[0]['total'])} MiB."
            )
    return "\n".join(out), rows
