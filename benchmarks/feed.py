"""Feeding: how long a trainer waits in ``next()`` for its batch, step after step.

Each loader feeds a trainer loop that takes a batch (``next()`` of the
iterator the trainer uses, timed: the *wait*) and then runs a simulated
training step of a fixed duration, of one of two kinds:

- ``sleep``: ``time.sleep``, which releases the GIL (a step spent in CUDA
  kernels or other native code);
- ``busy``: a pure-Python loop that holds the GIL for the same wall time (a
  Python training loop), so a loader's threads in the trainer's process run
  only when the interpreter switches threads (every 5 ms).

Loaders, all on one corpus and one plan:

1. *overlord embedded*, dp 1: ``OverlordIterableDataset.from_plan`` in
   ``DataLoader(batch_size=None, num_workers=0)``, what a single-process user
   runs. The inline runtime's readers tokenize ahead on threads of their own;
   planning and packing the step happen inside ``next()``.
   The same with ``runtime="process"``: the roles run in a data process
   beside the trainer, and ``next()`` takes a batch that waits in shared
   memory (:mod:`overlord.dist.data_process`).
2. *overlord under torchrun*, 4 processes on this node, ``world.dp`` 4: the
   same dataset, which is node mode there: ``inline``, rank 0 runs the node's
   only Loader on a thread and sends every other rank its batches over gloo;
   ``process``, rank 0 starts the node's data process, and every rank, rank 0
   included, takes its batches from shared memory. Every process
   runs the simulated step, then an ``all_reduce`` of one float (the
   gradients' synchronization, which keeps the ranks in step). Rank 0's wait
   and the other ranks' (pooled) are reported apart.
3. *torch DataLoader* with ``num_workers`` W (1 and 2) over
   ``benchmarks._lib.mixed.MixedTokens`` (JSONL lines, documents mixed by
   probability, the same tokenizer as overlord, packed rows; pin_memory off,
   the default prefetch_factor).

Corpus: two sources from this Python's standard library (``lib`` and
``tests``, JSONL shards, ``_lib.corpus.build_corpus``) and one of short
random-word documents (``words``). Every source is mixed at its share of the
corpus: overlord by token weights, the baseline by document probabilities
(each source's share of the documents), which come to the same thing.
Sizes: 800 stdlib files per stdlib source (``--quick``: 150) in 8 shards each,
8 x 2,000 word documents; 4 rows of 8,192 tokens per rank and step (the
issue's GPU setting); 10 warm-up and 100 timed steps per run (quick: 5 and 30).
Tokenizer: ``bytes`` (the default: the loaders' own work is small, so a wait
is what ``next()`` itself costs) or ``bpe``, a byte-level BPE of 8,000 tokens
trained on the corpus (``_lib.corpus.train_bpe``): the loaders' tokenizing then
competes with the trainer for the cores, and a step lasts about 10x longer.

Step time: unless ``--step-ms`` is given, ``--step-mult`` (3) times the time a
batch takes when consumed flat out, measured first: for the dp 1 loaders one
step time for all (the slowest loader's), so that every loader that keeps up
waits about nothing; under torchrun, the slowest rank's step flat out.

Every run is a fresh process (or a fresh torchrun) and a fresh stream: a
warm-up of ``--warm`` steps, then ``--steps`` timed steps. Reported: median,
p99 and max of the waits, and the machine's load average (2 cores shared
with other work: a busy machine shows in the tails). Targets: overlord's
median wait <= 1 ms, and <= the best DataLoader's median at the same step
kind; p99 <= 2 ms. ``--runtimes`` picks overlord's runtimes (both by default).

Run from the repository root (torchrun's rendezvous opens sockets)::

    tools/loopback .venv/bin/python -m benchmarks.feed --quick   # about a minute
    tools/loopback .venv/bin/python -m benchmarks.feed           # about two minutes
    tools/loopback .venv/bin/python -m benchmarks.feed --tokenizer bpe --steps 40  # ~10 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks._lib.corpus import EOS, build_corpus, train_bpe, write_word_docs
from benchmarks._lib.timing import REPO, module_command

SEQ_LEN = 8192
ROWS = 4  # per rank and step
NODE_RANKS = 4
WORKERS = (1, 2)
MEDIAN_MS = 1.0  # target: overlord's median wait
VS_DATALOADER = 1.0  # target: overlord's median <= this x the best DataLoader's
P99_MS = 2.0  # target: overlord's p99 wait
WORDS = ["the", "of", "data", "loader", "shard", "token", "planner", "rank", "step", "mix"]
STEP_KINDS = ("sleep", "busy")


# ---- the corpus and the plan -------------------------------------------------------------


def write_data(folder: Path, files: int | None, shards: int) -> dict[str, list[Path]]:
    """The corpus: ``lib`` and ``tests`` (stdlib files) and ``words``; shard paths per source."""
    out = build_corpus(folder, shards, files)
    rng = random.Random(5)
    (folder / "words").mkdir(parents=True, exist_ok=True)
    out["words"] = []
    for k in range(shards):
        path = folder / "words" / f"shard-{k:03d}.jsonl"
        write_word_docs(path, rng, WORDS, 2000, lambda r: int(r.lognormvariate(5.0, 1.0)) + 5)
        out["words"].append(path)
    return out


def corpus_shares(data: dict[str, list[Path]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each source's bytes (overlord's token weights) and documents (the baseline's odds)."""
    size = {s: float(sum(p.stat().st_size for p in ps)) for s, ps in data.items()}
    docs = {s: float(sum(p.read_bytes().count(b"\n") for p in ps)) for s, ps in data.items()}
    return size, docs


