"""Batch bytes and memory per node against TP on Ray: one object per view, or a copy per peer.

DP 2 x TP t, t = 1, 2, 4, 8, on one node (a local Ray instance); every global
rank is a trainer process of its own (a new Ray actor per run, ``num_cpus=0``)
connected with ``overlord.connect(job, global_rank=g)``. The driver steps
every trainer once per step and waits for all; a trainer takes its batch,
reads every array (as a model would: the pages are touched) and holds it
until its next step. Measured after each step, once every trainer holds it:

- **builds, packed/step**: batches the DataConstructors fetched and packed
  per (step, DP rank) (``DataConstructor.stats``; 1.00: once for all the
  rank's peers) and their bytes per step;
- **objects, batch bytes**: the distinct store buffers the trainers' batches
  live in (a trainer reports the offset of each array in the store's file,
  which is the same in every process that maps the same object) and their
  bytes: the batch memory of the node;
- **private**: bytes of batch arrays that are not in the store (a copy in
  a trainer's own heap), summed over the trainers;
- **Ray store**: the object store's used bytes as Ray counts them
  (``object_store_memory``, total less available): objects with a live
  ObjectRef. The baseline's return values drop out of it once the client
  has its batch, though the trainers still map them;
- **PSS / RSS sum**: the growth of the trainers' proportional and resident
  set sizes of their mapping of the store (``/proc/self/smaps``, the
  ``/dev/shm/plasma`` file), from before the first batch to the last step,
  summed over the trainers. A page counts once per trainer that touched it
  in RSS, and is split among the processes that map it (the constructor
  that wrote it included) in PSS. Touched pages stay mapped, so both hold
  every step's pages that the store did not reuse.

Two ways for a mesh rank to get its batch, each measured: one object per
view (what overlord does: the constructor puts each ``(step, dp, cp,
stage)`` view in the store once, and every TP peer maps that one object)
and a copy per peer (the baseline, what it did before: each peer's call
returns the batch, a store object per peer). TP 1 of the same way is the
baseline of each ratio, in the same run. Medians over the steps after the
first two.

Run from the repository root, under tools/loopback (Ray stays on 127.0.0.1)::

    tools/loopback .venv/bin/python -m benchmarks.mesh_ray           # about 5 minutes (2 cores)
    tools/loopback .venv/bin/python -m benchmarks.mesh_ray --quick   # TP 1 and 2, 4 steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.mesh import _corpus

# DP rank views of 16 rows x 4096 tokens x 4 int32 arrays: 1 MiB, far above Ray's 100 KiB
# inlining threshold, and large enough for the trainers' memory to show above their noise
ROWS = 16

WARMUP = 2


def _store_mapping() -> tuple[int, int, dict[str, int]]:
    """Where this process maps Ray's object store, and its PSS and RSS there, in bytes.

    The store is one shared file (``/dev/shm/plasma...``) that every Ray
    process maps whole; a batch read from it without a copy lives there. The
    rest of the process (heap, libraries shared with the actors a job
    starts) moves by megabytes for reasons of its own and is left out.
    """
    sizes = {"pss": 0, "rss": 0}
    start = end = 0
    store = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line: address range, ..., path
                store = "/plasma" in line
                if store and not start:
                    start, end = (int(x, 16) for x in head.split("-"))
            elif store and head in ("Pss:", "Rss:"):
                sizes[head[:-1].lower()] += int(line.split()[1]) * 1024
    return start, end, sizes


def _where(batch: Any, start: int, end: int) -> dict[str, Any]:
    """Offsets in the store file of the batch's arrays (the same object: the same offsets).

    Arrays outside the store are private copies of this process: their bytes.
    """
    offsets, private = [], 0
    for a in batch.arrays().values():
        address = a.__array_interface__["data"][0]
        if start <= address < end:
            offsets.append(address - start)
        else:
            private += a.nbytes
    nbytes = sum(a.nbytes for a in batch.arrays().values())
    return {"offsets": tuple(offsets), "bytes": nbytes, "private": private}


class Trainer:
    """One trainer process: a mesh rank's client; holds its last batch, as training does."""

    def __init__(self) -> None:
        self.client: Any = None
        self.batch: Any = None

    def start(self, job: str, global_rank: int, copies: bool) -> dict[str, int]:
        """Connect to ``job`` as ``global_rank``; ``copies``: the baseline's own-call batches."""
        import overlord

        self.client = overlord.connect(job, global_rank=global_rank)
        if copies:
            self.client._by_ref = False  # the baseline: the batch as its own call's return value
        return _store_mapping()[2]

    def step(self) -> dict[str, Any]:
        """Take the next batch, read every array, hold it; where it lives, this process's memory."""
        self.batch = None  # the last one goes first, as a training step frees its inputs
        self.batch = next(self.client)
        for a in self.batch.arrays().values():
            int(a.sum())  # touch every page, as a model reads its inputs
        start, end, sizes = _store_mapping()
        return {**_where(self.batch, start, end), **sizes}

    def stop(self) -> None:
        """Drop the batch and the client."""
        self.batch = None
        self.client.close()


