"""What the Ray runtime costs against the embedded one, on the same plan and the same cores.

Embedded: one process consumes every DP rank's batches (the inline runtime).
Ray: the job's roles are Ray actors, and 2 to 4 trainer processes connect to it
(``overlord.connect``), each consuming its own rank, as under ``torchrun``.

Reported per setting: tokens/s delivered to the trainers (all ranks together),
tokens per CPU-second (the CPU of every process of the run, Ray's own included,
read from /proc over the same timed steps), Ray's calls per step (each process
counts the calls it sends: ``overlord.runtime.base.calls_made``; ``--calls``
lists them by method, with the CPU by process), and the wait per batch a
trainer sees (p50, p99), after a warm-up. Target: Ray at least 0.7 of the
embedded tokens per CPU-second, p99 wait under 10 ms. On Ray each loader has a
hot standby unless ``--shadows 0``; the embedded runtime runs none.

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
from benchmarks._lib.procfs import CpuMeter
from overlord import Loader, load_plan
from overlord.ops.demo import build_corpus
from overlord.plan.budget import token_budget

REPO = Path(__file__).resolve().parents[1]

TRAINER = """
import json, os, sys, time
from pathlib import Path
import overlord
from overlord.roles.api import ConstructorRole
from overlord.runtime.base import calls_made
job, rank, steps, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pace = float(sys.argv[5])  # seconds of simulated training per step (0: consume flat out)
mark = Path(sys.argv[6])  # touched when the timed window starts (the driver reads the CPU)
client = overlord.connect(job, rank=rank, stop_step=steps)
waits, tokens, t0 = [], 0, None
profile = os.environ.get("RAY_OVERHEAD_PROFILE")  # --profile: CPU by function, every thread
if profile:
    import yappi
    yappi.set_clock_type("cpu")
for step in range(steps):
    if step == warm and profile:
        yappi.start()
    if step == warm:
        mark.touch()
    t = time.perf_counter()
    batch = next(client)
    waits.append(time.perf_counter() - t)
    if step == warm:
        t0 = time.perf_counter()
    if step >= warm:
        tokens += batch.num_tokens
    time.sleep(pace)
seconds = time.perf_counter() - t0
if profile:
    yappi.stop()
    yappi.get_func_stats().save(os.path.join(profile, f"trainer-{rank}.prof"), type="pstat")
