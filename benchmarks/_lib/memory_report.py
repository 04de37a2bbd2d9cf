"""The report of ``benchmarks/memory.py``: figures at the target, measured or carried there.

``at_target`` takes the measured runs of an overlord design (on Ray, or in node mode) and
the baseline's to R x W x S (``linear`` in S, and R times one trainer's loader memory for
the baseline); ``crossover`` finds the state where overlord starts to win;
``node_breakdown`` splits node mode's memory between rank 0 and the other trainers; the
rest print tables and draw the plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._lib.colocated import MiB, State, linear
from benchmarks._lib.procfs import CATEGORIES

TARGET = (8, 4, 32)  # (R, W, S): >= 13.5x less loader memory at 64 MB
INDEX_TARGET = (8, 2, 16)  # no worse than the baseline at index-only state
NODE = "overlord-node"  # overlord's node mode: torchrun on one node, no Ray


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
    design: str = "overlord",
) -> dict[str, Any] | None:
    """The baseline's and an overlord ``design``'s memory at ``target``, measured or carried.

    The figures of ``design`` (``overlord`` on Ray or ``overlord-node``) are under the
    ``overlord_*`` keys; ``design`` names which.
    """
    r, w, s = target
    b = [
        (x["S"], _loader(x, bare))
        for x in runs
        if x["kind"] == "baseline" and x["state"] == state and x["R"] == 1 and x["W"] == w
    ]
    o = [
        (x["S"], _loader(x, bare))
        for x in runs
        if x["kind"] == design
        and x["state"] == state
        and x["R"] == r
        and x.get("shadows", 0) == shadows
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
        "design": design,
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
        if x.get("design", "overlord") != "overlord":
            continue
        lines.append(
            f"| {x['state']} | {x['shadows']} | {mib(x['baseline_total'])} "
            f"| {mib(x['overlord_total'])} | {x['total_ratio']:.2f}x "
            f"| {mib(x['baseline_loader'])} | {mib(x['overlord_loader'])} "
            f"| {x['ratio']:.2f}x | {x['baseline_how']} | {x['overlord_how']} |"
        )
    return "\n".join(lines)


def node_table(rows: list[dict[str, Any]], target: tuple[int, int, int]) -> str:
    """Node mode beside overlord on Ray (``shadows`` 0, as node mode) at ``target``."""
    ray = {x["state"]: x for x in rows if x["design"] == "overlord" and x["shadows"] == 0}
    lines = [
        f"overlord on Ray (shadows 0) and in node mode (torchrun, no Ray) at R x W x S = "
        f"{' x '.join(map(str, target))}:",
        "",
        "| state | baseline loader MiB | Ray loader MiB | node loader MiB | Ray loader ratio "
        "| node loader ratio | baseline total MiB | Ray total MiB | node total MiB "
        "| Ray total ratio | node total ratio | node from |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for x in rows:
        if x["design"] != NODE:
            continue
        y = ray.get(x["state"])

        def r(key: str, fmt: str = "mib", y: dict[str, Any] | None = y) -> str:
            if y is None:
                return "-"
            return mib(y[key]) if fmt == "mib" else f"{y[key]:.2f}x"

        lines.append(
            f"| {x['state']} | {mib(x['baseline_loader'])} | {r('overlord_loader')} "
            f"| {mib(x['overlord_loader'])} | {r('ratio', 'x')} | {x['ratio']:.2f}x "
            f"| {mib(x['baseline_total'])} | {r('overlord_total')} | {mib(x['overlord_total'])} "
            f"| {r('total_ratio', 'x')} | {x['total_ratio']:.2f}x | {x['overlord_how']} |"
        )
    return "\n".join(lines)


def node_breakdown(m: dict[str, Any], bare: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Where a node-mode run's loader memory goes: rank 0, the other trainers, the rest.

    Each trainer is taken above a bare trainer (the bare run of as many trainers, its
    total split evenly); ``rest`` is every process that is no trainer (none expected).
    """
    ranks = m["trainer_pss"]
    each = bare[m["R"]]["total"] / m["R"]
    others = [x - each for x in ranks[1:]]
    return {
        "rank0": ranks[0] - each,
        "others": sum(others),
        "other_each": sum(others) / len(others) if others else 0.0,
        "rest": m["total"] - sum(ranks),
    }


