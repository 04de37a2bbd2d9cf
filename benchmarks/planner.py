"""Time to plan one step: what overlord's planner does per step, with no I/O.

One step is ``select_step`` (token-share mixing of four synthetic sources into
the step's rows, reading item lengths through ``peek``), the cost model
(7B: alpha = 6N, beta = 6 * layers * hidden) and ``assign`` (items to DP
ranks and rows) with ``kk``, ``lpt`` or ``none``. Each source is an in-memory
window of lognormal document lengths (web median 600 tokens, code 1,500,
papers 8,000, books 60,000; see ``_lib/synthetic.py``), split at ``max_seq_len`` as
``long_docs: split`` does. The selection does not depend on the method or on
DP, so each step is selected once and assigned with each method; a method's
time per step is select + cost + its assign.

Grid: DP 8, 64, 512, 4096 and 1M, 4M, 16M tokens per step (2**20 ...).
``max_seq_len`` is 8192, or 4096 when the step's rows at 8192 do not split
evenly over DP; a combination where neither does is skipped (and listed).
The process is pinned to one CPU (``os.sched_setaffinity``) where the OS
allows it. Target: under 50 ms per step at DP 512 with 4M tokens.

Run from the repository root::

    .venv/bin/python -m benchmarks.planner            # under a minute
    .venv/bin/python -m benchmarks.planner --quick    # about 15 s
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from benchmarks._lib.synthetic import consume, model_7b, weights, windows
from benchmarks._lib.timing import pin_one_cpu
from overlord.plan.balance import assign
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod

METHODS = (BalanceMethod.KK, BalanceMethod.LPT, BalanceMethod.NONE)
DPS = (8, 64, 512, 4096)
MIB = 1 << 20
TOKENS = (1 * MIB, 4 * MIB, 16 * MIB)
LOOKAHEAD = 64  # the plan's default batch.lookahead
TARGET_MS = 50.0


def seq_len_for(tokens: int, dp: int) -> int | None:
    """8192, else 4096, whichever makes the step's rows a multiple of ``dp``; else None."""
    for cap in (8192, 4096):
        if tokens % cap == 0 and (tokens // cap) % dp == 0:
            return cap
    return None


def bench(tokens: int, dp: int, cap: int, steps: int, warmup: int, seed: int) -> list[dict]:
    """Plan ``warmup + steps`` steps; per method, the times of the last ``steps``."""
    cost_model = model_7b()
    wins, w = windows(cap, seed), weights()
    mix = MixState.zeros(len(wins))
    rows = tokens // cap
    rpr = rows // dp
    times: dict[BalanceMethod, list[tuple[float, float]]] = {m: [] for m in METHODS}
    items = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        sel = select_step(wins, w, mix, rows, cap, LOOKAHEAD)
        tok = np.asarray(sel.tokens, dtype=np.int64)
        ref_row = np.asarray(sel.ref_row, dtype=np.int64)
        cost = cost_model.cost(tok)
        t_select = time.perf_counter() - t0
        for m in METHODS:
            t1 = time.perf_counter()
            assign(tok, cost, ref_row, dp, rpr, cap, m)
            t_assign = time.perf_counter() - t1
            if step >= warmup:
                times[m].append((t_select, t_assign))
        if step >= warmup:
            items.append(len(tok))
        # the cursor's bookkeeping (not timed): drop the placed items from each window
        consume(wins, sel)
    out = []
    for m in METHODS:
        sel_ms = np.array([a for a, _ in times[m]]) * 1e3
        asg_ms = np.array([b for _, b in times[m]]) * 1e3
        total = sel_ms + asg_ms
        out.append(
            {
                "tokens": tokens,
                "dp": dp,
                "cap": cap,
                "rpr": rpr,
                "method": m.value,
                "items": float(np.mean(items)),
                "select_ms": float(np.median(sel_ms)),
                "assign_ms": float(np.median(asg_ms)),
                "median_ms": float(np.median(total)),
                "p95_ms": float(np.percentile(total, 95)),
            }
        )
    return out


def breakdown(tokens: int, dp: int, cap: int, steps: int, seed: int) -> list[str]:
    """Where ``assign`` spends its time at one setting: each of its public parts alone."""
    from overlord.plan import balance as b

    cost_model = model_7b()
    wins, w = windows(cap, seed), weights()
    mix = MixState.zeros(len(wins))
    rows = tokens // cap
    rpr = rows // dp
    rec: dict[str, list[float]] = {}
    fails = {"kk_rows": 0, "lpt_rows": 0}
    at_bound = 0
    for _ in range(steps):
        sel = select_step(wins, w, mix, rows, cap, LOOKAHEAD)
        tok = np.asarray(sel.tokens, dtype=np.int64)
        ref_row = np.asarray(sel.ref_row, dtype=np.int64)
        cost = cost_model.cost(tok)
        consume(wins, sel)
        calls: dict[str, tuple[Any, tuple[Any, ...]]] = {
            "kk_partition": (b.kk_partition, (cost, dp)),
            "kk_rows": (b.kk_rows, (tok, cost, dp, rpr, cap)),
            "lpt_rows": (b.lpt_rows, (tok, cost, dp, rpr, cap)),
            "whole_rows": (b.whole_rows, (cost, ref_row, dp, rpr)),
        }
        for name, (fn, fn_args) in calls.items():
            t0 = time.perf_counter()
            got = fn(*fn_args)
            rec.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            if name in fails and got is None:
                fails[name] += 1
            if name == "whole_rows":
                mk = b.rank_costs(cost, got, dp, rpr).max()
                at_bound += bool(mk <= b.lower_bound(cost, dp) * (1 + 1e-9))
    out = [f"{name}: {np.median(v):.1f} ms" for name, v in rec.items()]
    out += [
        f"kk_rows gave up (capacity repair failed, assign falls back to whole rows): "
        f"{fails['kk_rows']}/{steps} steps",
        f"lpt_rows gave up: {fails['lpt_rows']}/{steps} steps",
        f"the whole-rows fallback already meets max(total/dp, largest item): "
        f"{at_bound}/{steps} steps",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps per setting instead of 10")
    ap.add_argument("--steps", type=int, help="measured steps per setting")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-breakdown", action="store_true", help="skip the assign breakdown")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)
    warmup = 1
    pinned = pin_one_cpu()

    rows_out, skipped = [], []
    for tokens in TOKENS:
        for dp in DPS:
            cap = seq_len_for(tokens, dp)
            if cap is None:
                skipped.append(f"{tokens // MIB}M tokens at DP {dp}")
                continue
            rows_out += bench(tokens, dp, cap, steps, warmup, args.seed)

    print(f"# Planner: time to plan one step (select + cost + assign), {pinned}\n")
    print(
        f"{steps} measured steps per setting after {warmup} warm-up step; 7B cost model; "
        "p95 over so few steps is close to the maximum.\n"
    )
    print(
        "| tokens/step | DP | max_seq_len | rows/rank | method | items/step | select ms "
        "| assign ms | median ms | p95 ms |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows_out:
        print(
            f"| {r['tokens'] // MIB}M | {r['dp']} | {r['cap']} | {r['rpr']} | {r['method']} "
            f"| {r['items']:.0f} | {r['select_ms']:.1f} | {r['assign_ms']:.1f} "
            f"| {r['median_ms']:.1f} | {r['p95_ms']:.1f} |"
        )
    if skipped:
        print(f"\nSkipped (rows at 8192 and 4096 do not split over DP): {', '.join(skipped)}.")
    print(f"\nTarget: under {TARGET_MS:.0f} ms per step at DP 512 with 4M tokens (one core):")
    for r in rows_out:
        if r["dp"] == 512 and r["tokens"] == 4 * MIB:
            ok = r["median_ms"] < TARGET_MS and r["p95_ms"] < TARGET_MS
            verdict = "meets" if ok else "MISSES"
            print(
                f"- {r['method']}: median {r['median_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms: "
                f"{verdict}"
            )
    if not args.no_breakdown:
        print("\nWhere assign's time goes at DP 512, 4M tokens, max_seq_len 8192 (median):")
        for line in breakdown(4 * MIB, 512, 8192, steps, args.seed):
            print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
