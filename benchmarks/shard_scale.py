"""Shard size: a loader's memory and its time to first batch must not grow with its shards.

Real shards are 0.1-2 GB; overlord streams them a window at a time. Two
measurements, each run in a fresh process (``overlord.Loader``, embedded, DP 1,
rows of 8,192 tokens, 4 rows a step):

1. *Memory*: one source of one JSONL shard of 20 MB, then of 200 MB (the same
   documents, the larger file holding ten times as many). The process reads
   ``--steps`` steps and reports its peak resident memory (``VmHWM``). The
   ratio 200 MB / 20 MB is the figure (target: <= 1.3, for both tokenizers).
2. *First batch*: five sources of ``--source-mb`` MB each, in shards of
   ``--shard-mb`` MB, then in shards ten times smaller (ten times as many);
   the time from building the Loader to the first batch, with the BPE
   tokenizer (target: under 1 s, and no more than 2x the time with the small
   shards). Median of ``--repeats`` runs.

Documents are drawn from a pool of 4,000 documents of random pseudo-words
(lengths log-normal, median about 2 KB); the BPE tokenizer (vocabulary 8,000)
is trained on the pool. Run from the repository root::

    .venv/bin/python -m benchmarks.shard_scale            # about 3 minutes on 2 cores
    .venv/bin/python -m benchmarks.shard_scale --quick    # about a minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._lib.corpus import EOS, train_bpe

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import overlord
plan_path, steps = sys.argv[1], int(sys.argv[2])
with overlord.Loader(plan_path, runtime="inline") as loader:
    client = loader.client(0)
    batch = next(client)
    first = time.perf_counter() - t0
    tokens = batch.num_tokens
    for _ in range(steps - 1):
        tokens += next(client).num_tokens
    stats = loader.stats()
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"first_s": first, "peak_rss": hwm, "tokens": tokens}))
"""