def write_plan(folder: Path, weights: dict[str, float], tok: dict[str, Any], dp: int, rows: int):
    plan = {
        "seed": 11,
        "sources": [{"name": s, "path": f"{s}/*.jsonl", "format": "jsonl"} for s in weights],
        "tokenizer": tok,
        "mixture": {"schedule": [{"step": 0, "weights": weights}]},
        "batch": {"tokens_per_step": dp * rows * SEQ_LEN, "max_seq_len": SEQ_LEN},
        "world": {"dp": dp},
        "balance": {
            "method": "kk",
            "cost": {"model": {"params": 7e9, "layers": 32, "hidden": 4096}},
        },
    }
    path = folder / f"plan-dp{dp}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


# ---- the trainer's loop ------------------------------------------------------------------


def busy(seconds: float) -> None:
    """Hold the GIL for ``seconds`` of wall time in pure Python, as a Python loop does."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def train(it: Any, warm: int, steps: int, kind: str, step_s: float, sync: Any = None) -> dict:
    """Take ``warm + steps`` batches, each followed by the simulated step; the timed waits."""
    step = {"sleep": time.sleep, "busy": busy, "flat": lambda s: None}[kind]
    waits = []
    for i in range(warm + steps):
        if i == warm:
            t0 = time.perf_counter()
        t = time.perf_counter()
        next(it)
        if i >= warm:
            waits.append(time.perf_counter() - t)
        step(step_s)
        if sync is not None:
            sync()
    return {"waits": waits, "seconds": time.perf_counter() - t0}


def dataset(spec: dict[str, Any], rank: int = 0, world: int = 1) -> Any:
    """The dataset of a run: overlord's from the plan, or the baseline's."""
    if spec["loader"] == "overlord":
        from overlord.torch import OverlordIterableDataset

        runtime = spec.get("runtime", "inline")
        return OverlordIterableDataset.from_plan(spec["plan"], runtime=runtime)
    from benchmarks._lib.mixed import MixedTokens

    b = spec["baseline"]
    sources = {s: [Path(p) for p in ps] for s, ps in b["sources"].items()}
    return MixedTokens(
        sources, b["doc_weights"], b["tokenizer"], b["eos"], b["rows"], SEQ_LEN, 3, rank, world
    )


def child_local(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: a fresh dataset and DataLoader, warm-up, timed steps."""
    from torch.utils.data import DataLoader

    ds = dataset(spec)
    workers = spec.get("workers", 0)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=False)
    it = iter(loader)
    out = train(it, spec["warm"], spec["steps"], spec["kind"], spec["step_s"])
    del it
    if spec["loader"] == "overlord":
        ds.close()
    return out


