"""BPE: the whole loader against the tokenizer alone, on the same texts with the same threads.

The corpus, mixture, rows and BPE tokenizer of ``benchmarks/throughput_vs.py`` (the
demo corpus, weights 4:3:2:1, 4 rows of 8,192 tokens, a byte-level BPE of 8,000 ids
trained by ``benchmarks/_lib/corpus.py``). Four arms, each in a fresh process pinned
to the same cores, with the same ``RAYON_NUM_THREADS`` (the environment's) and the same
``TOKENIZERS_PARALLELISM``, each arm run once per setting of ``--parallelism``:
``unset`` (overlord sets neither variable, so the tokenizer's Rayon pool has a thread per
core of the process) and ``false`` (each ``encode_batch_fast`` call encodes on its
caller's thread: overlord's piece threads are then its only parallelism):

1. *encode_batch_fast alone*: the texts of every piece overlord's loaders tokenize
   (:func:`overlord.sources.shard.shard_windows`: the same windows, pieces and order),
   read into memory as Python strings before the clock starts, handed to the same
   tokenizer object's ``encode_batch_fast`` (else ``encode_batch``), one piece per
   call, from one thread; the tokens counted (each text's, and its end of document).
   Nothing else: the tokenizer's own cost, the floor.
2. *HFTokenizer.encode alone*: the same pieces as Arrow arrays, through overlord's
   tokenizer call (:meth:`overlord.sources.tokenizers.HFTokenizer.encode`: the texts to
   Python strings, ``encode_batch_fast``, the ids into one int32 array with the end of
   document ids): what overlord's read path pays around the tokenizer in its call.
3. *read + HFTokenizer.encode*: as 2, the pieces read from the files while the clock
   runs, on the same thread, by overlord's own window code (files parsed, records
   permuted, pieces cut): what any loader must do before it tokenizes, without threads.
4. *overlord embedded*: ``Loader(plan).client(0)``, each batch converted to torch tensors
   (:func:`overlord.torch.to_torch`), counted by ``Batch.num_tokens``.

The tokenizer arms take the pieces of the four sources by token share (the next piece
from the source furthest below its weight's share of the tokens so far), as overlord's
mixture does; they cycle over the corpus as the loader does over epochs. Each
measurement warms up past start-up, then times a fixed number of tokens; CPU is that of
the measuring process and its descendants (``/proc``), all threads. Each arm is
measured ``--repeats`` times (default 3), interleaved; the table gives medians.

Run from the repository root::

    .venv/bin/python -m benchmarks.bpe            # about 4 minutes on 2 cores
    .venv/bin/python -m benchmarks.bpe --quick    # a quarter of the tokens
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from benchmarks._lib.corpus import EOS, train_bpe
from benchmarks._lib.procfs import tree_cpu
from benchmarks._lib.timing import REPO, module_command
from benchmarks.throughput_vs import WEIGHTS, corpus_files, write_plan
from overlord.ops.demo import build_corpus

FAST, CALL = "encode_batch_fast alone", "HFTokenizer.encode alone"
READ, LOADER = "read + HFTokenizer.encode", "overlord embedded"
ARMS = (FAST, CALL, READ, LOADER)
UNSET = "unset"  # TOKENIZERS_PARALLELISM not set: the tokenizer's Rayon pool, a thread a core
CORES = 2
WARM, TIMED = 1_500_000, 6_000_000  # tokens (--quick: a quarter)


def read_pieces(plan_path: Path, epochs: int | None = None) -> dict[str, Iterator[pa.Array]]:
    """Every source's pieces, read as a loader reads them, epoch after epoch (lazily).

    The texts each loader call tokenizes: :func:`overlord.sources.shard.shard_windows`
    cut by each window's pieces, shards in each epoch's order.
    """
    from overlord.plan.spec import load_plan
    from overlord.sources.catalog import job_files
    from overlord.sources.shard import ShardIO, shard_windows

    plan = load_plan(plan_path)
    files = job_files(
        ((s.name, [s.path] if isinstance(s.path, str) else list(s.path)) for s in plan.sources),
        str(plan.base_dir),
    )

    def source(spec: Any) -> Iterator[pa.Array]:
        cache = ShardIO(plan.loading.retries)  # line indexes, kept as a loader keeps them
        for epoch in itertools.count() if epochs is None else range(epochs):
            listed = files[spec.name].at(epoch)
            for pos in range(len(listed)):
                for window in shard_windows(plan, spec, listed, epoch, pos, cache):
                    for lo, hi in window.cut:
                        yield window.arrays(lo, hi).texts

    return {spec.name: source(spec) for spec in plan.sources}


def pieces(plan_path: Path) -> dict[str, list[pa.Array]]:
    """Epoch 0's pieces of every source, read before the clock starts."""
    out: dict[str, list[pa.Array]] = {}
    for name, it in read_pieces(plan_path, epochs=1).items():
        out[name] = list(it)
    return out


