"""Dynamic CP degree per document (``cp: dynamic``, ByteScale's HDP) against static CP = C.

1. **Cost model, long-tailed mix up to 128K** (simulated). Steps are selected
   by overlord's ``select_step`` from the four long-tailed synthetic sources
   of ``_lib/synthetic.py`` (web, code, papers, books; medians 600 to 60000
   tokens), split at ``max_seq_len`` = 128K. DP 4 groups of ``C`` ranks,
   ``RPR`` rows of 128K per group. Both sides are balanced across DP groups
   by ``kk`` with their own CP-aware cost (``overlord.plan.cp.cp_cost``).

   - *static CP = C* (``per_document``): every document is cut over all
     ``C`` ranks of its group; each rank computes ``cost(L') / C`` of each.
   - *dynamic*: each document gets its degree ``d`` (``cp_degrees``), is
     padded (``dynamic_lengths``) and placed on an aligned sub-group
     (``place_documents``, what the DataConstructor runs); each of its ``d``
     ranks computes ``cost(L') / d``.

   Compute: the 7B cost model (``alpha = 6N``, ``beta = 6 * layers *
   hidden``) in FLOPs, run at ``FLOPS`` = 400 TFLOP/s per GPU. Communication:
   a rank exchanges the K and V of the other ranks of each of its documents'
   groups (ring or all-gather attention): ``L' * (d - 1) / d`` tokens per
   document, ``KV_BYTES`` = 2 * hidden * layers * 2 bytes (bf16) per token,
   at a link bandwidth per GPU of 200 GB/s (NVLink, a CP group in one node)
   or 25 GB/s (200 Gb/s InfiniBand), not overlapped with compute (the
   pessimistic case; overlap shrinks the communication's part). A step takes
   as long as its slowest rank, over every group: ``max_r (compute_r /
   FLOPS + bytes_r / bandwidth)``. Reported: static over dynamic predicted
   step time (the speed-up), the most loaded rank's attention FLOPs (the
   ``beta`` term), total KV bytes exchanged, the share of documents of
   degree 1, and the compute imbalance of dynamic placement within groups
   (most loaded rank over its group's mean).
2. **On the example's data** (embedded runtime, measured slices). The plan of
   ``examples/train_tiny_gpt.py`` (its corpus of standard-library
   paragraphs, 8 rows of 256 tokens a step, DP 1) served with ``cp: 4``
   (``per_document``) and with ``cp: dynamic, cp_max: 4, tokens_per_cp_rank:
   32``, 10 steps. From each rank's actual batch: attention pairs (each real
   token attends ``position + 1`` keys of its document) and KV tokens
   received (each real document token on a rank, times ``d - 1`` of its
   segment's ``cp_groups`` degree; ``cp - 1`` for static). Reported: the
   largest rank's pairs and tokens, and the totals, dynamic against static.

Run from the repository root::

    .venv/bin/python -m benchmarks.dynamic_cp            # about a minute
    .venv/bin/python -m benchmarks.dynamic_cp --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._lib.synthetic import model_7b, next_step, weights, windows
from overlord.plan import balance as bal
from overlord.plan.cost import CostModel
from overlord.plan.cp import cp_cost, cp_degrees, dynamic_lengths, padded_lengths, place_documents
from overlord.plan.select import MixState
from overlord.plan.spec import BalanceMethod
from overlord.world import CPLayout

CAP, DP, RPR, LOOKAHEAD = 131072, 4, 2, 64
FLOPS = 400e12  # per GPU, sustained
KV_BYTES = 2 * 4096 * 32 * 2  # K and V, hidden 4096, 32 layers, bf16: per token
LINKS = {"NVLink 200 GB/s": 200e9, "IB 25 GB/s": 25e9}


def static_ranks(tok: np.ndarray, cp: int, model: CostModel) -> tuple[np.ndarray, ...]:
    """Per rank of one group, static CP: compute FLOPs, attention FLOPs, KV tokens received."""
    padded = padded_lengths(tok, cp, CPLayout.PER_DOCUMENT).astype(np.float64)
    ones = np.ones(cp)
    return (
        ones * model.cost(padded).sum() / cp,
        ones * (model.beta * padded**2).sum() / cp,
        ones * (padded * (cp - 1) / cp).sum(),
    )


def dynamic_ranks(
    tok: np.ndarray, cp: int, per_rank: int, model: CostModel
) -> tuple[np.ndarray, ...]:
    """Per rank of one group, dynamic CP (placed as the DataConstructor places)."""
    d = cp_degrees(tok, cp, per_rank)
    padded = dynamic_lengths(tok, d).astype(np.float64)
    rank_cost = model.cost(padded) / d
    first = place_documents(rank_cost, d, cp)
    compute, attention, kv = np.zeros(cp), np.zeros(cp), np.zeros(cp)
    for f, dd, c, a, k in zip(
        first, d, rank_cost, model.beta * padded**2 / d, padded * (d - 1) / d, strict=True
    ):
        compute[f : f + dd] += c
        attention[f : f + dd] += a
        kv[f : f + dd] += k
    return compute, attention, kv


def simulate(cp: int, per_rank: int, steps: int, seed: int) -> dict[str, Any]:
    """Both sides over ``steps`` steps of the synthetic mix; means of per-step figures."""
    model = model_7b()
    wins, w = windows(CAP, seed), weights()
    mix = MixState.zeros(len(wins))
    out: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for _ in range(steps):
        tok, ref_row, _ = next_step(wins, w, mix, DP * RPR, CAP, LOOKAHEAD, model)
        add("degree1", float((cp_degrees(tok, cp, per_rank) == 1).mean()))
        for side in ("static", "dynamic"):
            per = None if side == "static" else per_rank
            layout = CPLayout.PER_DOCUMENT
            cost = cp_cost(model, tok, None, cp, layout, per)
            group = bal.assign(tok, cost, ref_row, DP, RPR, CAP, BalanceMethod.KK) // RPR
            ranks = [
                static_ranks(tok[group == g], cp, model)
                if side == "static"
                else dynamic_ranks(tok[group == g], cp, per_rank, model)
                for g in range(DP)
            ]
            compute = np.concatenate([r[0] for r in ranks])
            attention = np.concatenate([r[1] for r in ranks])
            kv = np.concatenate([r[2] for r in ranks])
            for link, bw in LINKS.items():
                add(f"{side} {link}", float((compute / FLOPS + kv * KV_BYTES / bw).max()))
            add(f"{side} compute", float(compute.max() / FLOPS))
            add(f"{side} attention", float(attention.max()))
            add(f"{side} kv", float(kv.sum() * KV_BYTES))
            imbalance = max(r[0].max() / r[0].mean() for r in ranks)
            add(f"{side} imbalance", float(imbalance))
    return {k: float(np.mean(v)) for k, v in out.items()}


def example_volumes(steps: int, cp: int = 4, per_rank: int = 32) -> dict[str, dict[str, float]]:
    """Attention pairs and KV tokens per rank from the example plan's real slices."""
    import importlib.util

    from overlord import Loader, load_plan, validate_plan

    here = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", here)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan = load_plan(example.write_corpus(Path(tmp) / "data"))
        for side, world in (
            ("static", {"dp": 1, "cp": cp}),
            ("dynamic", {"dp": 1, "cp": "dynamic", "cp_max": cp, "tokens_per_cp_rank": per_rank}),
        ):
            data = plan.model_dump(mode="json")
            data["world"] = world
            data["batch"]["cp_layout"] = "per_document" if side == "static" else None
            p = validate_plan(data, base_dir=plan.base_dir)
            pairs, kv = [], []
            with Loader(p, runtime="inline") as loader:
                clients = [loader.rank_client(g) for g in range(p.world.size)]
                for _ in range(steps):
                    batches = [next(c) for c in clients]
                    pairs.append([rank_pairs(b) for b in batches])
                    kv.append([rank_kv(b) for b in batches])
            pr, kr = np.array(pairs, dtype=np.float64), np.array(kv, dtype=np.float64)
            out[side] = {
                "max pairs": float(pr.max(axis=1).mean()),
                "total pairs": float(pr.sum(axis=1).mean()),
                "max kv": float(kr.max(axis=1).mean()),
                "total kv": float(kr.sum(axis=1).mean()),
            }
    return out


