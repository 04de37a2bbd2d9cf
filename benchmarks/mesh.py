"""The device mesh: balance with CP at long context, and batch bytes per node against TP.

1. **Balance with CP** (simulated, 7B cost model). For ``max_seq_len`` 32K,
   64K and 128K and CP 2, 4 and 8, DP 8 groups with 2 rows each: steps are
   selected by overlord's ``select_step`` from the long-tailed synthetic
   sources of ``_lib/synthetic.py`` (split at ``max_seq_len``), every item is
   costed for one rank of its CP group (``overlord.plan.cp.cp_cost``, layout
   ``per_document``: documents padded to a multiple of ``2 * cp``, cost / cp)
   and assigned with ``kk`` and with ``none`` (a per-rank loader of packed
   rows, the baseline). Reported: mean makespan over the capacity-aware lower
   bound LB_cap (``overlord.plan.bounds.capacity_bound`` with alpha/cp and
   beta/cp, valid since padding only adds cost) for both, kk's speed-up over
   none (mean makespans), and the tokens ``per_document`` adds (its padding).
2. **Bytes per step against TP** (embedded runtime, measured). DP 2 x TP t,
   t = 1, 2, 4, 8, every global rank consuming: batches built per step (a
   counting wrapper around ``DataConstructor._build``: builds per DP rank
   and step, 1 when the payloads are fetched and packed once per group) and the bytes of
   distinct arrays that all ranks together hold for a step. TP 1 is the
   baseline, in the same run; figures are ratios to it.

Run from the repository root::

    .venv/bin/python -m benchmarks.mesh            # about a minute
    .venv/bin/python -m benchmarks.mesh --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._lib.synthetic import model_7b, next_step, weights, windows
from overlord.plan import balance as bal
from overlord.plan.bounds import capacity_bound
from overlord.plan.cost import CostModel
from overlord.plan.cp import cp_cost, padded_lengths
from overlord.plan.select import MixState
from overlord.plan.spec import BalanceMethod
from overlord.world import CPLayout

DP, RPR, LOOKAHEAD = 8, 2, 64


def balance(cap: int, cp: int, steps: int, seed: int) -> dict[str, Any]:
    """kk with the CP-aware cost against per-rank packing, over ``steps`` steps."""
    model = model_7b()
    per_rank = CostModel(model.alpha / cp, model.beta / cp)
    wins, w = windows(cap, seed), weights()
    mix = MixState.zeros(len(wins))
    span: dict[str, list[float]] = {"kk": [], "none": []}
    over: dict[str, list[float]] = {"kk": [], "none": []}
    added = []
    for _ in range(steps):
        tok, ref_row, _ = next_step(wins, w, mix, DP * RPR, cap, LOOKAHEAD, model)
        cost = cp_cost(model, tok, None, cp, CPLayout.PER_DOCUMENT)
        lb_cap = capacity_bound(tok, cost, per_rank.alpha, per_rank.beta, DP, RPR * cap)
        for name, method in (("kk", BalanceMethod.KK), ("none", BalanceMethod.NONE)):
            row = bal.assign(tok, cost, ref_row, DP, RPR, cap, method)
            mk = float(bal.rank_costs(cost, row, DP, RPR).max())
            span[name].append(mk)
            over[name].append(mk / lb_cap)
        added.append(padded_lengths(tok, cp, CPLayout.PER_DOCUMENT).sum() / tok.sum() - 1)
    return {
        "cap": cap,
        "cp": cp,
        "kk": float(np.mean(over["kk"])),
        "none": float(np.mean(over["none"])),
        "speedup": float(np.mean(span["none"]) / np.mean(span["kk"])),
        "padding": float(np.mean(added)),
    }


def _corpus(root: Path) -> Path:
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    lines = [json.dumps({"text": "x" * int(rng.lognormal(6, 1))}) for _ in range(4000)]
    (root / "data" / "a.jsonl").write_text("\n".join(lines) + "\n")
    plan = {
        "seed": 0,
        "sources": [{"name": "a", "path": "data/*.jsonl", "format": "jsonl"}],
        "batch": {"tokens_per_step": 8 * 4096, "max_seq_len": 4096},
        "world": {"dp": 2},
    }
    (root / "plan.yaml").write_text(json.dumps(plan))
    return root / "plan.yaml"


def tp_bytes(tp: int, steps: int, plan_path: Path) -> dict[str, Any]:
    """Builds and distinct batch bytes per step, every rank of DP 2 x TP ``tp`` consuming."""
    from overlord import Loader, load_plan, validate_plan
    from overlord.roles.constructor import DataConstructor

    plan = load_plan(plan_path)
    data = plan.model_dump(mode="json")
    data["world"] = {"dp": 2, "tp": tp}
    plan = validate_plan(data, base_dir=plan.base_dir)
    builds: list[tuple[int, int]] = []
    build = DataConstructor._build

    def counting(self: DataConstructor, step: int, rank: int) -> Any:
        builds.append((step, rank))
        return build(self, step, rank)

    DataConstructor._build = counting  # type: ignore[method-assign]
    try:
        held = []
        with Loader(plan, runtime="inline") as loader:
            clients = [loader.rank_client(g) for g in range(plan.world.size)]
            for _ in range(steps):
                arrays = {id(a): a for c in clients for a in next(c).arrays().values()}
                held.append(sum(a.nbytes for a in arrays.values()))
    finally:
        DataConstructor._build = build  # type: ignore[method-assign]
    # builds per (step, DP rank) built, prefetched steps included: 1 is one fetch per group
    return {"tp": tp, "builds": len(builds) / len(set(builds)), "bytes": float(np.mean(held))}


def main(argv: list[str] | None = None) -> int:
    """Run both parts and print their tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 20)

    print(f"Balance with CP: DP {DP} groups x {RPR} rows, 7B model, per_document, {steps} steps")
    print(f"{'context':>8} {'cp':>3} {'kk/LB_cap':>10} {'none/LB_cap':>12} {'kk speed-up':>12} "
          f"{'padding':>8}")  # fmt: skip
    for cap in (32768, 65536, 131072):
        for cp in (2, 4, 8):
            r = balance(cap, cp, steps, args.seed)
            print(f"{cap // 1024:>7}K {cp:>3} {r['kk']:>10.3f} {r['none']:>12.3f} "
                  f"{r['speedup']:>11.2f}x {100 * r['padding']:>7.3f}%")  # fmt: skip

    print(f"\nBatch bytes against TP: DP 2 x TP t, embedded runtime, {steps} steps")
    print(f"{'tp':>3} {'ranks':>6} {'builds per DP rank':>19} {'bytes/step':>11} {'vs tp 1':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = _corpus(Path(tmp))
        base = None
        for tp in (1, 2, 4, 8):
            r = tp_bytes(tp, steps, plan_path)
            base = base or r["bytes"]
            print(f"{tp:>3} {2 * tp:>6} {r['builds']:>19.2f} {r['bytes']:>11,.0f} "
                  f"{r['bytes'] / base:>7.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
