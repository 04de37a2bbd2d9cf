"""What the Ray runtime costs against the embedded one, on the same plan and the same cores.

Embedded: one process consumes every DP rank's batches (the inline runtime).
Ray: the job's roles are Ray actors, and 2 to 4 trainer processes connect to it
(``overlord.connect``), each consuming its own rank, as under ``torchrun``.

Reported per setting: tokens/s delivered to the trainers (all ranks together),
and the wait per batch a trainer sees (p50, p99), after a warm-up. Target: Ray
at least 0.7 of the embedded tokens/s on a 2-core machine, p99 wait under 10 ms.

Settings: the bytes tokenizer (almost free: the embedded runtime then delivers
tens of millions of tokens/s and every Ray call shows) and a byte-level BPE
trained on the corpus (what a real run pays per token), each at 4 and 16 rows
of 8192 tokens per rank and step.

Run (Ray must stay on loopback):  tools/loopback .venv/bin/python -m benchmarks.ray_overhead
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from benchmarks._lib.corpus import train_bpe
from overlord import Loader, load_plan
from overlord.ops.demo import build_corpus
from overlord.plan.budget import token_budget

TRAINER = """
import json, sys, time
import overlord
job, rank, steps, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pace = float(sys.argv[5])  # seconds of simulated training per step (0: consume flat out)
client = overlord.connect(job, rank=rank, stop_step=steps)
waits, tokens, t0 = [], 0, None
for step in range(steps):
    t = time.perf_counter()
    batch = next(client)
    waits.append(time.perf_counter() - t)
    if step == warm:
        t0 = time.perf_counter()
    if step >= warm:
        tokens += batch.num_tokens
    time.sleep(pace)