client.flush()
# the calls of this process and of its constructor's (the same process where it is local)
made = {os.getpid(): calls_made()}
built = client._constructor.call(ConstructorRole.stats).result()
made[built["pid"]] = built["calls"]
print(json.dumps({"waits": waits[warm:], "tokens": tokens, "seconds": seconds, "calls": made}))
"""


def write_plan(
    root: Path,
    dp: int,
    seq: int,
    rows_per_rank: int,
    tokenizer: dict,
    site: str = "actor",
    loader_processes: int | None = None,
    shadows: int | None = None,
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
    if shadows is not None:  # on Ray each loader has a hot standby unless the plan says 0
        for source in plan["sources"]:
            source["shadows"] = shadows
    name = f"plan-dp{dp}-{rows_per_rank}-{tokenizer['kind']}-{site}-{loader_processes}.yaml"
    path = root / name
    path.write_text(yaml.safe_dump(plan))
    return path


def embedded(plan_path: Path, steps: int, warm: int) -> dict:
    plan = load_plan(plan_path)
    waits, tokens = [], 0
    meter = CpuMeter()
    with Loader(plan, runtime="inline") as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(steps):
            if step == warm:
                t0, c0 = time.perf_counter(), meter.total()
            for c in clients:
                t = time.perf_counter()
                b = next(c)
                if step >= warm:
                    waits.append(time.perf_counter() - t)
                    tokens += b.num_tokens
        seconds, cpu = time.perf_counter() - t0, meter.total() - c0
    meter.stop()
    # every call of the embedded runtime stays in this process: none crosses to another
    return {"tokens_per_s": tokens / seconds, "waits": waits, "cpu": cpu, "tokens": tokens,
            "calls_per_step": 0.0, "by_title": {}}  # fmt: skip


def on_ray(plan_path: Path, steps: int, warm: int, pace: float = 0.0) -> dict:
    """Trainer processes on a Ray job of the plan; tokens/s, CPU of every process, calls."""
    import ray

    plan = load_plan(plan_path)
    p = plan.placement
    job = f"bench-{plan.world.dp}-{p.constructors.value}-{p.loader_processes}"
    meter = CpuMeter()
    with tempfile.TemporaryDirectory() as marks, Loader(plan, runtime="ray", job=job) as loader:
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        mark = [Path(marks) / f"warm-{r}" for r in range(plan.world.dp)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", TRAINER, job, str(r), str(steps), str(warm), str(pace),
                 str(mark[r])],  # fmt: skip
                stdout=subprocess.PIPE,
                env=env,
                text=True,
                cwd=REPO,
            )
            for r in range(plan.world.dp)
        ]
        while not all(m.exists() for m in mark) and all(q.poll() is None for q in procs):
            time.sleep(0.005)
        c0, titles0 = meter.total(), meter.by_title()
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        cpu, titles = meter.total() - c0, meter.by_title()
        planner = loader.stats()["calls"]
    meter.stop()
    tokens = sum(o["tokens"] for o in outs)
    seconds = max(o["seconds"] for o in outs)
    # each process's calls once (a local constructor shares its trainer's process)
    made = {int(pid): c for o in outs for pid, c in o["calls"].items()}
    made[planner["pid"]] = planner["by_method"]
    by_method: dict[str, int] = {}
    for calls in made.values():
        for m, n in calls.items():
            by_method[m] = by_method.get(m, 0) + n
    return {
        "tokens_per_s": tokens / seconds,
        "waits": [w for o in outs for w in o["waits"]],
        "cpu": cpu,
        "tokens": tokens,
        "calls_per_step": sum(by_method.values()) / steps,
        "by_method": by_method,
        "by_title": {k: v - titles0.get(k, 0.0) for k, v in titles.items()},
    }


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


SITES = {
    "actor": ("actor", None),
    "trainer": ("trainer", None),
    "trainer-1": ("trainer", 1),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="fewer steps; bytes only unless --tokenizer hf"
    )
    ap.add_argument("--tokenizer", choices=["bytes", "hf", "both"], default="both")
    ap.add_argument("--rows", default="4,16", help="rows of 8192 tokens per rank and step")
    ap.add_argument("--dp", default="2,4", help="DP sizes (one trainer process each on Ray)")
    ap.add_argument(
        "--sites",
        default=",".join(SITES),
        help="Ray placements: actor (constructors as actors), trainer (in the trainer's "
        "process), trainer-1 (and one loader process)",
    )
    ap.add_argument("--no-waits", action="store_true", help="skip the paced-trainer table")
    ap.add_argument("--calls", action="store_true", help="print each Ray run's calls by method")
    ap.add_argument(
        "--shadows",
        type=int,
        help="hot standbys per loader on Ray (default: the plan's default, 1 on Ray; the "
        "embedded runtime runs none)",
    )
    ap.add_argument(
        "--profile", help="folder for each Ray trainer's profile of its timed steps (yappi, CPU)"
    )
    args = ap.parse_args()
    if args.profile:
        os.environ["RAY_OVERHEAD_PROFILE"] = str(Path(args.profile).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_corpus(root / "data")
        tokenizers = [] if args.tokenizer == "hf" else [{"kind": "bytes"}]
        # --quick: bytes only, unless the BPE tokenizer is asked for by name
        if args.tokenizer == "hf" or (args.tokenizer == "both" and not args.quick):
            tokenizers += [t for t in [bpe(root)] if t]
        print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the start\n")
        print(
            "| tokenizer | rows/rank | dp (trainers) | runtime | tokens/s | tokens/CPU-s "
            "| calls/step | p50 wait ms | p99 wait ms | Ray / embedded per CPU-s | wall |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for tok in tokenizers:
            for rows in map(int, args.rows.split(",")):
                for dp in map(int, args.dp.split(",")):
                    path = write_plan(root, dp, 8192, rows, tok)
                    plan = load_plan(path)
                    # loaders read ahead up to token_budget each: warm up past what they hold,
                    # then time twice that, so that production is timed, not buffers draining
                    held = len(plan.sources) * token_budget(plan) / plan.batch.tokens_per_step
                    warm = 5 if args.quick else int(held) + 5
                    steps = warm + (25 if args.quick else int(2 * held) + 10)
                    runs = [("embedded", embedded(path, steps, warm))]
                    for key in args.sites.split(","):
                        site, procs = SITES[key]
                        site_plan = write_plan(root, dp, 8192, rows, tok, site, procs, args.shadows)
                        label = f"ray, constructors: {site}" + (
                            ", 1 loader process" if procs else ""
                        )
                        runs.append((label, on_ray(site_plan, steps, warm)))
                    base = runs[0][1]
                    for name, r in runs:
                        p50, p99 = np.percentile(np.array(r["waits"]) * 1e3, [50, 99])
                        per_cpu = r["tokens"] / r["cpu"]
                        ratio = wall = ""
                        if name != "embedded":
                            ratio = f"{per_cpu / (base['tokens'] / base['cpu']):.2f}"
                            wall = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
                        print(
                            f"| {tok['kind']} | {rows} | {dp} | {name} | {r['tokens_per_s']:,.0f} "
                            f"| {per_cpu:,.0f} | {r['calls_per_step']:.1f} | {p50:.2f} "
                            f"| {p99:.2f} | {ratio} | {wall} |",
                            flush=True,
                        )
                        if args.calls and name != "embedded":
                            cpu = {k: round(v, 2) for k, v in r["by_title"].items() if v >= 0.01}
                            print(f"  calls {r['by_method']}\n  CPU s {cpu}", flush=True)
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
        if args.no_waits:
            return 0
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