def index_table(
    runs: list[dict[str, Any]],
    bare: dict[int, dict[str, Any]],
    designs: list[tuple[str, int, str]],
) -> str:
    """The index-only target (``INDEX_TARGET``, measured): each design against the baseline.

    ``designs``: ``(kind, shadows, label)`` of the overlord designs to show.
    """
    ir, iw, is_ = INDEX_TARGET
    b = [
        x
        for x in runs
        if x["kind"] == "baseline"
        and x["state"] == "index"
        and (x["R"], x["W"], x["S"]) == INDEX_TARGET
    ]
    if not b:
        return ""
    lb = _loader(b[0], bare)
    lines = [
        f"Index-only at R x W x S = {ir} x {iw} x {is_} (measured):",
        "",
        "| design | loader MiB | total MiB | loader ratio | total ratio |",
        "|---|---:|---:|---:|---:|",
        f"| colocated, W={iw} | {mib(lb)} | {mib(b[0]['total'])} | 1.00x | 1.00x |",
    ]
    for design, sh, label in designs:
        for x in runs:
            if (
                x["kind"] == design
                and x["state"] == "index"
                and (x["R"], x["S"]) == (ir, is_)
                and x.get("shadows", 0) == sh
            ):
                lo = _loader(x, bare)
                name = "overlord in node mode" if design == NODE else f"overlord on Ray, {label}"
                lines.append(
                    f"| {name} | {mib(lo)} | {mib(x['total'])} | {lb / lo:.2f}x "
                    f"| {b[0]['total'] / x['total']:.2f}x |"
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
        pts = {x["state"]: x for x in rows if x["design"] == "overlord" and x["shadows"] == sh}
        if pts:
            ax.plot(
                [i for i, st in enumerate(states) if st in pts],
                [pts[st]["overlord_loader"] / MiB for st in states if st in pts],
                style,
                color="tab:blue",
                label=f"overlord loader on Ray, shadows {sh}",
            )
    node = {x["state"]: x for x in rows if x["design"] == NODE}
    if node:
        ax.plot(
            [i for i, st in enumerate(states) if st in node],
            [node[st]["overlord_loader"] / MiB for st in states if st in node],
            "^-",
            color="tab:green",
            label="overlord loader, node mode (no Ray)",
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
    rows += [
        y for st in states if (y := at_target(runs, bare, st.label, 0, target, NODE)) is not None
    ]
    out = [
        "Measured runs (PSS MiB; process count in brackets):",
        "",
        measured_table(runs, bare),
    ]
    if any(x["design"] == "overlord" for x in rows):
        out += ["", target_table(rows, target)]
    if any(x["design"] == NODE for x in rows):
        out += ["", node_table(rows, target)]
    lines = [("overlord", sh, f"shadows {sh}") for sh in shadows] + [(NODE, 0, "node mode")]
    for design, sh, label in lines:
        pts = [
            (float(st.bytes), y["ratio"])
            for st in states
            for y in rows
            if y["state"] == st.label
            and y["design"] == design
            and y["shadows"] == sh
            and st.kind != "images"
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
        out.append(f"\n{label}: overlord's loader memory is below the colocated one {where}.")
    index = index_table(runs, bare, lines)
    if index:
        out += ["", index]
    for m in runs:
        if m["kind"] == NODE and "trainer_pss" in m:
            k = node_breakdown(m, bare)
            out.append(
                f"node mode, {m['state']} at R={m['R']} S={m['S']}: loader "
                f"{mib(_loader(m, bare))} MiB = rank 0 {mib(k['rank0'])} above a bare trainer "
                f"+ the other {m['R'] - 1} trainers {mib(k['others'])} "
                f"({mib(k['other_each'])} each) + other processes {mib(k['rest'])}."
            )
    return "\n".join(out), rows