def doc_pool(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of pseudo-words from a vocabulary of 20,000 (Zipf-like frequencies)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    weights = 1.0 / np.arange(1, 27)
    vocab = [
        "".join(rng.choice(letters, size=int(rng.integers(2, 10)), p=weights / weights.sum()))
        for _ in range(20_000)
    ]
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    docs = []
    for _ in range(n):
        words = int(min(20_000, rng.lognormal(5.8, 0.9)))
        docs.append(" ".join(np.asarray(vocab)[rng.choice(len(vocab), size=words, p=zipf)]))
    return docs


def write_shard(path: Path, lines: list[bytes], mb: float, seed: int) -> None:
    """A JSONL file of about ``mb`` MB of documents drawn from ``lines``."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    target, written = int(mb * 1e6), 0
    with open(path, "wb") as f:
        while written < target:
            for i in rng.integers(0, len(lines), size=256).tolist():
                f.write(lines[i])
                written += len(lines[i])


def plan_file(root: Path, sources: dict[str, str], tokenizer: dict[str, Any]) -> Path:
    plan = {
        "seed": 1,
        "sources": [{"name": n, "path": p, "format": "jsonl"} for n, p in sources.items()],
        "tokenizer": tokenizer,
        "batch": {"tokens_per_step": 4 * 8192, "max_seq_len": 8192, "prefetch_steps": 2},
        "loading": {"timeout_s": 600},
    }
    path = root / f"plan-{len(list(root.glob('plan-*')))}.json"
    path.write_text(json.dumps(plan))
    return path


def run_child(plan: Path, steps: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(plan), str(steps)],
        check=True,
        capture_output=True,
        text=True,
        env={"TOKENIZERS_PARALLELISM": "true", **_env()},
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shards, fewer repeats")
    ap.add_argument("--steps", type=int, default=30, help="steps each memory run reads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--source-mb", type=float, default=40.0, help="MB of each of 5 sources")
    ap.add_argument("--shard-mb", type=float, default=8.0, help="the large shards' MB")
    args = ap.parse_args()
    small_mb, big_mb = (20.0, 200.0)
    if args.quick:
        args.repeats, args.source_mb, args.shard_mb, args.steps = 1, 16.0, 4.0, 15

    with tempfile.TemporaryDirectory(prefix="overlord-shard-scale-") as tmp:
        root = Path(tmp)
        pool = doc_pool(4000)
        lines = [(json.dumps({"text": d}) + "\n").encode() for d in pool]
        (root / "pool.jsonl").write_bytes(b"".join(lines))
        bpe = train_bpe({"pool": [root / "pool.jsonl"]}, root / "tokenizer.json", 8000)
        tokenizers = {"bytes": {"kind": "bytes"}}
        if bpe is not None:
            tokenizers["bpe"] = {"kind": "hf", "path": str(bpe), "eos": EOS}

        print("## Memory: one shard of 20 MB against one of 200 MB\n")
        print(f"{args.steps} steps of 4 x 8,192 tokens; peak RSS of a fresh process.\n")
        print("| tokenizer | shard | peak RSS | first batch |")
        print("|---|---:|---:|---:|")
        ratios = {}
        for mb in (small_mb, big_mb):
            write_shard(root / f"one-{mb:.0f}" / "a.jsonl", lines, mb, seed=int(mb))
        for name, tok in tokenizers.items():
            peaks = {}
            for mb in (small_mb, big_mb):
                plan = plan_file(root, {"web": str(root / f"one-{mb:.0f}" / "a.jsonl")}, tok)
                runs = [run_child(plan, args.steps) for _ in range(args.repeats)]
                peaks[mb] = statistics.median(r["peak_rss"] for r in runs)
                first = statistics.median(r["first_s"] for r in runs)
                print(f"| {name} | {mb:.0f} MB | {peaks[mb] / 2**20:.0f} MiB | {first:.2f} s |")
            ratios[name] = peaks[big_mb] / peaks[small_mb]
        print()
        for name, r in ratios.items():
            verdict = "PASS" if r <= 1.3 else "MISS"
            print(f"- {name}: peak RSS 200 MB / 20 MB = {r:.2f}x (target <= 1.3x) {verdict}")

        print("\n## Time to first batch: 5 sources, large shards against 10x smaller ones\n")
        n_big = max(1, round(args.source_mb / args.shard_mb))
        layouts = {"large": (n_big, args.shard_mb), "small": (10 * n_big, args.shard_mb / 10)}
        for layout, (count, mb) in layouts.items():
            for s in range(5):
                for i in range(count):
                    write_shard(
                        root / layout / f"s{s}" / f"part-{i:03d}.jsonl", lines, mb, 100 * s + i
                    )
        tok = tokenizers.get("bpe", tokenizers["bytes"])
        print(
            f"Tokenizer: {'bpe' if 'bpe' in tokenizers else 'bytes'}; median of {args.repeats}.\n"
        )
        print("| shards | per source | first batch |")
        print("|---|---:|---:|")
        firsts = {}
        for layout, (count, mb) in layouts.items():
            srcs = {f"s{s}": str(root / layout / f"s{s}" / "*.jsonl") for s in range(5)}
            plan = plan_file(root, srcs, tok)
            runs = [run_child(plan, 1) for _ in range(args.repeats)]
            firsts[layout] = statistics.median(r["first_s"] for r in runs)
            print(f"| {count} x {mb:g} MB | {count * mb:g} MB | {firsts[layout]:.2f} s |")
        ratio = firsts["large"] / firsts["small"]
        print()
        v1 = "PASS" if firsts["large"] < 1.0 else "MISS"
        v2 = "PASS" if ratio <= 2.0 else "MISS"
        first = firsts["large"]
        print(f"- first batch with {args.shard_mb:g} MB shards: {first:.2f} s (target < 1 s) {v1}")
        print(f"- against 10x smaller shards: {ratio:.2f}x (target <= 2x) {v2}")


if __name__ == "__main__":
    main()