def child_node(spec: dict[str, Any]) -> None:
    """One rank under torchrun: flat out, then each step kind; writes OUT.RANK."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    grad = torch.zeros(1)

    def sync() -> None:
        dist.all_reduce(grad)

    def run(kind: str, step_s: float) -> dict:
        stop = spec["warm"] + spec["steps"]
        from overlord.torch import OverlordIterableDataset

        ds = OverlordIterableDataset.from_plan(
            spec["plan"], stop_step=stop, runtime=spec.get("runtime", "inline")
        )
        it = iter(DataLoader(ds, batch_size=None, num_workers=0))
        out = train(it, spec["warm"], spec["steps"], kind, step_s, sync)
        ds.close()
        dist.barrier()
        return out

    results: dict[str, Any] = {}
    step_s = spec["step_s"]
    if step_s is None:
        flat = run("flat", 0.0)
        per_step = torch.tensor([flat["seconds"] / spec["steps"]], dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        results["flat_step_s"] = per_step.item()
        step_s = spec["mult"] * per_step.item()
    results["step_s"] = step_s
    for kind in STEP_KINDS:
        results[kind] = run(kind, step_s)
    Path(f"{spec['out']}.{rank}").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def in_child(spec: dict[str, Any], torchrun: bool = False) -> Any:
    """Run ``spec`` in a fresh process (or NODE_RANKS of them under torchrun)."""
    args = ["--child", json.dumps(spec)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={NODE_RANKS}", "-m", "benchmarks.feed", *args]
    else:
        cmd = [*module_command("feed"), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:6])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    if torchrun:
        return [json.loads(Path(f"{spec['out']}.{r}").read_text()) for r in range(NODE_RANKS)]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- a real model on a GPU (--model) -------------------------------------------------------


def gpt(vocab: int, width: int, layers: int, heads: int) -> Any:
    """A GPT of pre-norm blocks with causal SDPA attention (flash on a GPU), tied embeddings."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, width))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)

        def forward(self, ids: Any, labels: Any) -> Any:
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.emb.weight.T
            return F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100
            )

    return GPT()