def mixed(batches: dict[str, Iterator[Any]], count: Callable[[Any], int]) -> Iterator[int]:
    """Each piece's tokens (``count`` tokenizes it), taking sources by token share."""
    total = sum(WEIGHTS.values())
    done = dict.fromkeys(batches, 0)
    while True:
        # the source furthest below its share of the tokens so far
        name = min(batches, key=lambda s: done[s] / WEIGHTS[s] * total)
        got = count(next(batches[name]))
        done[name] += got
        yield got


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads by kind: Python's by name, the others together.

    Python 3.11 does not name its threads for the OS: a Python thread is known by its
    ``native_id``; every other thread (the tokenizer's Rayon pool, Arrow's, OpenBLAS's)
    is "native".
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:  # ended
            continue
        name = names.get(int(tid), "native")
        kind = "".join(c for c in name if not c.isdigit()).rstrip("-") or name
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out[kind] = out.get(kind, 0.0) + cpu
    return out


def timed_run(counts: Iterator[int], warm: int, timed: int, t_start: float) -> dict[str, Any]:
    """Time to the first tokens, then tokens per second and per CPU-second over ``timed``.

    Also the CPU of each kind of thread over the timed tokens (:func:`thread_cpu`; a
    thread that ended in the window is left out of that split, not of ``cpu``).
    """
    seen = next(counts)
    ttfb = time.time() - t_start
    while seen < warm:
        seen += next(counts)
    c0, w0, t0, seen = tree_cpu(os.getpid()), time.perf_counter(), thread_cpu(), 0
    while seen < timed:
        seen += next(counts)
    wall, cpu = time.perf_counter() - w0, tree_cpu(os.getpid()) - c0
    split = {k: v - t0.get(k, 0.0) for k, v in thread_cpu().items()}
    threads = len(os.listdir("/proc/self/task"))
    return {
        "ttfb": ttfb,
        "tokens": seen,
        "wall": wall,
        "cpu": cpu,
        "threads": threads,
        "split": split,
    }


def run_fast(plan_path: Path, warm: int, timed: int, per_call: int) -> dict[str, Any]:
    """Arm 1: the same tokenizer object's encode_batch_fast on Python strings, alone.

    ``per_call`` consecutive pieces of a source go to one call (1: as overlord's loaders).
    """
    from overlord.plan.spec import load_plan
    from overlord.sources.tokenizers import make_tokenizer

    plan = load_plan(plan_path)
    tok = make_tokenizer(plan.tokenizer, str(plan.base_dir))._tok  # type: ignore[attr-defined]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    texts = {
        s: itertools.cycle(
            [
                sum((p.to_pylist() for p in ps[i : i + per_call]), [])
                for i in range(0, len(ps), per_call)
            ]
        )
        for s, ps in pieces(plan_path).items()
    }

    def count(batch: list[str]) -> int:
        encodings = encode(batch, add_special_tokens=False)
        return sum(map(len, encodings)) + len(encodings)  # and each text's end of document

    return timed_run(mixed(texts, count), warm, timed, time.time())