print(json.dumps({"waits": waits[warm:], "tokens": tokens, "seconds": time.perf_counter() - t0}))
"""


def write_plan(
    root: Path,
    dp: int,
    seq: int,
    rows_per_rank: int,
    tokenizer: dict,
    site: str = "actor",
    loader_processes: int | None = None,
) -> Path:
    plan = {
        "seed": 3,
        "sources": [
            {"name": "stdlib", "path": "data/stdlib/*", "format": "jsonl"},
            {"name": "tests", "path": "data/tests/*", "format": "jsonl"},
            {"name": "docs", "path": "data/docs/*", "format": "parquet", "text_field": "content"},
            {"name": "licenses", "path": "data/licenses/*", "format": "jsonl"},
        ],
        "mixture": {
            "schedule": [
                {"step": 0, "weights": {"stdlib": 4, "tests": 3, "docs": 2, "licenses": 1}}
            ]
        },
        "tokenizer": tokenizer,
        "batch": {"tokens_per_step": dp * rows_per_rank * seq, "max_seq_len": seq},
        "world": {"dp": dp},
        "placement": {"constructors": site, "loader_processes": loader_processes},
        "balance": {
            "method": "kk",
            "cost": {"model": {"params": 7e9, "layers": 32, "hidden": 4096}},
        },
    }
    name = f"plan-dp{dp}-{rows_per_rank}-{tokenizer['kind']}-{site}-{loader_processes}.yaml"
    path = root / name
    path.write_text(yaml.safe_dump(plan))
    return path


def embedded(plan_path: Path, steps: int, warm: int) -> dict:
    plan = load_plan(plan_path)
    waits, tokens = [], 0
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(steps):
            if step == warm:
                t0 = time.perf_counter()
            for c in clients:
                t = time.perf_counter()
                b = next(c)
                if step >= warm:
                    waits.append(time.perf_counter() - t)
                    tokens += b.num_tokens
        seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "waits": waits}


def on_ray(plan_path: Path, steps: int, warm: int, pace: float = 0.0) -> dict:
    import ray

    plan = load_plan(plan_path)
    p = plan.placement
    job = f"bench-{plan.world.dp}-{p.constructors.value}-{p.loader_processes}"
    with Loader(plan, runtime="ray", job=job):
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", TRAINER, job, str(r), str(steps), str(warm), str(pace)],
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for r in range(plan.world.dp)
        ]
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    tokens = sum(o["tokens"] for o in outs)
    seconds = max(o["seconds"] for o in outs)
    return {"tokens_per_s": tokens / seconds, "waits": [w for o in outs for w in o["waits"]]}


def bpe(root: Path) -> dict | None:
    """A BPE tokenizer trained on the corpus, as benchmarks/throughput.py trains it."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    shards = {p.name: sorted(p.iterdir()) for p in (root / "data").iterdir() if p.is_dir()}
    jsonl = {k: [f for f in v if ".jsonl" in f.name] for k, v in shards.items()}
    path = train_bpe({k: v for k, v in jsonl.items() if v}, root / "bpe.json", 8000)
    return {"kind": "hf", "path": str(path)} if path else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, bytes tokenizer only")
    ap.add_argument("--tokenizer", choices=["bytes", "hf", "both"], default="both")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_corpus(root / "data")
        tokenizers = [] if args.tokenizer == "hf" else [{"kind": "bytes"}]
        if args.tokenizer != "bytes" and not args.quick:
            tokenizers += [t for t in [bpe(root)] if t]
        print(f"{os.cpu_count()} CPU cores\n")
        print(
            "| tokenizer | rows/rank | dp (trainers) | runtime | tokens/s | p50 wait ms "
            "| p99 wait ms | Ray / embedded |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for tok in tokenizers:
            for rows in (4, 16):
                for dp in (2, 4):
                    path = write_plan(root, dp, 8192, rows, tok)
                    plan = load_plan(path)
                    # loaders read ahead up to token_budget each: warm up past what they hold,
                    # then time twice that, so that production is timed, not buffers draining
                    held = len(plan.sources) * token_budget(plan) / plan.batch.tokens_per_step
                    warm = 5 if args.quick else int(held) + 5
                    steps = warm + (25 if args.quick else int(2 * held) + 10)
                    runs = [("embedded", embedded(path, steps, warm))]
                    for site, procs in (("actor", None), ("trainer", None), ("trainer", 1)):
                        site_plan = write_plan(root, dp, 8192, rows, tok, site, procs)
                        label = f"ray, constructors: {site}" + (
                            ", 1 loader process" if procs else ""
                        )
                        runs.append((label, on_ray(site_plan, steps, warm)))
                    base = runs[0][1]["tokens_per_s"]
                    for name, r in runs:
                        p50, p99 = np.percentile(np.array(r["waits"]) * 1e3, [50, 99])
                        ratio = f"{r['tokens_per_s'] / base:.2f}" if name != "embedded" else ""
                        print(
                            f"| {tok['kind']} | {rows} | {dp} | {name} | {r['tokens_per_s']:,.0f} "
                            f"| {p50:.2f} | {p99:.2f} | {ratio} |",
                            flush=True,
                        )
        # the wait a trainer sees when it trains between batches, as trainers do: each
        # trainer "trains" for twice the time a batch took to arrive when consumed flat out
        print("\nWait per batch for trainers that train between batches (bytes, 16 rows/rank):\n")
        print("| dp | constructors | simulated step ms | p50 wait ms | p99 wait ms | max ms |")
        print("|---|---|---|---|---|---|")
        for dp in (2, 4):
            for site in ("actor", "trainer"):
                path = write_plan(root, dp, 8192, 16, {"kind": "bytes"}, site)
                plan = load_plan(path)
                held = len(plan.sources) * token_budget(plan) / plan.batch.tokens_per_step
                warm = int(held) + 5
                flat = on_ray(path, warm + 20, warm)
                pace = 2 * plan.batch.tokens_per_step / flat["tokens_per_s"]
                r = on_ray(path, warm + 40, warm, pace)
                p50, p99, top = np.percentile(np.array(r["waits"]) * 1e3, [50, 99, 100])
                print(f"| {dp} | {site} | {pace * 1e3:.0f} | {p50:.2f} | {p99:.2f} | {top:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