def child_model(spec: dict[str, Any]) -> dict[str, Any]:
    """Train a real model on ``spec["device"]`` from synthetic batches, then from overlord's.

    Synthetic: random batches made once, on the device; the model's own speed.
    overlord: ``OverlordIterableDataset.from_plan`` (embedded) in a DataLoader,
    pinned, copied to the device with ``non_blocking``. Both run the same shapes,
    the same number of steps after the same warm-up, and synchronize the device
    once at the end; tokens/s counts every position of the rows.
    """
    import torch
    from torch.utils.data import DataLoader

    from overlord.torch import OverlordIterableDataset

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    width, layers, heads = spec["model"]
    model = gpt(spec["vocab"], width, layers, heads).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    rows, warm, steps = spec["rows"], spec["warm"], spec["steps"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(ids: Any, labels: Any) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run(batches: Any) -> dict[str, Any]:
        waits = []
        for i in range(warm + steps):
            if i == warm:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            t = time.perf_counter()
            ids, labels = next(batches)
            if i >= warm:
                waits.append(time.perf_counter() - t)
            step(ids, labels)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        return {
            "waits": waits,
            "seconds": seconds,
            "tokens_per_s": steps * rows * SEQ_LEN / seconds,
        }

    gen = torch.Generator(device="cpu").manual_seed(1)
    fixed = [
        torch.randint(0, spec["vocab"], (rows, SEQ_LEN + 1), generator=gen).to(device)
        for _ in range(4)
    ]

    def synthetic() -> Any:
        i = 0
        while True:
            x = fixed[i % len(fixed)]
            i += 1
            yield x[:, :-1], x[:, 1:]

    def from_overlord() -> Any:
        ds = OverlordIterableDataset.from_plan(spec["plan"], pin_memory=device.type == "cuda")
        for b in DataLoader(ds, batch_size=None, num_workers=0):
            yield (
                b["input_ids"].to(device, non_blocking=True),
                b["labels"].to(device, non_blocking=True),
            )

    out = {"params": params, "synthetic": run(synthetic()), "overlord": run(from_overlord())}
    out["synthetic_again"] = run(synthetic())  # the device's drift across the runs
    return out


def report_model(r: dict[str, Any], spec: dict[str, Any]) -> None:
    width, layers, heads = spec["model"]
    print("# Feeding a real model: overlord against synthetic data on the device\n")
    print(
        f"Model: GPT, {r['params'] / 1e6:.0f}M parameters ({layers} layers, width {width}, "
        f"{heads} heads, vocab {spec['vocab']}), {spec['rows']} rows of {SEQ_LEN} per step, "
        f"device {spec['device']}; {spec['warm']} warm-up + {spec['steps']} timed steps per run.\n"
    )
    print("| data | tokens/s | median wait ms | p99 ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    for name in ("synthetic", "overlord", "synthetic_again"):
        w = stats_ms(r[name]["waits"])
        print(
            f"| {name} | {r[name]['tokens_per_s']:,.0f} | {w['median']:.3f} | {w['p99']:.3f} "
            f"| {w['max']:.3f} |"
        )
    base = max(r["synthetic"]["tokens_per_s"], r["synthetic_again"]["tokens_per_s"])
    ratio = r["overlord"]["tokens_per_s"] / base
    verdict = "PASS" if ratio >= 0.995 else "MISS"
    print(f"\n- overlord / synthetic (the faster synthetic run): {ratio:.4f} (>= 0.995: {verdict})")


# ---- the report --------------------------------------------------------------------------


def stats_ms(waits: list[float]) -> dict[str, float]:
    ms = np.array(waits) * 1e3
    p50, p99, top = np.percentile(ms, [50, 99, 100])
    return {"median": float(p50), "p99": float(p99), "max": float(top), "n": len(ms)}


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The two targets, strictly: every overlord row must meet each."""
    ours = [r for r in rows if r["loader"].startswith("overlord")]
    best = {
        k: min(r["median"] for r in rows if r["step"] == k and r["loader"].startswith("torch"))
        for k in STEP_KINDS
    }
    one = [(r, r["median"] <= MEDIAN_MS) for r in ours]
    two = [(r, r["median"] <= VS_DATALOADER * best[r["step"]]) for r in ours]
    three = [(r, r["p99"] <= P99_MS) for r in ours]

    def line(label: str, results: list[tuple[dict, bool]], limit: Any, key: str = "median") -> str:
        ok = all(good for _, good in results)
        parts = [
            f"{r['loader']}, {r['step']}: {r[key]:.3f} ms vs {limit(r):.3f} ms "
            f"{'PASS' if good else 'MISS'}"
            for r, good in results
        ]
        return f"- {label}: **{'PASS' if ok else 'MISS'}** ({'; '.join(parts)})"

    return [
        line(f"Target 1, overlord's median wait <= {MEDIAN_MS:g} ms", one, lambda r: MEDIAN_MS),
        line(
            f"Target 2, overlord's median wait <= {VS_DATALOADER:g} x the best torch "
            "DataLoader's median (same step kind)",
            two,
            lambda r: VS_DATALOADER * best[r["step"]],
        ),
        line(f"Target 3, overlord's p99 wait <= {P99_MS:g} ms", three, lambda r: P99_MS, "p99"),
    ]


def main_model(args: argparse.Namespace) -> int:
    """``--model``: a real model fed by overlord (embedded) against synthetic data."""
    width, layers, heads = (int(x) for x in args.model.split(","))
    steps = args.steps or (10 if args.quick else 30)
    warm = args.warm if args.warm is not None else (3 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="overlord-feed-") as tmp:
        folder = Path(tmp)
        data = write_data(folder, args.files or (150 if args.quick else 800), args.shards)
        size, _ = corpus_shares(data)
        plan = write_plan(folder, size, {"kind": "bytes"}, 1, args.rows)
        spec = {
            "mode": "model",
            "plan": str(plan),
            "model": [width, layers, heads],
            "vocab": 258,  # the bytes tokenizer's
            "rows": args.rows,
            "warm": warm,
            "steps": steps,
            "device": args.device,
        }
        report_model(in_child(spec), spec)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer files and steps")
    ap.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes")
    ap.add_argument("--steps", type=int, help="timed steps per run (default 100, quick 30)")
    ap.add_argument("--warm", type=int, help="warm-up steps per run (default 10, quick 5)")
    ap.add_argument("--rows", type=int, default=ROWS, help=f"rows of {SEQ_LEN} per rank and step")
    ap.add_argument("--files", type=int, help="stdlib files per source (default 800, quick 150)")
    ap.add_argument("--shards", type=int, default=8, help="JSONL shards per source")
    ap.add_argument("--step-ms", type=float, help="simulated step (default: measured, see above)")
    ap.add_argument("--step-mult", type=float, default=3.0, help="step = this x flat-out batch")
    ap.add_argument("--no-node", action="store_true", help="skip the torchrun runs")
    ap.add_argument(
        "--runtimes",
        default="inline,process",
        help="overlord's runtimes to run, comma-separated: inline (roles in the trainer's "
        "process), process (a data process, batches in shared memory)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--model",
        help="train a real GPT instead of the simulated step: WIDTH,LAYERS,HEADS (e.g. "
        "1024,24,16), on --device; compares overlord with synthetic data on the device",
    )
    ap.add_argument("--device", default="cuda", help="with --model (default cuda)")
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if spec["mode"] == "node":
            child_node(spec)
        elif spec["mode"] == "model":
            print(json.dumps(child_model(spec)))
        else:
            print(json.dumps(child_local(spec)))
        return 0
    if args.model:
        return main_model(args)

    tokenizer = args.tokenizer
    steps = args.steps or (30 if args.quick else 100)
    warm = args.warm if args.warm is not None else (5 if args.quick else 10)
    files = args.files or (150 if args.quick else 800)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="overlord-feed-") as tmp:
        folder = Path(tmp)
        data = write_data(folder, files, args.shards)
        size, docs = corpus_shares(data)
        if tokenizer == "bpe":
            tok_path = train_bpe(data, folder / "tokenizer.json", 8000)
            if tok_path is None:
                ap.error("--tokenizer bpe needs the tokenizers package")
            tok_spec = {"kind": "hf", "path": str(tok_path), "eos": EOS}
        else:
            tok_path, tok_spec = None, {"kind": "bytes"}
        base = {
            "sources": {s: [str(p) for p in ps] for s, ps in data.items()},
            "doc_weights": docs,
            "tokenizer": None if tok_path is None else str(tok_path),
            "eos": EOS if tok_path is not None else None,
            "rows": args.rows,
        }
        plan1 = write_plan(folder, size, tok_spec, 1, args.rows)
        runtimes = args.runtimes.split(",")
        local = [
            (f"overlord {rt} (dp 1)", {"loader": "overlord", "plan": str(plan1), "runtime": rt})
            for rt in runtimes
        ]
        local += [
            (f"torch DataLoader W={w}", {"loader": "torch", "workers": w, "baseline": base})
            for w in WORKERS
        ]
        common = {"mode": "local", "warm": warm, "steps": steps}

        flat: dict[str, float] = {}
        if args.step_ms is None:
            for name, spec in local:
                r = in_child({**common, **spec, "kind": "flat", "step_s": 0.0})
                flat[name] = r["seconds"] / steps
            step_s = args.step_mult * max(flat.values())
        else:
            step_s = args.step_ms / 1e3

        rows: list[dict[str, Any]] = []
        for kind in STEP_KINDS:
            for name, spec in local:
                r = in_child({**common, **spec, "kind": kind, "step_s": step_s})
                rows.append(
                    {"loader": name, "step": kind, "step_ms": step_s * 1e3, **stats_ms(r["waits"])}
                )

        node_flat = None
        if not args.no_node:
            plan4 = write_plan(folder, size, tok_spec, NODE_RANKS, args.rows)
            spec = {
                "mode": "node",
                "loader": "overlord",
                "plan": str(plan4),
                "warm": warm,
                "steps": steps,
                "mult": args.step_mult,
                "out": str(folder / "node"),
                "step_s": None if args.step_ms is None else args.step_ms / 1e3,
            }
            for rt in runtimes:
                ranks = in_child({**spec, "runtime": rt}, torchrun=True)
                node_flat = ranks[0].get("flat_step_s")
                for kind in STEP_KINDS:
                    for label, group in (("rank 0", ranks[:1]), ("ranks 1-3", ranks[1:])):
                        waits = [w for r in group for w in r[kind]["waits"]]
                        rows.append(
                            {
                                "loader": f"overlord {rt} torchrun x{NODE_RANKS}, {label}",
                                "step": kind,
                                "step_ms": ranks[0]["step_s"] * 1e3,
                                **stats_ms(waits),
                            }
                        )
    elapsed = time.perf_counter() - t_start

    mb = sum(size.values()) / 1e6
    print("# Feeding: the wait per step in next(), with a simulated training step\n")
    print(
        f"Corpus: {', '.join(f'{s} {len(ps)} shards' for s, ps in data.items())}, {mb:.1f} MB "
        f"({files} stdlib files per stdlib source); tokenizer {tokenizer}; {args.rows} rows of "
        f"{SEQ_LEN} tokens per rank and step; {warm} warm-up + {steps} timed steps per run; "
        f"{os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"(1, 5, 15 min) at the end; {elapsed:.0f} s in all.\n"
    )
    if flat:
        print(
            "Flat out (no step), seconds per batch: "
            + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in flat.items())
            + f"; dp 1 step = {args.step_mult:g} x the slowest = {step_s * 1e3:.1f} ms."
        )
    if node_flat is not None:
        print(
            f"Under torchrun x{NODE_RANKS}, flat out: {node_flat * 1e3:.1f} ms per step (slowest "
            f"rank); step = {args.step_mult:g} x that = {rows[-1]['step_ms']:.1f} ms."
        )
    print("\n| loader | step kind | step ms | median wait ms | p99 ms | max ms | waits |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: STEP_KINDS.index(r["step"])):
        print(
            f"| {r['loader']} | {r['step']} | {r['step_ms']:.1f} | {r['median']:.3f} "
            f"| {r['p99']:.3f} | {r['max']:.3f} | {r['n']} |"
        )
    print()
    for line in verdicts(rows):
        print(line)
    print(
        f"\np99 is over {steps} waits per run ({3 * steps} for ranks 1-3): near the largest. "
        "The torchrun rows are held to the dp 1 DataLoaders' medians, at their own (longer) "
        "step: no DataLoader-per-rank baseline runs under torchrun here."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
