"""Pre-tokenized corpora: overlord against a torch DataLoader and a numpy floor, per CPU-second.

The corpus: ``--files`` flat token files (``.npy``, uint16 ids, documents ending with eos 0)
of ``--tokens`` ids in all, document lengths drawn from a long-tailed law (median about 500
ids, some past the row length), and the same documents as Megatron ``.idx`` + ``.bin`` pairs
(written from the format's description, as ``tests/test_token_files.py`` checks against
megatron-core's builder). Every arm delivers batches of ``--rows`` rows of ``--seq`` ids and
converts them to int64 torch tensors (``input_ids``, ``labels``, ``position_ids``):

1. *overlord*: ``Loader(plan)`` (embedded runtime, dp 1) over the ``tokens`` or the
   ``megatron`` files, ``client(0)``; and ``Loader(plan, runtime="process")`` over the
   ``tokens`` files (*overlord-process*: the roles in a data process, whose CPU is counted
   with the trainer's; the trainer's own CPU is reported beside it).
2. *torch DataLoader W=w*: an ``IterableDataset`` over the same files, memory-mapped with
   ``np.load(mmap_mode="r")``; each worker takes its share of the files, visits them and
   their documents in a seeded random order, and packs documents into rows as overlord's
   rows are laid out (a document that does not fit the row's room starts the next row;
   one longer than a row is split), with labels and positions.
3. *floor*: one thread, no loader: the same documents in the same kind of order, each
   slice copied from the memory map into a preallocated int32 batch (numpy), then the
   int64 tensors.

Each measurement runs in a fresh process: build the loader, take ``--warmup`` batches,
then time ``--steps`` batches (enough for seconds of CPU: /proc counts 10 ms ticks); CPU
is that of the process and its descendants (DataLoader workers), read from ``/proc``.
Medians of ``--repeat`` runs. Tokens are document ids (padding excluded)::

    .venv/bin/python -m benchmarks.pretokenized            # about 1.5 minutes on 2 cores
    .venv/bin/python -m benchmarks.pretokenized --quick
    .venv/bin/python -m benchmarks.pretokenized --cpus 0   # every arm on CPU 0 alone

``--cpus`` runs every arm's processes on the CPUs listed (``sched_setaffinity``, set in
the arm's process before it runs Python), the baselines as overlord: it shows what the
threads of a loader cost when they hand work to each other across cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._lib.procfs import tree_cpu
from benchmarks._lib.timing import REPO, module_command

EOS = 0


def write_corpus(root: Path, files: int, tokens: int, seed: int = 0) -> None:
    """``files`` .npy token files and the same documents as Megatron pairs."""
    rng = np.random.default_rng(seed)
    per = tokens // files
    for k in range(files):
        lengths = np.minimum(rng.lognormal(6.2, 1.0, size=per // 300 + 16).astype(np.int64) + 1,
                             40_000)  # fmt: skip
        lengths = lengths[np.cumsum(lengths) <= per]
        ids = rng.integers(1, 60_000, size=int(lengths.sum()), dtype=np.uint16)
        ends = np.cumsum(lengths) - 1
        ids[ends] = EOS
        np.save(root / f"part-{k:03d}.npy", ids)
        starts = ends - lengths + 1
        with open(root / f"part-{k:03d}.bin", "wb") as f:
            f.write(ids.tobytes())
        with open(root / f"part-{k:03d}.idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(lengths) + 1))
            f.write(lengths.astype(np.int32).tobytes())
            f.write((starts * 2).astype(np.int64).tobytes())
            f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


def write_plan(root: Path, fmt: str, rows: int, seq: int) -> Path:
    import yaml

    source: dict[str, Any] = {"name": "tok", "format": fmt}
    if fmt == "tokens":
        source |= {"path": "part-*.npy", "eos_id": EOS}
    else:
        source |= {"path": "part-*.idx"}
    plan = {
        "seed": 1,
        "sources": [source],
        "batch": {"tokens_per_step": rows * seq, "max_seq_len": seq},
        "world": {"dp": 1},
    }
    path = root / f"plan-{fmt}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


# ---- the arms, each run in a process of its own ----------------------------------------------


def _tensors(ids: np.ndarray, labels: np.ndarray, pos: np.ndarray) -> tuple[Any, Any, Any]:
    import torch

    return (torch.from_numpy(ids).long(), torch.from_numpy(labels).long(),
            torch.from_numpy(pos).long())  # fmt: skip


def _documents(root: Path, worker: int, workers: int, seed: int) -> Iterator[np.ndarray]:
    """This worker's files' documents, epoch after epoch, files and documents in a seeded order."""
    files = sorted(root.glob("part-*.npy"))[worker::workers]
    rng = np.random.default_rng(seed + worker)
    maps = [np.load(f, mmap_mode="r") for f in files]
    ends = [np.flatnonzero(np.asarray(m) == EOS) + 1 for m in maps]
    while True:
        for i in rng.permutation(len(maps)):
            starts = np.concatenate(([0], ends[i][:-1]))
            for j in rng.permutation(len(starts)):
                yield maps[i][starts[j] : ends[i][j]]


def _pack(docs: Iterator[np.ndarray], rows: int, seq: int) -> Iterator[tuple[Any, int]]:
    """Batches of ``rows`` x ``seq`` ids packed as overlord lays out rows; with their tokens."""
    while True:
        ids = np.zeros((rows, seq), np.int32)
        labels = np.full((rows, seq), -100, np.int32)
        pos = np.zeros((rows, seq), np.int32)
        row, at, used = 0, 0, 0
        for doc in docs:
            while len(doc):
                n = min(len(doc), seq)
                if at + n > seq:
                    row, at = row + 1, 0
                    if row == rows:
                        break
                piece = doc[:n]
                ids[row, at : at + n] = piece
                labels[row, at : at + n - 1] = piece[1:]
                pos[row, at : at + n] = np.arange(n)
                at, used, doc = at + n, used + n, doc[n:]
            if row == rows:
                break
        if used == 0:
            return
        yield _tensors(ids, labels, pos), used


def run_dataloader(root: Path, workers: int, rows: int, seq: int, warmup: int, steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class Tokens(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Any]:
            info = get_worker_info()
            w, n = (0, 1) if info is None else (info.id, info.num_workers)
            for tensors, used in _pack(_documents(root, w, n, seed=7), rows, seq):
                yield (*tensors, torch.tensor(used))

    loader = DataLoader(Tokens(), batch_size=None, num_workers=workers)
    return _timed(iter(loader), lambda b: int(b[3]), warmup, steps)


def run_floor(root: Path, rows: int, seq: int, warmup: int, steps: int) -> Any:
    batches = (b for b in _pack(_documents(root, 0, 1, seed=7), rows, seq))
    return _timed(batches, lambda b: b[1], warmup, steps)


def run_overlord(
    root: Path, fmt: str, rows: int, seq: int, warmup: int, steps: int, runtime: str = "inline"
) -> Any:
    import overlord

    loader = overlord.Loader(write_plan(root, fmt, rows, seq), runtime=runtime)
    client = loader.client(0)

    def batches() -> Iterator[Any]:
        for b in client:
            labels = b.labels
            yield _tensors(b.input_ids, labels, b.position_ids), b.num_tokens

    try:
        return _timed(batches(), lambda b: b[1], warmup, steps)
    finally:
        loader.close()


def _timed(batches: Iterator[Any], tokens_of: Any, warmup: int, steps: int) -> dict[str, float]:
    for _ in range(warmup):
        next(batches)
    c0, w0, seen = tree_cpu(os.getpid()), time.perf_counter(), 0
    own0 = time.process_time()
    for _ in range(steps):
        seen += tokens_of(next(batches))
    wall, cpu = time.perf_counter() - w0, tree_cpu(os.getpid()) - c0
    return {"tokens": seen, "cpu": cpu, "wall": wall, "own": time.process_time() - own0}


# ---- the driver -------------------------------------------------------------------------------


def measure(arm: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    cmd = [*module_command("pretokenized"), "--arm", arm, "--corpus", str(root),
           "--rows", str(args.rows), "--seq", str(args.seq), "--warmup", str(args.warmup),
           "--steps", str(args.steps)]  # fmt: skip
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, check=True, timeout=900,
        # set in the child before it runs Python: its every thread and process inherit it
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=40_000_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer tokens, steps and one repeat")
    p.add_argument("--cpus", help="run every arm on these CPUs only (comma-separated ids)")
    args = p.parse_args()
    if args.arm:
        root = Path(args.corpus)
        kind, _, opt = args.arm.partition(":")
        if kind.startswith("overlord"):
            runtime = "process" if kind == "overlord-process" else "inline"
            got = run_overlord(root, opt, args.rows, args.seq, args.warmup, args.steps, runtime)
        elif kind == "dataloader":
            got = run_dataloader(root, int(opt), args.rows, args.seq, args.warmup, args.steps)
        else:
            got = run_floor(root, args.rows, args.seq, args.warmup, args.steps)
        print(json.dumps(got))
        return
    if args.quick:
        args.tokens, args.steps, args.warmup, args.repeat = 16_000_000, 600, 10, 1
    arms = ["overlord:tokens", "overlord:megatron", "overlord-process:tokens", "floor"]
    arms += [f"dataloader:{w}" for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="overlord-pretok-") as tmp:
        root = Path(tmp)
        write_corpus(root, args.files, args.tokens)
        runs: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
        for _ in range(args.repeat):
            for arm in arms:  # interleaved, so that a slow minute of the machine hits all
                runs[arm].append(measure(arm, args, root))
    rate = {a: statistics.median(r["tokens"] / r["cpu"] for r in rs) for a, rs in runs.items()}
    wall = {a: statistics.median(r["tokens"] / r["wall"] for r in rs) for a, rs in runs.items()}
    loaders = [a for a in arms if a.startswith("dataloader")]
    best_cpu = max(loaders, key=lambda a: rate[a])
    best_wall = max(loaders, key=lambda a: wall[a])
    print(f"{args.rows} x {args.seq} ids per batch, {args.steps} batches timed, "
          f"medians of {args.repeat}; tokens per CPU-second and per second (wall)")  # fmt: skip
    # the trainer's process alone: what a data process leaves to the trainer's thread
    own = {
        a: statistics.median(r["tokens"] / max(r["own"], 1e-9) for r in rs)
        for a, rs in runs.items()
    }
    print(f"{'arm':24} {'tok/CPU-s':>12} {'tok/s':>12} {'vs best DL (CPU)':>17} "
          f"{'vs best DL (wall)':>18} {'CPU/token vs floor':>19} "
          f"{'trainer CPU vs floor':>21}")  # fmt: skip
    for a in arms:
        print(f"{a:24} {rate[a]:12.3e} {wall[a]:12.3e} {rate[a] / rate[best_cpu]:17.2f} "
              f"{wall[a] / wall[best_wall]:18.2f} {rate['floor'] / rate[a]:19.2f} "
              f"{rate['floor'] / own[a]:21.2f}")  # fmt: skip
    print(f"best DataLoader: {best_cpu} by CPU, {best_wall} by wall"
          + (f"; every arm on CPUs {args.cpus}" if args.cpus else ""))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
