"""Batch memory per node under torchrun, TP 1, 2 and 4: gloo node mode against the data process.

Four processes on this node (``torchrun --nproc_per_node 4``), a world of
``dp = 4 / tp`` x ``tp`` (TP 1, 2, 4), ``--rows`` rows of 8,192 tokens per DP
rank and step (the same batch size per DP rank in every run). Each rank reads
its batches through ``overlord.Loader(plan, runtime=R).rank_client(RANK)``,
keeping only the one in hand, for ``--steps`` steps; then every rank stops,
and this script reads the proportional set size (PSS, ``/proc/PID/smaps_rollup``)
of every process of the node: the four trainers and, with the data process,
that process too; and the bytes of overlord's shared-memory slots in
``/dev/shm``. PSS counts a page shared by k processes 1/k in each, so the
node's sum counts a shared slot once.

- ``inline``: the gloo node mode; rank 0 runs the roles and sends every rank
  its own copy of its batch: TP peers each hold one.
- ``process``: the node's data process runs the roles; a batch sits in one
  slot that its TP peers map together.

"Batch memory" is the node's PSS above the same runtime's TP 4 run, where
one batch per step serves the whole node; it shows what each copy costs.
Run from the repository root (torchrun's rendezvous opens sockets)::

    tools/loopback .venv/bin/python -m benchmarks.node_memory            # about two minutes
    tools/loopback .venv/bin/python -m benchmarks.node_memory --rows 64  # larger batches
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

import yaml

from benchmarks._lib.corpus import write_word_docs
from benchmarks._lib.procfs import descendants, parents, rollup
from benchmarks._lib.timing import REPO

SEQ_LEN = 8192
RANKS = 4
WORDS = ["the", "of", "data", "loader", "shard", "token", "planner", "rank", "step", "mix"]


def child(plan: str, out: str, steps: int, runtime: str) -> None:
    """One rank: ``steps`` batches, then report and wait until the parent has measured."""
    import torch.distributed as dist

    from overlord import Loader

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Loader(plan, runtime=runtime) as loader:
        stream = loader.rank_client(rank)
        for _ in range(steps):
            batch = next(stream)
        nbytes = sum(a.nbytes for a in batch.arrays().values())
        del batch
        Path(f"{out}.{rank}").write_text(json.dumps({"pid": os.getpid(), "batch": nbytes}))
        while not Path(f"{out}.go").exists():
            time.sleep(0.05)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def write_plan(folder: Path, tp: int, rows: int) -> Path:
    dp = RANKS // tp
    plan = {
        "seed": 3,
        "sources": [{"name": "words", "path": "words/*.jsonl", "format": "jsonl"}],
        "tokenizer": {"kind": "bytes"},
        "batch": {"tokens_per_step": dp * rows * SEQ_LEN, "max_seq_len": SEQ_LEN},
        "world": {"dp": dp, "tp": tp},
    }
    path = folder / f"plan-tp{tp}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def shm_bytes() -> int:
    """Bytes of overlord's slots in ``/dev/shm`` now."""
    root = Path("/dev/shm")
    return sum(p.stat().st_size for p in root.glob("overlord-batches-*") if p.exists())


def run(plan: Path, out: Path, steps: int, runtime: str) -> dict[str, Any]:
    """One torchrun; the node's PSS (trainers, data process) and slot bytes, every rank in."""
    args = ["--child", json.dumps([str(plan), str(out), steps, runtime])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={RANKS}", "-m", "benchmarks.node_memory", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not all(Path(f"{out}.{r}").exists() for r in range(RANKS)):
            if proc.poll() is not None or time.monotonic() > deadline:
                _, err = proc.communicate(timeout=60)
                raise RuntimeError(f"torchrun ended early:\n{err.decode()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # the last sends and frees settle
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(RANKS)]
        trainers = {r["pid"] for r in ranks}
        tree = descendants(trainers, parents())
        pss = {pid: (rollup(pid) or {"pss": 0, "shmem": 0}) for pid in tree}
        result = {
            "trainers": sum(pss[p]["pss"] for p in trainers),
            "data": sum(v["pss"] for p, v in pss.items() if p not in trainers),
            "shmem": sum(v["shmem"] for v in pss.values()),
            "slots": shm_bytes(),
            "batch": ranks[0]["batch"],
            "load": os.getloadavg()[0],
        }
        Path(f"{out}.go").write_text("")
        proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun failed with {proc.returncode}")
        return result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help=f"rows of {SEQ_LEN} per DP rank and step")
    ap.add_argument("--steps", type=int, default=8, help="steps each rank takes before measuring")
    ap.add_argument("--runtimes", default="inline,process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*json.loads(args.child))
        return 0
    mib = 1 << 20
    results = []
    with tempfile.TemporaryDirectory(prefix="overlord-nodemem-") as tmp:
        folder = Path(tmp)
        (folder / "words").mkdir()
        rng = random.Random(1)
        for k in range(4):
            path = folder / "words" / f"shard-{k}.jsonl"
            write_word_docs(path, rng, WORDS, 6000, lambda r: int(r.lognormvariate(6.5, 1.0)) + 5)
        for runtime in args.runtimes.split(","):
            for tp in (1, 2, 4):
                plan = write_plan(folder, tp, args.rows)
                r = run(plan, folder / f"{runtime}-tp{tp}", args.steps, runtime)
                results.append({"runtime": runtime, "tp": tp, **r})
    print("# Batch memory per node: TP 1, 2, 4 on four processes\n")
    print(
        f"{args.rows} rows of {SEQ_LEN} tokens per DP rank and step; a DP rank's batch holds "
        f"{results[0]['batch'] / mib:.1f} MiB of arrays; {args.steps} steps, then measured; "
        f"{os.cpu_count()} CPUs.\n"
    )
    print("| runtime | TP | DP | trainers PSS MiB | data process PSS MiB | node PSS MiB "
          "| shared (PSS) MiB | slots in /dev/shm MiB | above TP 4 MiB | load avg |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        node = r["trainers"] + r["data"]
        tp4 = next(x for x in results if x["runtime"] == r["runtime"] and x["tp"] == 4)
        above = node - (tp4["trainers"] + tp4["data"])
        print(
            f"| {r['runtime']} | {r['tp']} | {RANKS // r['tp']} | {r['trainers'] / mib:.0f} "
            f"| {r['data'] / mib:.0f} | {node / mib:.0f} | {r['shmem'] / mib:.1f} "
            f"| {r['slots'] / mib:.0f} | {above / mib:.0f} | {r['load']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
