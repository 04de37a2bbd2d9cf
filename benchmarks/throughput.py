"""Throughput: tokens delivered to the trainer by ``run_plan`` against a plain read+tokenize loop.

The corpus is built in a temporary folder from this Python's own standard
library ``.py`` files: two sources, ``lib`` and ``tests`` (files under a
``test``/``tests``/``idle_test`` folder), each in several JSONL shards of
``{"text": ..., "path": ...}`` records.

- *plain loop* (the limit for one core): for each shard, read the file,
  parse it with pyarrow's vectorized JSON reader, tokenize the text column
  with overlord's tokenizer (``BytesTokenizer`` / ``HFTokenizer.encode`` on
  the Arrow string array) and count the tokens. No shuffling, no packing.
- *overlord*: ``overlord.ops.run.run_plan`` on a plan over the same files (DP 4,
  262,144 tokens per step, rows of 8,192, ``kk`` balancing, mixture weights
  equal to each source's share of the corpus) for about one pass over the
  corpus, consuming every rank's batch as a trainer would. Tokens are real
  document tokens delivered in batches (padding excluded).

Both run in this process, interleaved, ``--repeats`` times; the tables give
medians. CPU time is the process's user+sys time (``time.process_time``, all
threads: overlord's reader threads and the tokenizer's Rust threads count).
``tokens per CPU-s`` is the figure to compare (target: overlord >= 0.8 of the
plain loop); wall-clock tokens/s is given too.

Tokenizers: ``bytes``, and, if the ``tokenizers`` package is installed, a
byte-level BPE tokenizer (vocabulary 8,000, ``<|endoftext|>`` as eos) trained
here on an eighth of the corpus and saved as ``tokenizer.json``.

Run from the repository root::

    .venv/bin/python -m benchmarks.throughput            # about a minute
    .venv/bin/python -m benchmarks.throughput --quick    # about 20 s
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json

from benchmarks._lib.corpus import EOS, build_corpus, stdlib_files, train_bpe
from overlord.ops.run import run_plan
from overlord.plan.spec import validate_plan
from overlord.sources.tokenizers import BytesTokenizer, HFTokenizer

TOKENS_PER_STEP = 262144
MAX_SEQ_LEN = 8192
DP = 4
TARGET = 0.8
SHORT_EPOCHS, LONG_EPOCHS = 0.5, 2.0  # run lengths, in passes over the corpus


_SCHEMA = pa.schema([("text", pa.large_string())])
_PARSE = pa_json.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore")


def read_texts(path: Path) -> pa.Array:
    """One shard's text column, with pyarrow's vectorized JSON reader."""
    data = path.read_bytes()
    table = pa_json.read_json(io.BytesIO(data), parse_options=_PARSE)
    return table.column("text").combine_chunks()


def plain_loop(shard_paths: dict[str, list[Path]], tokenizer: Any) -> dict[str, int]:
    """Read and tokenize every shard once, in one loop; tokens per source."""
    out = {}
    for source, paths in shard_paths.items():
        n = 0
        for p in paths:
            tokens, _ = tokenizer.encode(read_texts(p))
            n += len(tokens)
        out[source] = n
    return out


def make_plan(folder: Path, shares: dict[str, int], tokenizer: dict[str, Any]) -> Any:
    data = {
        "seed": 1234,
        "sources": [
            {"name": s, "path": f"{s}/*.jsonl", "format": "jsonl", "text_field": "text"}
            for s in shares
        ],
        "tokenizer": tokenizer,
        "mixture": {"schedule": [{"step": 0, "weights": {s: float(n) for s, n in shares.items()}}]},
        "batch": {"tokens_per_step": TOKENS_PER_STEP, "max_seq_len": MAX_SEQ_LEN},
        "world": {"dp": DP},
        "balance": {
            "method": "kk",
            "cost": {"model": {"params": 7e9, "layers": 32, "hidden": 4096}},
        },
    }
    return validate_plan(data, base_dir=folder)


def timed(fn: Any) -> tuple[Any, float, float]:
    """Run ``fn``; its value, wall seconds and process CPU seconds."""
    gc.collect()
    w0, c0 = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - w0, time.process_time() - c0


def measure(
    folder: Path,
    shard_paths: dict[str, list[Path]],
    name: str,
    tokenizer: Any,
    spec: dict[str, Any],
    repeats: int,
    profile: bool,
) -> dict[str, Any]:
    """Plain loop, a short and a long overlord run, ``repeats`` times, interleaved."""
    counts = plain_loop(shard_paths, tokenizer)  # warm-up: page cache, and the source shares
    corpus = sum(counts.values())
    plan = make_plan(folder, counts, spec)
    epoch = corpus / TOKENS_PER_STEP
    short = max(2, round(SHORT_EPOCHS * epoch))
    long = max(short + 2, round(LONG_EPOCHS * epoch))
    base: list[tuple[int, float, float]] = []
    ovl_short: list[tuple[int, float, float]] = []
    ovl_long: list[tuple[int, float, float]] = []
    for _ in range(repeats):
        got, wall, cpu = timed(lambda: plain_loop(shard_paths, tokenizer))
        base.append((sum(got.values()), wall, cpu))
        for steps, out in ((short, ovl_short), (long, ovl_long)):
            summary, wall, cpu = timed(lambda s=steps: run_plan(plan, s, progress=False))
            out.append((summary["tokens"], wall, cpu))
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(run_plan, plan, long, progress=False)
        print(f"\n## Profile of one overlord run ({name}, {long} steps; main thread only)\n\n```")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
        print("```\n")
    # steady state: what the extra steps of the long run cost, without start-up and read-ahead
    steady = [
        (t2 - t1, w2 - w1, c2 - c1) for (t1, w1, c1), (t2, w2, c2) in zip(ovl_short, ovl_long)
    ]
    return {
        "name": name,
        "corpus": corpus,
        "short": short,
        "long": long,
        "base": _median(base),
        "ovl": _median(ovl_long),
        "steady": _median(steady),
    }


def _median(rows: list[tuple[int, float, float]]) -> dict[str, float]:
    return {
        "tokens": statistics.median(r[0] for r in rows),
        "wall": statistics.median(r[1] for r in rows),
        "cpu": statistics.median(r[2] for r in rows),
        "per_cpu": statistics.median(r[0] / r[2] for r in rows),
        "per_wall": statistics.median(r[0] / r[1] for r in rows),
    }


def pack_floor(repeats: int = 20) -> float:
    """CPU ns per token of ``pack`` alone (one rank: 8 rows of 8192, 600-token documents)."""
    import numpy as np

    from overlord.batch.rows import pack

    rows, lengths = 8, np.full(8 * 13, 600, dtype=np.int64)
    row_of = np.repeat(np.arange(rows), 13)
    tokens = np.random.default_rng(0).integers(0, 256, int(lengths.sum())).astype(np.int32)
    c0 = time.process_time()
    for _ in range(repeats):
        pack(tokens, lengths, row_of, rows, MAX_SEQ_LEN, 0)
    return (time.process_time() - c0) / (repeats * len(tokens)) * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a fifth of the files, 2 repeats")
    ap.add_argument("--repeats", type=int, help="measurements of each (default 3, quick 2)")
    ap.add_argument("--shards", type=int, default=8, help="JSONL shards per source")
    ap.add_argument("--no-hf", action="store_true", help="bytes tokenizer only")
    ap.add_argument("--profile", action="store_true", help="also cProfile one overlord run")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    limit = 300 if args.quick else None

    with tempfile.TemporaryDirectory(prefix="overlord-bench-") as tmp:
        folder = Path(tmp)
        shard_paths = build_corpus(folder, args.shards, limit)
        size = sum(p.stat().st_size for ps in shard_paths.values() for p in ps)
        runs: list[tuple[str, Any, dict[str, Any]]] = [
            ("bytes", BytesTokenizer(), {"kind": "bytes"})
        ]
        tok_path = None if args.no_hf else train_bpe(shard_paths, folder / "tokenizer.json", 8000)
        if tok_path is not None:
            spec = {"kind": "hf", "path": str(tok_path), "eos": EOS}
            runs.append(("hf bpe 8k", HFTokenizer(str(tok_path), EOS), spec))
        results = [
            measure(folder, shard_paths, name, tok, spec, repeats, args.profile)
            for name, tok, spec in runs
        ]

    nfiles = {k: len(v) for k, v in stdlib_files(limit).items()}
    print("# Throughput: overlord run_plan vs a plain read+tokenize loop\n")
    print(
        f"Corpus: {nfiles['lib']} + {nfiles['tests']} stdlib .py files as {args.shards} + "
        f"{args.shards} JSONL shards, {size / 1e6:.1f} MB; overlord: DP {DP}, "
        f"{TOKENS_PER_STEP:,} tokens/step, rows of {MAX_SEQ_LEN}, kk; median of {repeats}; "
        f"{os.cpu_count()} CPUs, RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}, "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}."
        "\n"
    )
    print(
        "| tokenizer | loop | steps | tokens | wall s | CPU s | cores used | tokens/s (wall) "
        "| tokens/CPU-s | / plain loop (per CPU-s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        b = r["base"]["per_cpu"]
        for label, m, steps in (
            ("plain loop (one pass)", r["base"], "-"),
            ("overlord run_plan, whole run", r["ovl"], f"0-{r['long'] - 1}"),
            ("overlord run_plan, steady state", r["steady"], f"{r['short']}-{r['long'] - 1}"),
        ):
            rel = "" if m is r["base"] else f"{m['per_cpu'] / b:.2f}"
            print(
                f"| {r['name']} | {label} | {steps} | {m['tokens']:,.0f} | {m['wall']:.2f} "
                f"| {m['cpu']:.2f} | {m['cpu'] / m['wall']:.2f} | {m['per_wall']:,.0f} "
                f"| {m['per_cpu']:,.0f} | {rel} |"
            )
    print(
        f"\nA whole run is {LONG_EPOCHS:g} passes over the corpus, start-up and the loaders' "
        "read-ahead at the end included; steady state is the long run minus the short one "
        f"({SHORT_EPOCHS:g} pass): the cost of the extra steps alone."
    )
    floor = pack_floor()
    print(
        f"For scale: packing one rank's batch (overlord.batch.rows.pack) alone costs "
        f"{floor:.1f} CPU-ns per token; the plain loop spends "
    )
    print(
        ", ".join(f"{1e9 / r['base']['per_cpu']:.1f} ns ({r['name']})" for r in results)
        + " per token in all."
    )
    print(f"\nTarget: overlord >= {TARGET} of the plain loop's tokens per CPU-second:")
    for r in results:
        for label, key in (("steady state", "steady"), ("whole run", "ovl")):
            ratio = r[key]["per_cpu"] / r["base"]["per_cpu"]
            verdict = "meets" if ratio >= TARGET else "MISSES"
            print(f"- {r['name']}, {label}: {ratio:.2f}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