def _real_docs(b: Any) -> np.ndarray:
    return ((b.global_positions >= 0) & (b.segment_ids != 0)).reshape(-1)


def rank_pairs(b: Any) -> int:
    """Query-key pairs of a rank's real document tokens: ``position + 1`` each (causal)."""
    return int((b.position_ids.reshape(-1)[_real_docs(b)] + 1).sum())


def rank_kv(b: Any) -> int:
    """KV tokens a rank receives: each real document token times the other ranks of its group."""
    if b.cp_groups is None:
        return int(_real_docs(b).sum()) * (b.cp_size - 1)
    seg_len = np.diff(b.cu_seqlens)
    degree = np.repeat(b.cp_groups[:, 1], seg_len)
    return int(((degree - 1) * _real_docs(b)).sum())


def main(argv: list[str] | None = None) -> int:
    """Run both parts and print their tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 20)

    print(f"Dynamic vs static CP = C: 128K rows, DP {DP} groups x {RPR} rows, 7B, kk, {steps} "
          "steps; step time = slowest rank's compute at 400 TFLOP/s + its KV exchange")  # fmt: skip
    links = list(LINKS)
    print(f"{'C':>2} {'T':>6} {'deg 1':>6} {'imbal':>6} {'compute s':>10} "
          + " ".join(f"{'speed-up ' + k.split()[0]:>16}" for k in links)
          + f" {'max attn':>9} {'KV bytes':>9}")  # fmt: skip
    for cp in (4, 8):
        for per_rank in (4096, 16384, 32768):
            r = simulate(cp, per_rank, steps, args.seed)
            ups = [r[f"static {k}"] / r[f"dynamic {k}"] for k in links]
            print(f"{cp:>2} {per_rank // 1024:>5}K {100 * r['degree1']:>5.1f}% "
                  f"{r['dynamic imbalance']:>6.3f} "
                  f"{r['dynamic compute'] / r['static compute']:>9.3f}x "
                  + " ".join(f"{u:>15.2f}x" for u in ups)
                  + f" {r['dynamic attention'] / r['static attention']:>8.2f}x"
                  f" {r['dynamic kv'] / r['static kv']:>8.3f}x")  # fmt: skip
    print(
        "(deg 1: documents whole on one rank; imbal: dynamic's most loaded rank over its "
        "group's mean; compute s, max attn, KV bytes: dynamic over static)"
    )

    for per_rank in (32, 64):
        print(f"\nOn the example's data: examples/tiny_plan.yaml, DP 1 x C 4, static CP 4 "
              f"(per_document) vs dynamic T {per_rank}, {steps} steps")  # fmt: skip
        ex = example_volumes(steps, 4, per_rank)
        print(f"{'':>8} {'max pairs':>10} {'total pairs':>12} {'max KV tok':>11} "
              f"{'total KV tok':>13}")  # fmt: skip
        for side in ("static", "dynamic"):
            e = ex[side]
            print(f"{side:>8} {e['max pairs']:>10,.0f} {e['total pairs']:>12,.0f} "
                  f"{e['max kv']:>11,.0f} {e['total kv']:>13,.0f}")  # fmt: skip
        a, b = ex["dynamic"], ex["static"]
        print(f"{'dyn/stat':>8} " + " ".join(
            f"{a[k] / b[k]:>{w - 1}.2f}x"
            for k, w in (("max pairs", 10), ("total pairs", 12), ("max kv", 11), ("total kv", 13))
        ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
