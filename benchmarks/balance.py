"""Balance: the most loaded DP rank's cost over the lower bound, per (DP, context length).

For DP 8, 32, 128, 512 and ``max_seq_len`` 4096 to 32768, each step holds
``dp * rows_per_rank`` rows (``--rows-per-rank``, default 2): 4096 rows of
8192 tokens at DP 512 is a 32M-token step, 16 rows of 4096 at DP 8 is 64K.
Steps are selected by overlord's ``select_step`` from four synthetic sources
with long-tailed lengths (``_lib/synthetic.py``: web, code, papers, books; split at
``max_seq_len``), costed with the 7B model (alpha = 6 * 7e9, beta = 6 * 32 *
4096) and assigned by ``assign`` with ``kk``, ``lpt`` and ``none``. ``none``
is what a per-rank loader of packed rows does: equal tokens per rank, costs
unseen; so every speed-up below is against a packing loader, not against one
that gives every rank the same number of documents.

Reported per setting, over N steps: mean and p95 of makespan / LB, where LB is
overlord's ``lower_bound``, ``max(total / dp, largest item)``; the mean of
LB_cap / LB and of kk's makespan / LB_cap, where LB_cap is the capacity-aware
bound; how often ``kk`` fell back to balancing whole reference rows;
and kk's speed-up over none (none's mean makespan over kk's).

LB_cap is ``overlord.plan.bounds.capacity_bound``: a rank holding long items (a
large sum of squared lengths) must still carry its share of the tokens when the
other ranks have no room for them; its docstring says why it is a lower bound.

Run from the repository root::

    .venv/bin/python -m benchmarks.balance            # about two minutes
    .venv/bin/python -m benchmarks.balance --quick    # about 30 s
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks._lib.synthetic import model_7b, next_step, weights, windows
from overlord.plan import balance as bal
from overlord.plan.bounds import capacity_bound
from overlord.plan.select import MixState
from overlord.plan.spec import BalanceMethod

METHODS = (BalanceMethod.KK, BalanceMethod.LPT, BalanceMethod.NONE)
DPS = (8, 32, 128, 512)
SEQ_LENS = (4096, 8192, 16384, 32768)
LOOKAHEAD = 64
TARGET = 1.02


def bench(dp: int, cap: int, rpr: int, steps: int, seed: int) -> dict:
    """Select and assign ``steps`` steps; the balance figures of each method."""
    cm = model_7b()
    wins, w = windows(cap, seed), weights()
    mix = MixState.zeros(len(wins))
    rows = dp * rpr
    ratio: dict[BalanceMethod, list[float]] = {m: [] for m in METHODS}
    makespan: dict[BalanceMethod, list[float]] = {m: [] for m in METHODS}
    seconds: dict[BalanceMethod, float] = {m: 0.0 for m in METHODS}
    cap_over_lb, kk_over_cap, fill, attn, items = [], [], [], [], []
    kk_fallback = 0
    violations = 0  # steps where a method beat LB_cap: there must be none
    for _ in range(steps):
        tok, ref_row, cost = next_step(wins, w, mix, rows, cap, LOOKAHEAD, cm)
        lb = bal.lower_bound(cost, dp)
        lb_cap = capacity_bound(tok, cost, cm.alpha, cm.beta, dp, rpr * cap)
        for m in METHODS:
            t0 = time.perf_counter()
            row = bal.assign(tok, cost, ref_row, dp, rpr, cap, m)
            seconds[m] += time.perf_counter() - t0
            mk = float(bal.rank_costs(cost, row, dp, rpr).max())
            makespan[m].append(mk)
            ratio[m].append(mk / lb)
            violations += bool(mk < lb_cap * (1 - 1e-9))
            if m is BalanceMethod.KK:
                kk_over_cap.append(mk / lb_cap)
                fallback = bal.whole_rows(cost, ref_row, dp, rpr)
                kk_fallback += bool(np.array_equal(row, fallback))
        cap_over_lb.append(lb_cap / lb)
        fill.append(tok.sum() / (rows * cap))
        attn.append(cm.beta * float((tok.astype(np.float64) ** 2).sum()) / float(cost.sum()))
        items.append(len(tok))
    return {
        "dp": dp,
        "cap": cap,
        "rpr": rpr,
        "items": float(np.mean(items)),
        "fill": float(np.mean(fill)),
        "attn": float(np.mean(attn)),
        "mean": {m: float(np.mean(ratio[m])) for m in METHODS},
        "p95": {m: float(np.percentile(ratio[m], 95)) for m in METHODS},
        "cap_over_lb": float(np.mean(cap_over_lb)),
        "kk_over_cap": float(np.mean(kk_over_cap)),
        "kk_over_cap_p95": float(np.percentile(kk_over_cap, 95)),
        "kk_fallback": kk_fallback / steps,
        "speedup": float(np.mean(makespan[METHODS[2]]) / np.mean(makespan[METHODS[0]])),
        "violations": violations,
        "ms": {m: 1e3 * seconds[m] / steps for m in METHODS},
    }


def print_table(results: list[dict]) -> None:
    print(
        "| DP | max_seq_len | rows/rank | items/step | fill | attn share "
        "| kk mean | kk p95 | lpt mean | lpt p95 | none mean | none p95 "
        "| LB_cap/LB | kk/LB_cap mean | kk/LB_cap p95 | kk fell back to rows | kk speed-up vs none "
        "| kk ms | lpt ms |"
    )
    print("|" + "---:|" * 19)
    kk, lpt, none = METHODS
    for r in results:
        mean, p95 = r["mean"], r["p95"]
        print(
            f"| {r['dp']} | {r['cap']} | {r['rpr']} | {r['items']:.0f} | {100 * r['fill']:.2f}% "
            f"| {100 * r['attn']:.1f}% "
            f"| {mean[kk]:.4f} | {p95[kk]:.4f} | {mean[lpt]:.4f} | {p95[lpt]:.4f} "
            f"| {mean[none]:.4f} | {p95[none]:.4f} "
            f"| {r['cap_over_lb']:.4f} | {r['kk_over_cap']:.4f} | {r['kk_over_cap_p95']:.4f} "
            f"| {100 * r['kk_fallback']:.0f}% | {r['speedup']:.3f}x "
            f"| {r['ms'][kk]:.0f} | {r['ms'][lpt]:.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps per setting instead of 10")
    ap.add_argument("--steps", type=int, help="steps per setting")
    ap.add_argument("--rows-per-rank", type=int, default=2, help="rows of each rank per step")
    ap.add_argument("--dp", type=int, nargs="+", default=list(DPS), help="DP sizes")
    ap.add_argument("--seq-len", type=int, nargs="+", default=list(SEQ_LENS), help="max_seq_len")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)

    results = [
        bench(dp, cap, args.rows_per_rank, steps, args.seed)
        for dp in args.dp
        for cap in args.seq_len
    ]
    print("# Balance: most loaded rank's cost / lower bound (7B cost model)\n")
    print(
        f"{steps} steps per setting, {args.rows_per_rank} rows of max_seq_len per rank; "
        "LB = max(total/dp, largest item); "
        "LB_cap = the capacity-aware bound (overlord.plan.bounds.capacity_bound). "
        "'attn share' is the attention term's share of the step's cost; 'kk fell back to rows' "
        "is how often assign's kk result is the whole-reference-rows fallback.\n"
    )
    print_table(results)

    bad = sum(r["violations"] for r in results)
    if bad:
        print(f"\nWARNING: in {bad} (step, method) pairs a makespan was below LB_cap: a bug.")
    kk = BalanceMethod.KK
    print(f"\nTarget: kk within {100 * (TARGET - 1):.0f}% of the lower bound on average, DP 8-512:")
    for r in results:
        m = r["mean"][kk]
        verdict = "meets" if m <= TARGET else "MISSES"
        cap_verdict = "meets" if r["kk_over_cap"] <= TARGET else "misses"
        print(
            f"- DP {r['dp']}, {r['cap']}: kk/LB {m:.4f} {verdict}; "
            f"kk/LB_cap {r['kk_over_cap']:.4f} ({cap_verdict} against the capacity-aware bound)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
