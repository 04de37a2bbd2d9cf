"""Replaying one late step of a long run: bytes read and time, against running up to it.

A run of ``--steps`` small steps (two JSONL sources of many small files, the
bytes tokenizer, 128 tokens per step, dp 2) checkpoints into a folder, which
keeps its planner's journal. Then step ``--step`` (default: 100 before the
end) is rebuilt three times, each in a child process of its own so that the
counts are that work's alone:

- *replay*: ``overlord.replay(folder, step)``: the journal's segment for the
  step, then a Loader started from the state before it;
- *from the newest checkpoint* (the baseline a user without replay runs): a
  Loader resumed from the newest checkpoint at or before the step (every
  1,000 steps), every rank consuming up to the step;
- *from the start*: a Loader from step 0, every rank consumed up to the step.

Each child reports its wall time, the bytes it read (``rchar`` of
``/proc/self/io``: every read call, the journal's and the checkpoint's
included, after its imports), and the data files it opened. The three batches
must be equal (samples and arrays), or the benchmark fails.

    .venv/bin/python -m benchmarks.replay            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

WORDS = ["the", "of", "data", "loader", "shard", "token", "planner", "rank", "step", "mix"]


def write_corpus(root: Path, files: int, docs: int) -> Path:
    """Two JSONL sources of ``files`` files each, ``docs`` short documents per file; the plan."""
    rng = random.Random(11)
    for name in ("web", "code"):
        (root / name).mkdir(parents=True)
        for f in range(files):
            lines = []
            for _ in range(docs):
                text = " ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(2, 0.6))))
                lines.append(json.dumps({"text": text}))
            (root / name / f"part-{f:05d}.jsonl").write_text("\n".join(lines) + "\n")
    plan = {
        "seed": 5,
        "sources": [
            {"name": n, "path": f"{n}/*.jsonl", "format": "jsonl"} for n in ("web", "code")
        ],
        "tokenizer": {"kind": "bytes"},
        "batch": {"tokens_per_step": 128, "max_seq_len": 64, "long_docs": "split"},
        "world": {"dp": 2},
        "loading": {"timeout_s": 60},
    }
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


CHILD = r"""
import json, sys, time, hashlib
import numpy as np
import overlord
from overlord.ops.run import dump_line
import overlord.sources.files as files

opened = set()
_open = files.open_file
def counting(source, url, *a, **k):
    opened.add(url)
    return _open(source, url, *a, **k)
files.open_file = counting

