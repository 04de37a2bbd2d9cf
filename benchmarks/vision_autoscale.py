"""Autoscaling an image source beside text sources, under a curriculum that raises its share.

The autoscaler's figure for images (the autoscaling benchmark, ``benchmarks/autoscale.py``,
with an image source in place of a transform that stands for one). Three
sources: ``books`` and ``web`` are plain JSONL text; ``pictures`` is a
WebDataset of generated JPEG/PNG/WebP pictures (200 to 700 px) with captions,
whose loaders decode, resize and cut every image into patches. Before the
runs the script measures what a token of each costs on one thread
(``load_shard_items``: read, decode, tokenize, fuse) and prints the ratio.

A linear curriculum moves ``pictures`` from 10% of the tokens at step 0 to
60% at the middle of the run (then holds), ``books`` and ``web`` sharing the
rest. The trainer is simulated: each step it takes every rank's batch, then
"trains" for a fixed time, chosen so that at 60% ``pictures`` needs ``--need``
of the budget's cores (0.75 of 2 by default: one reader thread, a core, falls
short by a third at the peak; the DataConstructor's gathering and
normalizing of the pixels, which no loader pays, took about half as much
again in a profile, so the peak needs more than 2 cores: give the run a
machine with cores to spare). One DP rank.

- *fixed*: every source gets one loader of one reader thread (each source
  its own worker, the usual split), no autoscaler;
- *autoscaled*: the same start, with ``autoscale.cpus`` the budget.

The embedded runtime by default (loaders are threads of one process: Pillow
releases the GIL while it decodes and resizes, so a second reader thread of
``pictures`` adds most of a core); ``--runtime ray`` gives every loader its
process (run it under ``tools/loopback``). The run is cut into phases
(quarters); for each, printed: the mean image share, what the autoscaler gave
each source (loaders x threads at the phase's end), what a token of each cost
its loaders (their moving average of thread CPU time per token), and, for both
runs, the trainer's time waiting for data as a share of the phase and tokens/s.

    .venv/bin/python -m benchmarks.vision_autoscale --quick              # one run of each
    .venv/bin/python -m benchmarks.vision_autoscale --quick --repeat 3   # medians (docs)
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._lib.corpus import write_word_docs
from benchmarks._lib.procfs import CpuMeter
from overlord import Loader
from overlord.ops.vision_data import caption, draw, encode, write_tar
from overlord.plan.spec import Plan, validate_plan
from overlord.sources.catalog import list_files
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import make_tokenizer

IMAGES, TEXTS = "pictures", ("books", "web")
WORDS = ["data", "loader", "shard", "token", "planner", "rank", "step", "mixture", "image"]
PHASES = 4


def write_corpus(root: Path, tars: int, per_tar: int, files: int, docs: int) -> None:
    """``pictures``: ``tars`` WebDataset shards; ``books``, ``web``: ``files`` JSONL each."""
    rng = np.random.default_rng(3)
    fmts = ("jpg", "jpg", "jpg", "png", "webp")  # mostly JPEG, as web image-text data is
    (root / IMAGES).mkdir(parents=True)
    for t in range(tars):
        samples = []
        for i in range(per_tar):
            h, w = (int(v) for v in rng.integers(200, 700, size=2))
            fmt = fmts[i % len(fmts)]
            text = caption(t * per_tar + i).encode()
            samples.append((f"s{t:03d}-{i:05d}", {fmt: encode(draw(rng, h, w), fmt), "txt": text}))
        write_tar(root / IMAGES / f"shard-{t:03d}.tar", samples)
    words = random.Random(5)
    for name in TEXTS:
        (root / name).mkdir(parents=True)
        for f in range(files):
            path = root / name / f"part-{f:03d}.jsonl"
            write_word_docs(path, words, WORDS, docs, lambda r: r.randint(100, 900))


def base_plan(root: Path, tokens_per_step: int) -> Plan:
    sources: list[dict[str, Any]] = [
        {"name": IMAGES, "path": f"{IMAGES}/*.tar", "format": "webdataset", "text_field": "txt"}
    ] + [{"name": n, "path": f"{n}/*.jsonl", "format": "jsonl"} for n in TEXTS]
    data = {
        "seed": 9,
        "sources": sources,
        "batch": {"tokens_per_step": tokens_per_step, "max_seq_len": 4096, "prefetch_steps": 2},
        # one rank: a trainer thread that takes two ranks' batches in turn would count the
        # first one's wait in the second one's step time, the autoscaler's measure of demand
        "world": {"dp": 1},
        "vision": {},
        "loading": {"timeout_s": 120},
    }
    return validate_plan(data, base_dir=root)


def variant(plan: Plan, steps: int, cpus: float, autoscale: bool) -> Plan:
    """One loader of one thread per source, the curriculum, and the autoscaler or not."""
    data = plan.model_dump(mode="json")
    for s in data["sources"]:
        s["loaders"], s["shadows"] = 1, 0
    rest = {n: 0.45 for n in TEXTS}
    data["mixture"] = {
        "interpolation": "linear",
        "schedule": [
            {"step": 0, "weights": {IMAGES: 0.1, **rest}},
            {"step": steps // 2, "weights": {IMAGES: 0.6, **{n: 0.2 for n in TEXTS}}},
        ],
    }
    if autoscale:
        data["autoscale"] = {
            "cpus": cpus,
            "every": 5,
            "horizon_steps": max(10, steps // 6),
            "cooldown_steps": 10,
        }
    return validate_plan(data, base_dir=plan.base_dir)


def cost_per_token(plan: Plan, name: str) -> float:
    """CPU seconds per token of ``name``'s first shard on one thread (read, decode, tokenize)."""
    spec = next(s for s in plan.sources if s.name == name)
    assert isinstance(spec.path, str)
    files = list_files(spec.name, [spec.path], str(plan.base_dir))
    tok = make_tokenizer(plan.tokenizer, str(plan.base_dir))
    load_shard_items(plan, spec, files, tok, 0, 0)  # once untimed: lazy imports, caches
    c0 = time.process_time()
    items = load_shard_items(plan, spec, files, tok, 0, 0)
    return (time.process_time() - c0) / max(1, int(items.length.sum()))


