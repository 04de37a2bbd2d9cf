"""Autoscaling: a fixed equal split of loaders against the autoscaler, same CPU budget.

Two sources. ``clean`` is plain JSONL text. ``web`` is scraped text with HTML
entities, compatibility characters and ragged whitespace, so its loaders run a
real extra transform before tokenizing: ``heavy_clean`` below, which is
``overlord.sources.transforms:clean_text`` (entities decoded, NFKC,
whitespace collapsed) done ``--rounds`` times over, to stand for the decoding
or parsing that makes a real source expensive (a bytes tokenizer alone costs a
few nanoseconds a token, so a source must cost about a microsecond a token to
be the bottleneck of a training step). Before the runs the script measures
what a token of each costs with ``min(cpus, cores)`` shards read at once (a
core shared with a hyper-thread sibling makes a token dearer than on an idle
machine) and prints the ratio.

A curriculum moves ``web`` from 10% of the tokens at step 0 to 60% at the
middle of the run (then holds). The trainer is simulated: each step it takes
every rank's batch, then "trains" for a fixed time, chosen so that at 60% the
``web`` source needs ``--need`` of the budget's cores (0.75 by default: the
equal split's half falls short by a third, the case an autoscaler is for).

- *fixed*: each source has cpus/2 loaders of one reader thread (the equal
  split of ``cpus`` workers), no autoscaler;
- *autoscaled*: ``autoscale.cpus`` is the same budget (cores the loaders are
  expected to burn); every source starts with the same equal split and the
  autoscaler re-sizes them as it measures.

On Ray (``--runtime ray``, the default) every loader is a process, so
loaders are cores; on the embedded runtime they are threads of one process
and Python's GIL serializes the transform. No shadows (they would double the
reading). Printed: the trainer's time waiting for data as a share of the run
once warm (after the first 10% of steps), tokens/s per core of the budget,
CPU seconds of every process of the run (read from ``/proc``) and tokens per
CPU-second, and the autoscaler's decisions. CPU is read once the loaders are
idle after the last step: a source that kept up with the trainer holds a full
read-ahead at the end, one that starved it holds none, so each run is charged
its tokens plus a full read-ahead. A third run fixes the autoscaler's last
sizes from the first step: what scaling itself costs, against what reading
with more loaders costs. The comparison needs a machine with more cores than the budget
(the planner, constructors and Ray's own processes need some too): with
fewer, both runs share the same cores. On 2 cores, ``--cpus 2 --rounds 48``
makes ``web`` dear enough for the loaders to be most of the work.
Targets: autoscaled waits under 5% once warm, with no more CPU than
the fixed split.

    tools/loopback .venv/bin/python -m benchmarks.autoscale --cpus 8    # a few minutes
    tools/loopback .venv/bin/python -m benchmarks.autoscale --cpus 2 --rounds 48 --quick
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from benchmarks._lib.corpus import write_word_docs
from benchmarks._lib.procfs import CpuMeter
from overlord import Loader, load_plan
from overlord.plan.spec import Plan, validate_plan
from overlord.sources.catalog import list_files
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import make_tokenizer
from overlord.sources.transforms import clean_text

# how many times ``heavy_clean`` cleans a record; set by --rounds through the environment,
# which the loaders' processes inherit
ROUNDS = int(os.environ.get("OVERLORD_BENCH_ROUNDS", "8"))


def heavy_clean(text: str) -> str:
    """``clean_text``, ``ROUNDS`` times: a CPU-bound transform of a known cost."""
    for _ in range(ROUNDS - 1):
        clean_text(text)
    return clean_text(text)


CLEAN = ["data", "loader", "shard", "token", "planner", "rank", "step", "mixture", "source"]
# scraped text: entities, compatibility forms (ligatures, full-width and circled letters),
# non-breaking spaces
DIRTY = [
    *CLEAN[:3],
    "&eacute;&egrave;&ecirc;",
    "&#233;&#x00e8;",
    "\uff21\uff22\uff23\uff24",
    "\ufb01\ufb02",
    "&nbsp;&nbsp;",
    "\u2460\u2461",
    "&lt;div&gt;",
]


def write_corpus(root: Path, files: int, docs: int) -> Path:
    rng = random.Random(5)
    for name, words in (("clean", CLEAN), ("web", DIRTY)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for f in range(files):
            path = root / name / f"part-{f:03d}.jsonl"
            write_word_docs(path, rng, words, docs, lambda r: r.randint(100, 900))
    plan = {
        "seed": 9,
        "sources": [
            {"name": "clean", "path": "clean/*.jsonl", "format": "jsonl"},
            {
                "name": "web",
                "path": "web/*.jsonl",
                "format": "jsonl",
                "transform": "benchmarks.autoscale:heavy_clean",
            },
        ],
        "batch": {"tokens_per_step": 64 * 4096, "max_seq_len": 4096, "prefetch_steps": 2},
        "world": {"dp": 2},
        "loading": {"timeout_s": 120},
    }
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def cost_per_token(plan: Plan, source: str, pos: int = 0) -> float:
    """CPU seconds per token of shard ``pos`` of ``source`` (read, transform, tokenize)."""
    spec = next(s for s in plan.sources if s.name == source)
    patterns = [spec.path] if isinstance(spec.path, str) else list(spec.path)
    files = list_files(spec.name, patterns, str(plan.base_dir))  # epoch 0's files, as a job's
    tok = make_tokenizer(plan.tokenizer, str(plan.base_dir))
    load_shard_items(plan, spec, files, tok, 0, pos)  # once untimed: lazy imports, caches
    c0 = time.process_time()
    items = load_shard_items(plan, spec, files, tok, 0, pos)
    return (time.process_time() - c0) / max(1, int(items.length.sum()))


def cost_under_load(plan: Plan, source: str, processes: int) -> float:
    """``cost_per_token`` with ``processes`` shards read at once, one per process (the mean).

    A core shared with a hyper-thread sibling, or a memory bus shared with
    other readers, makes a token cost more CPU time than on an idle machine;
    the training step is sized on what a token costs when the budget's
    loaders all run.
    """
    ctx = multiprocessing.get_context("fork")  # before Ray starts: nothing to inherit badly
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        jobs = [pool.submit(cost_per_token, plan, source, pos) for pos in range(processes)]
        costs = [job.result() for job in jobs]
    return sum(costs) / len(costs)


def variant(
    plan: Plan, steps: int, cpus: int, autoscale: bool, sizes: dict[str, int] | None = None
) -> Plan:
    """The benchmark's plan: the equal split, or ``sizes`` loaders per source; autoscaled or not."""
    data = plan.model_dump(mode="json")
    half = max(1, cpus // 2)
    for s in data["sources"]:
        s["loaders"], s["shadows"] = (sizes or {}).get(s["name"], half), 0
    data["mixture"] = {
        "schedule": [
            {"step": 0, "weights": {"clean": 0.9, "web": 0.1}},
            {"step": steps // 2, "weights": {"clean": 0.4, "web": 0.6}},
        ]
    }
    if autoscale:
        data["autoscale"] = {
            "cpus": cpus,
            "every": 5,
            "horizon_steps": max(10, steps // 6),
            "cooldown_steps": 10,
            # the transform is pure Python: a second thread in a loader adds nothing (GIL)
            "thread_efficiency": 0.0,
        }
    return validate_plan(data, base_dir=plan.base_dir)


def run(plan: Plan, steps: int, step_time: float, runtime: str) -> dict[str, Any]:
    waits = []
    tokens = 0
    meter = CpuMeter()  # from before the job starts: its start-up is part of what it costs
    loader = Loader(plan, runtime=runtime)
    try:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        w0 = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            batches = [next(c) for c in clients]
            waits.append(time.perf_counter() - t0)
            tokens += sum(b.num_tokens for b in batches)
            time.sleep(step_time)  # the training step
        wall = time.perf_counter() - w0
        settle_s = meter.settle()
        cpu = meter.stop()
        stats = loader.stats()
    finally:
        loader.close()
    warm = steps // 10
    return {
        "wait_share": sum(waits[warm:]) / (sum(waits[warm:]) + step_time * (steps - warm)),
        "wall_s": wall,
        "settle_s": settle_s,
        "cpu_s": cpu,
        "tokens": tokens,
        "tokens_per_cpu_s": tokens / cpu,
        "cpu_by_process": meter.by_title(),
        "scaling": stats["scaling"],
        "events": [e for e in stats["events"] if e["event"] == "repartition"],
        # what a web token cost the run's last web loaders (moving average of thread CPU)
        "web_cost": [s["cpu_s_per_token"] for s in stats["loaders"] if s["source"] == "web"],
    }


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def main() -> int:
    global ROUNDS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cpus", type=int, default=4, help="the CPU budget (fixed split: cpus/2 loaders a source)"
    )
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--files", type=int, default=40)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--runtime", default="ray", choices=("ray", "inline"))
    ap.add_argument(
        "--rounds", type=int, default=ROUNDS, help="cleanings per web record (its cost per token)"
    )
    ap.add_argument(
        "--need", type=float, default=0.75, help="web's share of the budget at its peak"
    )
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.files, a.docs = 50, 16, 120
    os.environ["OVERLORD_BENCH_ROUNDS"] = str(a.rounds)  # the loaders' processes inherit it
    ROUNDS = a.rounds
    root = Path(tempfile.mkdtemp(prefix="overlord-autoscale-"))
    base = load_plan(write_corpus(root, a.files, a.docs))
    busy = min(a.cpus, os.cpu_count() or 1, a.files)
    cheap, dear = cost_under_load(base, "clean", busy), cost_under_load(base, "web", busy)
    T = base.batch.tokens_per_step
    # at 60%, web needs a.need of the budget's cores; the equal split gives it half
    step_time = 0.6 * T * dear / (a.need * a.cpus)
    print(
        f"cost per token: clean {cheap * 1e9:.0f} ns, web {dear * 1e9:.0f} ns "
        f"({dear / cheap:.1f}x); budget {a.cpus} CPUs; {a.steps} steps of {T:,} "
        f"tokens; training step {step_time * 1e3:.0f} ms (web needs {a.need:.0%} of the "
        "budget at 60%)\n"
    )
    rows = []
    for label, auto in (("fixed equal split", False), ("autoscaled", True)):
        r = run(variant(base, a.steps, a.cpus, auto), a.steps, step_time, a.runtime)
        rows.append((label, r))
    # what scaling itself costs: the autoscaler's last sizes, fixed from the first step
    final = {name: s["loaders"] for name, s in rows[1][1]["scaling"][-1]["sources"].items()}
    label = (
        "fixed at the autoscaler's last sizes ("
        + ", ".join(f"{k} {v}" for k, v in final.items())
        + ")"
    )
    r = run(variant(base, a.steps, a.cpus, False, final), a.steps, step_time, a.runtime)
    rows.append((label, r))
    print(
        "| run | wait share once warm | wall s | tokens/s per budget core | CPU s | "
        "tokens per CPU-s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in rows:
        print(
            f"| {label} | {100 * r['wait_share']:.1f}% | {r['wall_s']:.1f} | "
            f"{r['tokens'] / r['wall_s'] / a.cpus:,.0f} | {r['cpu_s']:.1f} | "
            f"{r['tokens_per_cpu_s']:,.0f} |"
        )
    for label, r in rows:
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(r["cpu_by_process"].items())[:6])
        cost = ", ".join(f"{c * 1e9:.0f}" for c in r["web_cost"])
        print(
            f"  CPU s by process, {label} (loaders idle {r['settle_s']:.0f} s after the last "
            f"step): {top}; a web token cost its last loaders {cost} ns"
        )
    auto = rows[1][1]
    print("\nautoscaler decisions that changed a size:")
    last: dict[str, tuple[int, int]] = {}
    for d in auto["scaling"]:
        for name, s in d["sources"].items():
            size = (s["loaders"], s["threads"])
            if last.get(name) != size:
                last[name] = size
                print(
                    f"  step {d['step']:>4} {name}: {size[0]} loader(s) x {size[1]} thread(s), "
                    f"demand {s['demand_tokens_per_s']:,.0f}, capacity "
                    f"{s['capacity_tokens_per_s']:,.0f} tokens/s"
                )
    waited, cpu = auto["wait_share"], auto["cpu_s"] / rows[0][1]["cpu_s"]
    print(f"\nautoscaled waiting once warm: {waited:.1%} (target < 5%): " + _verdict(waited < 0.05))
    print(f"autoscaled CPU: {cpu:.3f}x the fixed split's (target <= 1x): " + _verdict(cpu <= 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