def rchar():
    for line in open("/proc/self/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])

mode, plan_path, folder, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
plan = overlord.load_plan(plan_path)
# a warm-up on a corpus of its own, both ways: what the first call imports and compiles
# (numba, pyarrow's readers) is not the work measured
warm = sys.argv[5]
overlord.replay(warm + "/ckpt", 10)
with overlord.Loader(warm + "/plan.yaml", runtime="inline") as loader:
    for c in [loader.client(r, stop_step=3) for r in range(2)]:
        list(c)
opened.clear()
r0, t0 = rchar(), time.perf_counter()
if mode == "replay":
    batches = overlord.replay(folder, step)
elif mode == "checkpoint":  # what a user without replay does: resume the newest one before
    import overlord.checkpoint
    from pathlib import Path
    newest = max(
        (p for p in Path(folder).glob("step-*.json") if int(p.stem[5:]) <= step),
        key=lambda p: int(p.stem[5:]),
    )
    with overlord.Loader(plan, runtime="inline", state=overlord.checkpoint.load(newest)) as loader:
        clients = [loader.client(r, stop_step=step + 1) for r in range(plan.world.dp)]
        for _ in range(loader.start_step, step + 1):
            batches = [next(c) for c in clients]
else:
    with overlord.Loader(plan, runtime="inline") as loader:
        clients = [loader.client(r, stop_step=step + 1) for r in range(plan.world.dp)]
        for _ in range(step + 1):
            batches = [next(c) for c in clients]
seconds, read = time.perf_counter() - t0, rchar() - r0
digest = hashlib.sha256()
for b in batches:
    digest.update(dump_line(b).encode())
    for a in (b.input_ids, b.labels, b.position_ids, b.cu_seqlens):
        digest.update(np.ascontiguousarray(a).tobytes())
lived = {s.id.split(":")[0] for b in batches for s in b.samples}
print(json.dumps({"seconds": seconds, "bytes": read, "files": len(opened), "lived": len(lived),
                  "digest": digest.hexdigest(), "step": batches[0].step}))
"""


def child(mode: str, plan: Path, folder: Path, step: int, warm: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(plan), str(folder), str(step), str(warm)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(plan: Path, steps: int, folder: Path) -> None:
    """``overlord run PLAN --steps N --checkpoint-dir FOLDER --checkpoint-every 1000``."""
    subprocess.run(
        [sys.executable, "-m", "overlord.ops.cli", "run", str(plan), "--steps", str(steps),
         "--checkpoint-dir", str(folder), "--checkpoint-every", "1000"],
        check=True, capture_output=True,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--step", type=int, help="the step replayed (default: steps - 100)")
    ap.add_argument("--files", type=int, default=400, help="files per source")
    ap.add_argument("--docs", type=int, default=100, help="documents per file")
    a = ap.parse_args()
    step = a.step if a.step is not None else a.steps - 100
    root = Path(tempfile.mkdtemp(prefix="overlord-replay-bench-"))
    plan_path = write_corpus(root, a.files, a.docs)
    data = sum(p.stat().st_size for p in root.rglob("*.jsonl"))
    folder = root / "ckpt"
    t0 = time.perf_counter()
    run(plan_path, a.steps, folder)
    run_s = time.perf_counter() - t0
    warm = root / "warm"
    run(write_corpus(warm, 4, 20), 20, warm / "ckpt")
    journal = sum(p.stat().st_size for p in (folder / "journal").rglob("*") if p.is_file())
    ckpts = sum(p.stat().st_size for p in folder.glob("step-*.json"))
    print(
        f"corpus: 2 sources x {a.files} JSONL files, {data / 1e6:.1f} MB; run of {a.steps} "
        f"steps: {run_s:.0f} s; journal kept {journal / 1e6:.2f} MB "
        f"({journal / a.steps:.0f} B per step), checkpoints {ckpts / 1e3:.0f} KB\n"
    )
    print(f"step {step}:\n")
    print("| how | seconds | bytes read | data files opened | files the step's samples live in |")
    print("|---|---:|---:|---:|---:|")
    got = {}
    arms = {"replay": "replay", "from the newest checkpoint": "checkpoint",
            "from the start": "start"}  # fmt: skip
    for mode, arg in arms.items():
        r = child(arg, plan_path, folder, step, warm)
        got[mode] = r
        print(f"| {mode} | {r['seconds']:.2f} | {r['bytes']:,} | {r['files']} | {r['lived']} |")
    rep, base, ck = got["replay"], got["from the start"], got["from the newest checkpoint"]
    segs = sorted((folder / "journal" / "run-0000").glob("seg-*.log"))
    at = [p for p in segs if int(p.name[4:-4]) <= step][-1]
    seg_bytes = at.stat().st_size + (segs[-1].stat().st_size if segs[-1] != at else 0)
    print(f"\nof the replay's bytes, the two journal segments it reads: {seg_bytes:,}")
    print(
        f"\nreplay: {base['seconds'] / rep['seconds']:.0f}x faster, "
        f"{base['bytes'] / max(rep['bytes'], 1):.0f}x fewer bytes read"
    )
    print(
        f"replay against resuming the newest checkpoint before the step: "
        f"{ck['seconds'] / rep['seconds']:.1f}x faster, "
        f"{ck['bytes'] / max(rep['bytes'], 1):.1f}x fewer bytes read"
    )
    same = (
        rep["digest"] == base["digest"] == ck["digest"]
        and rep["step"] == base["step"] == ck["step"] == step
    )
    print("same batches (samples and arrays):", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
