"""The planner's journal: bytes and write time per step, against a full snapshot.

A 10-source plan runs on the embedded runtime with its journal on, for
``--steps`` steps. Printed: the bytes of a step's records (its delta and its
consumed mark) against those of a full snapshot, the time to write them (with
and without fsync), and the time to recover a planner from the journal.
Target: under 1 KiB per step for a 10-source plan.

    .venv/bin/python -m benchmarks.journal            # about half a minute
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._lib.corpus import write_corpus
from overlord import Loader, load_plan
from overlord.plan.spec import validate_plan
from overlord.roles.api import PlannerRole
from overlord.state.journal import SEED, encode, read_segment, recover, segments


def run(plan_path: Path, steps: int, fsync: bool, every: int, folder: Path) -> dict:
    plan = load_plan(plan_path)
    data = plan.model_dump(mode="json")
    data["recovery"] = {"journal_dir": str(folder), "snapshot_every": every, "fsync": fsync}
    plan = validate_plan(data, base_dir=plan.base_dir)
    loader = Loader(plan, build_batches=False)
    planner = loader.planner
    for step in range(steps):  # plan and consume, as ranks would; payloads are not built
        for r in range(plan.world.dp):
            planner.call(PlannerRole.rank_plan, step, r).result()
        for r in range(plan.world.dp):
            planner.call(PlannerRole.mark_consumed, r, step).result()
    stats = loader.stats()["journal"]
    assert loader.journal is not None, "recovery.journal_dir is set: the planner keeps a journal"
    path = Path(loader.journal)
    records = [rec for seg in segments(path) for rec in read_segment(seg)[0]]
    t0 = time.perf_counter()
    recovered = recover(path)
    read_s = time.perf_counter() - t0
    loader.close()
    snaps = [len(encode(r, SEED)) for r in records if r["t"] == "snap"]
    return {
        "stats": stats,
        "snapshot_bytes": max(snaps),
        "read_s": read_s,
        "segments": len(recovered),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sources", type=int, default=10)
    ap.add_argument("--every", type=int, default=100, help="recovery.snapshot_every")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="overlord-journal-bench-"))
    plan_path = write_corpus(root, sources=a.sources, files=4, docs=300)
    print(f"{a.sources} sources, {a.steps} steps, snapshot every {a.every} steps\n")
    print(
        "| fsync | delta B/step | consumed B/step | all B/step | full snapshot B | "
        "write us/step | read journal ms |"
    )
    print("|---|---|---|---|---|---|---|")
    ok = True
    for fsync in (False, True):
        r = run(plan_path, a.steps, fsync, a.every, root / f"j{int(fsync)}")
        s = r["stats"]
        delta = s["bytes"]["plan"] / s["records"]["plan"]
        cons = s["bytes"]["cons"] / max(1, s["records"]["cons"])
        total = sum(s["bytes"].values()) / a.steps
        per_step_us = s["write_s"] / a.steps * 1e6
        print(
            f"| {fsync} | {delta:.0f} | {cons:.0f} | {total:.0f} | {r['snapshot_bytes']} | "
            f"{per_step_us:.0f} | {r['read_s'] * 1e3:.1f} |"
        )
        ok &= total < 1024
    print("\n'all B/step' counts every record (snapshots too) over the steps run.")
    print("PASS: under 1 KiB per step" if ok else "FAIL: over 1 KiB per step")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
