"""Run the cost-fit benchmark: ``python -m benchmarks.cost_fit`` (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks import cost_fit
from benchmarks.cost_fit.attention import Flex, attn_sdpa_loop, check_attn, make_varlen
from benchmarks.cost_fit.fit import balance_results, fits
from benchmarks.cost_fit.model import AttnFn, Shape, Stack
from benchmarks.cost_fit.report import clean, ctx_label, plot, rows_md, summary_md
from benchmarks.cost_fit.rows import (
    Row,
    balance_steps,
    fit_rows,
)
from benchmarks.cost_fit.timing import Timer
from overlord.plan.cost import CostModel
from overlord.plan.spec import CostSpec

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cost_fit", description=(cost_fit.__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bf16 on CUDA")
    ap.add_argument(
        "--attn",
        default="auto",
        choices=("auto", "varlen", "varlen-contiguous", "flex", "sdpa-loop"),
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--rows", type=int, default=24, help="fit rows per context")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per row")
    ap.add_argument(
        "--warmup-first", type=int, default=3, help="untimed runs, first row of a shape"
    )
    ap.add_argument("--balance-contexts", default="16384", help="'' for no balance check")
    ap.add_argument("--balance-dp", type=int, default=8)
    ap.add_argument("--balance-rpr", type=int, default=2)
    ap.add_argument("--balance-steps", type=int, default=4)
    ap.add_argument("--balance-reps", type=int, default=3)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="stop measuring new rows after this many seconds from the start",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny model and contexts (plumbing)")
    ap.add_argument("--out", default=os.environ.get("OUT") or HERE)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.inter, args.layers = 256, 4, 688, 1
        args.contexts, args.rows, args.reps, args.warmup_first = "512,1024", 6, 2, 1
        args.balance_contexts, args.balance_dp, args.balance_rpr = "1024", 4, 2
        args.balance_steps, args.balance_reps = 1, 1
        args.budget_s = min(args.budget_s, 40.0)
    return args


def choose_attn(
    args: argparse.Namespace,
    s: Shape,
    device: torch.device,
    dtype: torch.dtype,
    max_tokens: int,
    check_t: int,
) -> tuple[str, AttnFn, Flex | None, str, list[str]]:
    """The first attention of the chain that runs and matches ``sdpa-loop``, and why not others."""
    order = ["varlen", "varlen-contiguous", "flex", "sdpa-loop"]
    if args.attn != "auto":
        chain = order[order.index(args.attn) :]
    else:
        chain = order if device.type == "cuda" else ["sdpa-loop"]
    fallbacks: list[str] = []
    for name in chain:
        try:
            flex = None
            if name.startswith("varlen"):
                fn: AttnFn = make_varlen(contiguous=name == "varlen-contiguous")
            elif name == "flex":
                flex = Flex(max_tokens, device)
                fn = flex
            else:
                fn = attn_sdpa_loop
            note = (
                check_attn(fn, flex, s, check_t, device, dtype)
                if name != "sdpa-loop"
                else "the reference"
            )
            return name, fn, flex, note, fallbacks
        except Exception as e:  # any failure: try the next one
            msg = f"{name} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            print(f"attention: {msg}; trying the next")
            fallbacks.append(msg)
    raise RuntimeError("no attention implementation works: " + "; ".join(fallbacks))


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    s = Shape(args.hidden, args.heads, args.inter, args.layers)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    bal_contexts = [int(c) for c in args.balance_contexts.split(",") if c]
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.quick and device.type == "cpu":
        torch.set_num_threads(1)  # plumbing only: steady on a shared machine

    max_tokens = max(contexts + bal_contexts)
    name, fn, flex, note, fallbacks = choose_attn(
        args, s, device, dtype, max_tokens, min(contexts + bal_contexts)
    )
    print(f"attention: {name} ({note})", flush=True)
    stack = Stack(s, fn).to(device, dtype)
    params = sum(p.numel() for p in stack.parameters())
    cm = CostModel.from_spec(
        CostSpec(model={"params": float(params), "layers": s.layers, "hidden": s.hidden})
    )
    timer = Timer(stack, s, device, dtype, flex, max_tokens)

    # the order of work: a third of each context's rows (round robin), the balance check,
    # then the rest; --budget-s cuts the tail (a balance step not measured in full is
    # left out of the balance results)
    rng = np.random.default_rng(args.seed)
    per_ctx = {c: fit_rows(c, args.rows, rng) for c in contexts}
    first = max(3, -(-args.rows // 3))
    pad = name == "flex"  # flex is compiled per row length: run balance rows padded to T
    steps = [
        st
        for c in bal_contexts
        for st in balance_steps(
            c, args.balance_dp, args.balance_rpr, args.balance_steps, cm, args.seed, pad
        )
    ]
    jobs: list[tuple[Row, int]] = []
    for lo, hi in ((0, first), (first, args.rows)):
        for i in range(lo, hi):
            jobs += [(per_ctx[c][i], args.reps) for c in contexts if i < len(per_ctx[c])]
        if lo == 0:
            jobs += [(r, args.balance_reps) for st in steps for m in st.rows for r in st.rows[m]]

    warmed: set[int] = set()
    last_s: dict[int, float] = {}
    cache: dict[tuple[int, ...], list[float]] = {}
    stopped_early, failures, measured = False, 0, 0
    for row, reps in jobs:
        if not row.lengths:  # an empty row of a balance step: nothing to run
            continue
        key = tuple(row.lengths)
        if key in cache:  # the same row under both methods, or a padded twin
            row.ms_all = cache[key]
            row.ms = float(np.median(row.ms_all))
            continue
        elapsed = time.perf_counter() - t_start
        if elapsed + last_s.get(row.context, 0.0) > args.budget_s:
            stopped_early = True
            continue
        warm = args.warmup if row.context in warmed else args.warmup_first
        t0 = time.perf_counter()
        try:
            row.ms_all = timer.measure(row.lengths, warm, reps)
        except Exception as e:  # report, go on with the other rows
            failures += 1
            why = " ".join(str(e).split())[:500]
            print(f"row {row.kind} at {row.context} failed: {type(e).__name__}: {why}", flush=True)
            if failures >= 3:
                print("three rows failed: stopping", flush=True)
                stopped_early = True
                break
            continue
        warmed.add(row.context)
        last_s[row.context] = time.perf_counter() - t0
        row.ms = float(np.median(row.ms_all))
        cache[key] = row.ms_all
        measured += 1
        print(
            f"[{time.perf_counter() - t_start:6.1f}s] {ctx_label(row.context):>4} {row.group:7} "
            f"{row.kind:16} docs={len(row.lengths):4d} S2/T^2={row.s2 / row.context**2:.4f} "
            f"{row.ms:8.2f} ms",
            flush=True,
        )

    all_rows = [r for c in contexts for r in per_ctx[c]] + [
        r for st in steps for m in st.rows for r in st.rows[m]
    ]
    fitted = fits(all_rows, cm.alpha, cm.beta)
    balance, balance_total = balance_results(steps, cm.alpha, cm.beta, fitted)
    res: dict[str, Any] = {
        "config": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__,
            "dtype": str(dtype).replace("torch.", ""),
            "attn": name,
            "attn_check": note,
            "attn_fallbacks": fallbacks,
            "hidden": s.hidden,
            "heads": s.heads,
            "inter": s.inter,
            "layers": s.layers,
            "params": params,
            "alpha": cm.alpha,
            "beta": cm.beta,
            "contexts": contexts,
            "reps": args.reps,
            "warmup": args.warmup,
            "warmup_first": args.warmup_first,
            "balance_reps": args.balance_reps,
            "balance_rows_padded": pad,
            "budget_s": args.budget_s,
            "rows_measured": measured,
            "row_failures": failures,
            "stopped_early": stopped_early,
            "quick": args.quick,
        },
        "rows": [
            {
                "group": r.group,
                "context": r.context,
                "kind": r.kind,
                "n_docs": len(r.lengths),
                "S1": r.s1,
                "S2": r.s2,
                "ms": r.ms,
                "ms_all": r.ms_all,
                "pred_a": r.pred_a,
                "pred_b": r.pred_b,
                "n_real": r.n_real,
                "lengths": r.lengths,
            }
            for r in all_rows
        ],
        "fits": fitted,
        "balance": balance,
        "balance_total": balance_total,
    }
    res["config"]["elapsed_s"] = time.perf_counter() - t_start
    res = clean(res)
    with open(os.path.join(args.out, "cost_fit.json"), "w") as f:
        json.dump(res, f, indent=1)
    summary = summary_md(res)
    with open(os.path.join(args.out, "cost_fit.md"), "w") as f:
        f.write(summary + "\n" + rows_md(res))
    if fitted:
        plot(res, os.path.join(args.out, "cost_fit.png"))
    print("\n" + summary)
    names = ("cost_fit.json", "cost_fit.md", "cost_fit.png")
    print("Written: " + ", ".join(os.path.join(args.out, n) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
