"""Batch memory per node under torchrun, TP 1, 2 and 4: gloo node mode against the data process.

One DP rank of TP 1, 2 and 4 on this node (``torchrun --nproc_per_node TP``,
``world: {dp: 1, tp: TP}``): every process receives the same batch. Each rank
reads its batches through ``overlord.Loader(plan, runtime=R).rank_client(RANK)``,
keeping only the one in hand, for ``--steps`` steps; then every rank stops,
and this script reads the proportional set size (PSS, ``/proc/PID/smaps_rollup``)
of every process of the node: the trainers and, with the data process, that
process too; and the bytes of overlord's shared-memory slots in ``/dev/shm``.
PSS counts a page shared by k processes 1/k in each, so the node's sum
counts a shared slot once.

- ``inline``: the gloo node mode; rank 0 runs the roles and sends every rank
  its own copy of the batch: TP peers each hold one.
- ``process``: the node's data process runs the roles; a batch sits in one
  slot that the TP peers map together.

Each setting runs twice, with ``--rows`` rows of 8,192 tokens per step and
with one row; *batch memory* is the node's PSS difference between the two
(what the batches, and everything sized by them, cost), so that what every
process costs anyway (Python, torch) cancels out. Flat in TP means that
difference does not grow with TP.

Run from the repository root (torchrun's rendezvous opens sockets)::

    tools/loopback .venv/bin/python -m benchmarks.node_memory            # a few minutes
    tools/loopback .venv/bin/python -m benchmarks.node_memory --rows 128 # larger batches
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
TPS = (1, 2, 4)
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
    dp = 1
    plan = {
        "seed": 3,
        "sources": [{"name": "words", "path": "words/*.jsonl", "format": "jsonl"}],
        "tokenizer": {"kind": "bytes"},
        "batch": {"tokens_per_step": dp * rows * SEQ_LEN, "max_seq_len": SEQ_LEN},
        "world": {"dp": dp, "tp": tp},
    }
    path = folder / f"plan-tp{tp}-rows{rows}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def shm_bytes() -> int:
    """Bytes of overlord's slots in ``/dev/shm`` now."""
    root = Path("/dev/shm")
    return sum(p.stat().st_size for p in root.glob("overlord-batches-*") if p.exists())


def run(plan: Path, out: Path, steps: int, runtime: str, ranks: int) -> dict[str, Any]:
    """One torchrun; the node's PSS (trainers, data process) and slot bytes, every rank in."""
    args = ["--child", json.dumps([str(plan), str(out), steps, runtime])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ranks}", "-m", "benchmarks.node_memory", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not all(Path(f"{out}.{r}").exists() for r in range(ranks)):
            if proc.poll() is not None or time.monotonic() > deadline:
                _, err = proc.communicate(timeout=60)
                raise RuntimeError(f"torchrun ended early:\n{err.decode()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # the last sends and frees settle
        got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
        trainers = {r["pid"] for r in got}
        tree = descendants(trainers, parents())
        pss = {pid: (rollup(pid) or {"pss": 0, "shmem": 0}) for pid in tree}
        result = {
            "trainers": sum(pss[p]["pss"] for p in trainers),
            "data": sum(v["pss"] for p, v in pss.items() if p not in trainers),
            "shmem": sum(v["shmem"] for v in pss.values()),
            "slots": shm_bytes(),
            "batch": got[0]["batch"],
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
    ap.add_argument("--rows", type=int, default=64, help=f"rows of {SEQ_LEN} per step")
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
            for tp in TPS:
                pair = {}
                for rows in (args.rows, 1):
                    plan = write_plan(folder, tp, rows)
                    out = folder / f"{runtime}-tp{tp}-rows{rows}"
                    pair[rows] = run(plan, out, args.steps, runtime, tp)
                results.append({"runtime": runtime, "tp": tp, "big": pair[args.rows],
                                "small": pair[1]})  # fmt: skip
    print("# Batch memory per node: one DP rank, TP 1, 2, 4\n")
    print(
        f"{args.rows} rows of {SEQ_LEN} tokens per step (a batch: "
        f"{results[0]['big']['batch'] / mib:.1f} MiB of arrays) against 1 row; "
        f"{args.steps} steps, then measured; {os.cpu_count()} CPUs.\n"
    )
    print("| runtime | TP | node PSS MiB | of it data process | shared (PSS) MiB "
          "| slots in /dev/shm MiB | node PSS, 1 row | batch memory MiB | load avg |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        big, small = r["big"], r["small"]
        node = big["trainers"] + big["data"]
        base = small["trainers"] + small["data"]
        print(
            f"| {r['runtime']} | {r['tp']} | {node / mib:.0f} | {big['data'] / mib:.0f} "
            f"| {big['shmem'] / mib:.1f} | {big['slots'] / mib:.0f} | {base / mib:.0f} "
            f"| {(node - base) / mib:.0f} | {big['load']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