def run_call(plan_path: Path, warm: int, timed: int, read: bool) -> dict[str, Any]:
    """Arms 2 and 3: overlord's tokenizer call (Arrow texts in, one int32 array out).

    ``read``: the pieces read from the files as the clock runs, on the same thread.
    """
    from overlord.plan.spec import load_plan
    from overlord.sources.tokenizers import make_tokenizer

    plan = load_plan(plan_path)
    tokenizer = make_tokenizer(plan.tokenizer, str(plan.base_dir))
    if read:
        arrays = read_pieces(plan_path)
    else:
        arrays = {s: itertools.cycle(ps) for s, ps in pieces(plan_path).items()}
    return timed_run(
        mixed(arrays, lambda texts: len(tokenizer.encode(texts)[0])), warm, timed, time.time()
    )


def run_loader(plan_path: Path, warm: int, timed: int) -> dict[str, Any]:
    """Arm 3: the whole loader, embedded, each batch converted to torch tensors."""
    from overlord import Loader
    from overlord.torch import to_torch

    t_start = time.time()
    with Loader(plan_path, runtime="inline") as loader:

        def counts() -> Iterator[int]:
            for batch in loader.client(0):
                to_torch(batch)
                yield batch.num_tokens

        return timed_run(counts(), warm, timed, t_start)


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement of one arm, in this (fresh) process."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cores])
    root = Path(args.root)
    spec = {"kind": "hf", "path": str(root / "bpe.json"), "eos": EOS}
    plan = write_plan(root, spec, False)
    warm, timed = (WARM // 4, TIMED // 4) if args.quick else (WARM, TIMED)
    if args.one == FAST:
        return run_fast(plan, warm, timed, args.pieces_per_call)
    if args.one in (CALL, READ):
        return run_call(plan, warm, timed, read=args.one == READ)
    assert args.one == LOADER, args.one
    return run_loader(plan, warm, timed)


def measure(root: Path, arm: str, parallelism: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement of ``arm`` in a fresh process, ``TOKENIZERS_PARALLELISM`` as given."""
    cmd = [*module_command("bpe"), "--root", str(root), "--one", arm, "--cores", str(args.cores)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--pieces-per-call", str(args.pieces_per_call)]
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if parallelism != UNSET:
        env["TOKENIZERS_PARALLELISM"] = parallelism
    out = subprocess.run(
        cmd, stdout=subprocess.PIPE, text=True, check=True, timeout=900, cwd=REPO, env=env
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the tokens")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each arm")
    ap.add_argument("--cores", type=int, default=CORES, help=f"CPUs to run on (default {CORES})")
    ap.add_argument("--arms", default=",".join(ARMS), help="arms to run, comma-separated")
    ap.add_argument(
        "--parallelism",
        default=f"{UNSET},false",
        help=f"TOKENIZERS_PARALLELISM settings, each for every arm ('{UNSET}': not set)",
    )
    ap.add_argument(
        "--pieces-per-call",
        type=int,
        default=1,
        help="pieces of a source joined into one call of the encode_batch_fast arm (default 1)",
    )
    ap.add_argument("--root", help="a folder holding the corpus and bpe.json (kept)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return 0
    arms = [a for a in ARMS if a in args.arms.split(",")]
    settings = args.parallelism.split(",")
    with tempfile.TemporaryDirectory(prefix="overlord-bpe-") as tmp:
        root = Path(args.root or tmp)
        manifest = build_corpus(root / "data")
        if not (root / "bpe.json").is_file():
            files = corpus_files(root)
            jsonl = {s: [p for p in ps if p.suffix == ".jsonl"] for s, ps in files.items()}
            if train_bpe({s: ps for s, ps in jsonl.items() if ps}, root / "bpe.json", 8000) is None:
                print("(the tokenizers package is not installed: nothing to measure)")
                return 0
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        load = os.getloadavg()
        for _ in range(args.repeats):  # interleaved, so that drift hits every arm alike
            for setting in settings:
                for arm in arms:
                    got = measure(root, arm, setting, args)
                    results.setdefault((setting, arm), []).append(got)
        load_end = os.getloadavg()
    report(results, manifest, args, load, load_end)
    return 0


def report(
    results: dict[tuple[str, str], list[dict[str, Any]]],
    manifest: dict[str, Any],
    args: argparse.Namespace,
    load: tuple[float, ...],
    load_end: tuple[float, ...],
) -> None:
    size = sum(m["bytes"] for m in manifest.values())
    print("# BPE: the whole loader against the tokenizer alone\n")
    print(
        f"Corpus: the demo corpus ({size / 1e6:.1f} MB), weights "
        f"{', '.join(f'{s} {w:g}' for s, w in WEIGHTS.items())}; byte-level BPE, 8,000 ids; "
        f"{args.cores} cores (affinity); RAYON_NUM_THREADS="
        f"{os.environ.get('RAYON_NUM_THREADS', UNSET)}; median of {args.repeats}; "
        f"load average {load[0]:.2f} at the start, {load_end[0]:.2f} at the end."
    )
    med = {
        key: {
            "tokens": statistics.median(r["tokens"] for r in rows),
            "per_s": statistics.median(r["tokens"] / r["wall"] for r in rows),
            "cores": statistics.median(r["cpu"] / r["wall"] for r in rows),
            "per_cpu": statistics.median(r["tokens"] / r["cpu"] for r in rows),
            "threads": statistics.median(r["threads"] for r in rows),
        }
        for key, rows in results.items()
    }
    print(
        "\n| TOKENIZERS_PARALLELISM | arm | tokens timed | tokens/s | CPU cores used "
        "| tokens/CPU-s | threads | / encode_batch_fast per CPU-s | / encode_batch_fast wall |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for (setting, arm), m in med.items():
        base = med.get((setting, FAST))
        ratios = (
            f"{m['per_cpu'] / base['per_cpu']:.3f} | {m['per_s'] / base['per_s']:.3f}"
            if base
            else "- | -"
        )
        print(
            f"| {setting} | {arm} | {m['tokens']:,.0f} | {m['per_s']:,.0f} | {m['cores']:.2f} "
            f"| {m['per_cpu']:,.0f} | {m['threads']:.0f} | {ratios} |"
        )
    print("\nTarget: overlord embedded >= 0.95 of encode_batch_fast alone per CPU-second:")
    for setting in dict.fromkeys(s for s, _ in med):
        if (setting, FAST) in med and (setting, LOADER) in med:
            ratio = med[(setting, LOADER)]["per_cpu"] / med[(setting, FAST)]["per_cpu"]
            verdict = "PASS" if ratio >= 0.95 else "MISS"
            print(f"- TOKENIZERS_PARALLELISM={setting}: {ratio:.3f} ({verdict})")
    print("\nCPU per million tokens by thread (ms, medians; native: threads Python did not start):")
    for (setting, arm), rows in results.items():
        kinds = sorted({k for r in rows for k in r["split"]})
        per = {
            k: statistics.median(1e9 * r["split"].get(k, 0.0) / r["tokens"] for r in rows)
            for k in kinds
        }
        groups: dict[str, float] = {}
        for k, v in per.items():  # a loader's threads by role, its sources together
            role = k.split("-")[1] if k.startswith("overlord-") else k
            groups[role] = groups.get(role, 0.0) + v
        shown = ", ".join(f"{k} {v:.0f}" for k, v in groups.items() if v >= 1)
        print(f"- {setting}, {arm}: {shown}")
    print("\nEach run (tokens/CPU-s):")
    for (setting, arm), rows in results.items():
        figures = [f"{r['tokens'] / r['cpu']:,.0f}" for r in rows]
        print(f"- {setting}, {arm}: {', '.join(figures)}")


if __name__ == "__main__":
    sys.exit(main())