def _store_used() -> int:
    """Bytes used in the object store of this (one-node) Ray instance.

    Ray's resource view (``object_store_memory`` total less available), which
    the raylet reports every few hundred ms: read until two reads agree.
    """
    import ray

    total = ray.cluster_resources()["object_store_memory"]
    last = None
    for _ in range(20):
        time.sleep(0.3)
        used = int(total - ray.available_resources().get("object_store_memory", 0))
        if used == last:
            break
        last = used
    return used


def run(tp: int, copies: bool, steps: int, plan_path: Path) -> dict[str, Any]:
    """One job of DP 2 x TP ``tp`` on Ray, every global rank a new trainer actor; the medians."""
    import ray

    from overlord import Loader, load_plan, validate_plan
    from overlord.roles.api import ConstructorRole

    plan = load_plan(plan_path)
    data = plan.model_dump(mode="json")
    data["world"] = {"dp": 2, "tp": tp}
    data["batch"]["tokens_per_step"] = 2 * ROWS * data["batch"]["max_seq_len"]
    plan = validate_plan(data, base_dir=plan.base_dir)
    job = f"mesh-ray-{tp}-{'copy' if copies else 'object'}"
    # trainers of their own: a process that mapped store pages before would not show them again
    trainers = [ray.remote(num_cpus=0)(Trainer).remote() for _ in range(plan.world.size)]
    try:
        with Loader(plan, runtime="ray", job=job) as loader:
            before = ray.get([t.start.remote(job, g, copies) for g, t in enumerate(trainers)])
            store, held, private, after = [], [], [], []
            for _ in range(steps):
                after = ray.get([t.step.remote() for t in trainers])
                store.append(_store_used())
                distinct = {a["offsets"]: a["bytes"] for a in after}
                held.append((len(distinct), sum(distinct.values())))
                private.append(sum(a["private"] for a in after))
            ray.get([t.stop.remote() for t in trainers])
            packed = [c.call(ConstructorRole.stats).result() for c in loader.constructors]
    finally:
        for t in trainers:
            ray.kill(t)
    builds = sum(p["builds"] for p in packed)
    spans = sum(p["distinct"] for p in packed)
    return {
        "tp": tp,
        "store": statistics.median(store[WARMUP:]),
        "objects": statistics.median(n for n, _ in held[WARMUP:]),
        "held": statistics.median(b for _, b in held[WARMUP:]),
        "private": max(private),
        "builds": builds / spans,
        "packed": sum(p["bytes"] for p in packed) / spans * plan.world.dp,
        "pss": sum(a["pss"] - b["pss"] for a, b in zip(after, before)),
        "rss": sum(a["rss"] - b["rss"] for a, b in zip(after, before)),
    }


def _ratio(value: float, base: float) -> str:
    return f"{value / base:>7.2f}x" if base else f"{'-':>8}"


def main(argv: list[str] | None = None) -> int:
    """Both ways, TP 1 to 8, one table each."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    steps = args.steps or (4 if args.quick else 8)
    tps = (1, 2) if args.quick else (1, 2, 4, 8)

    import ray

    from overlord.runtime.ray_runtime import init_ray

    started = init_ray(None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            plan_path = _corpus(Path(tmp))
            for copies in (False, True):
                way = "a copy per peer (the baseline)" if copies else "one object per view"
                print(f"\nDP 2 x TP t on Ray, one node, {way}: {steps} steps, medians "
                      f"after {WARMUP}")  # fmt: skip
                print(f"{'tp':>3} {'ranks':>6} {'builds':>7} {'packed/step':>12} "
                      f"{'objects':>8} {'batch bytes':>12} {'vs tp 1':>8} {'private':>8} "
                      f"{'Ray store':>10} {'PSS sum':>11} {'vs tp 1':>8} {'RSS sum':>11} "
                      f"{'vs tp 1':>8}")  # fmt: skip
                base: dict[str, float] = {}  # TP 1's figures
                for tp in tps:
                    r = run(tp, copies, steps, plan_path)
                    base = base or r
                    print(f"{tp:>3} {2 * tp:>6} {r['builds']:>7.2f} {r['packed']:>12,.0f} "
                          f"{r['objects']:>8.0f} {r['held']:>12,.0f} "
                          f"{_ratio(r['held'], base['held'])} {r['private']:>8,.0f} "
                          f"{r['store']:>10,.0f} {r['pss']:>11,.0f} "
                          f"{_ratio(r['pss'], base['pss'])} {r['rss']:>11,.0f} "
                          f"{_ratio(r['rss'], base['rss'])}", flush=True)  # fmt: skip
    finally:
        if started:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