def image_weight(steps: int, step: int) -> float:
    """The curriculum's ``pictures`` weight at ``step`` (as ``variant`` writes it)."""
    return 0.1 + 0.5 * min(1.0, step / (steps // 2))


def run(plan: Plan, steps: int, step_time: float, runtime: str) -> dict[str, Any]:
    """Train ``steps`` simulated steps; per step the wait and tokens, per phase the loaders."""
    waits, tokens, ends = [], [], []
    costs: list[dict[str, float]] = []
    meter = CpuMeter()
    loader = Loader(plan, runtime=runtime)
    try:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(steps):
            t0 = time.perf_counter()
            batches = [next(c) for c in clients]
            waits.append(time.perf_counter() - t0)
            tokens.append(sum(b.num_tokens for b in batches))
            time.sleep(step_time)  # the training step
            ends.append(time.perf_counter())
            if (step + 1) % (steps // PHASES) == 0:
                costs.append(_loader_costs(loader.stats()))
        cpu = meter.stop()
        stats = loader.stats()
    finally:
        loader.close()
    return {
        "waits": np.array(waits),
        "tokens": np.array(tokens),
        "ends": np.array(ends),
        "costs": costs,
        "cpu_s": cpu,
        "scaling": stats["scaling"],
    }


def _loader_costs(stats: dict[str, Any]) -> dict[str, float]:
    """Each source's CPU seconds per token, the mean over its loaders that measured one."""
    out: dict[str, list[float]] = {}
    for s in stats["loaders"]:
        if not math.isnan(s["cpu_s_per_token"]):
            out.setdefault(s["source"], []).append(s["cpu_s_per_token"])
    return {k: float(np.mean(v)) for k, v in out.items()}


def sizes_at(scaling: list[dict[str, Any]], step: int) -> dict[str, tuple[int, int]]:
    """Every source's (loaders, threads) after the last decision before ``step``."""
    now = {n: (1, 1) for n in (IMAGES, *TEXTS)}
    for d in scaling:
        if d["step"] <= step:
            now = {n: (s["loaders"], s["threads"]) for n, s in d["sources"].items()}
    return now


def phase_figures(r: dict[str, Any], lo: int, hi: int, step_time: float) -> tuple[float, float]:
    """A run's waiting share and tokens/s over steps ``[lo, hi)``."""
    wait = r["waits"][lo:hi].sum()
    start = r["ends"][lo - 1] if lo else r["ends"][0] - r["waits"][0] - step_time
    return wait / (wait + step_time * (hi - lo)), r["tokens"][lo:hi].sum() / (
        r["ends"][hi - 1] - start
    )


def phase_table(steps: int, step_time: float, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Per phase: image share, the autoscaler's sizes and costs, and both runs' waits (medians)."""
    n = steps // PHASES
    print(
        "| steps | image weight | autoscaled sizes (loaders x threads) | cost per token, "
        f"ns ({IMAGES} / {' / '.join(TEXTS)}) | waiting: fixed | waiting: autoscaled | "
        "tokens/s: fixed | tokens/s: autoscaled | autoscaled / fixed |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for p in range(PHASES):
        # the first phase starts once warm: the first tenth of the run fills the read-ahead
        lo, hi = max(p * n, steps // 10), (p + 1) * n
        w = np.mean([image_weight(steps, s) for s in range(lo, hi)])
        sizes = {
            "; ".join(f"{k} {v[0]}x{v[1]}" for k, v in sizes_at(r["scaling"], hi).items())
            for r in runs["autoscaled"]
        }
        cost = {
            k: np.median([r["costs"][p].get(k, float("nan")) for r in runs["autoscaled"]])
            for k in (IMAGES, *TEXTS)
        }
        row = [
            f"{lo}-{hi - 1}",
            f"{w:.0%}",
            " or ".join(sorted(sizes)),
            " / ".join(f"{cost[k] * 1e9:,.0f}" for k in (IMAGES, *TEXTS)),
        ]
        figs = {k: [phase_figures(r, lo, hi, step_time) for r in rs] for k, rs in runs.items()}
        share = [np.median([f[0] for f in figs[k]]) for k in ("fixed", "autoscaled")]
        rate = [np.median([f[1] for f in figs[k]]) for k in ("fixed", "autoscaled")]
        row += [f"{100 * x:.1f}%" for x in share]
        row += [f"{x:,.0f}" for x in rate] + [f"{rate[1] / rate[0]:.2f}x"]
        print("| " + " | ".join(row) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", type=float, default=2, help="the autoscaler's CPU budget")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per step")
    ap.add_argument("--need", type=float, default=0.75, help="pictures' share of the budget")
    ap.add_argument("--runtime", default="inline", choices=("inline", "ray"))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each, alternated (medians)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    tars, per_tar = (12, 60) if a.quick else (24, 80)
    if a.quick:
        a.steps = 80
    root = Path(tempfile.mkdtemp(prefix="overlord-vision-autoscale-"))
    write_corpus(root, tars, per_tar, files=8, docs=150)
    base = base_plan(root, a.tokens)
    cost = {n: cost_per_token(base, n) for n in (IMAGES, *TEXTS)}
    step_time = 0.6 * a.tokens * cost[IMAGES] / (a.need * a.cpus)
    text = np.mean([cost[n] for n in TEXTS])
    print(
        f"cost per token on one thread: {IMAGES} {cost[IMAGES] * 1e9:,.0f} ns, "
        + ", ".join(f"{n} {cost[n] * 1e9:,.0f} ns" for n in TEXTS)
        + f" ({cost[IMAGES] / text:,.0f}x text); budget {a.cpus:g} CPUs; {a.steps} steps "
        f"of {a.tokens:,} tokens; training step {step_time * 1e3:.0f} ms ({IMAGES} needs "
        f"{a.need:.0%} of the budget at 60%); runtime {a.runtime}\n"
    )
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "autoscaled": []}
    for _ in range(a.repeat):  # alternated, so that a busy spell on the machine hits both
        for label, auto in (("fixed", False), ("autoscaled", True)):
            plan = variant(base, a.steps, a.cpus, auto)
            runs[label].append(run(plan, a.steps, step_time, a.runtime))
    print(f"medians of {a.repeat} run(s) each:\n")
    phase_table(a.steps, step_time, runs)
    print()
    for label, rs in runs.items():
        for r in rs:
            warm = a.steps // 10
            wait, rate = phase_figures(r, warm, a.steps, step_time)
            print(
                f"{label}: steps {warm}-{a.steps - 1}: {rate:,.0f} tokens/s, waiting {wait:.1%}; "
                f"CPU of the whole run {r['cpu_s']:.1f} s "
                f"({r['tokens'].sum() / r['cpu_s']:,.0f} tokens per CPU-s)"
            )
    print("\nautoscaler decisions that changed a size (first autoscaled run):")
    last: dict[str, tuple[int, int]] = {}
    for d in runs["autoscaled"][0]["scaling"]:
        for name, s in d["sources"].items():
            size = (s["loaders"], s["threads"])
            if last.get(name, (1, 1)) != size:
                print(f"  step {d['step']:>4}: {s['reason']}")
            last[name] = size
    return 0


if __name__ == "__main__":
    sys.exit(main())
