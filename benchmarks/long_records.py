"""Peak memory of a source of one long record: a small record (the baseline) against a large one.

Each cell is a process of its own that loads a plan over one JSONL file holding a single
record of ``--small`` or ``--large`` MB of words and takes ``--steps`` batches of rank 0
(``tokens_per_step`` 8192 of 1024-token rows, the bytes tokenizer); its peak is the
process's ``VmHWM``. For each policy (``truncate``, ``split``) the report gives both
peaks and their ratio: memory bounded by the plan, not by a record, is a ratio near 1.

Run (about 2 minutes at the defaults; 300 MB takes longer to write than to load)::

    .venv/bin/python -m benchmarks.long_records [--small 20] [--large 120] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import yaml

from benchmarks._lib.peak import peak_kib


def write_source(root: Path, size: int, policy: str) -> Path:
    """One JSONL record of ``size`` bytes of words, and a plan over it; the plan's path."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5)
    # a megabyte of random words, repeated: the record is written at disk speed
    unit = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(1 << 18))
    unit = unit[: 1 << 20] + " "
    with open(root / "a.jsonl", "w") as f:
        f.write('{"text": "')
        for _ in range(size // len(unit)):
            f.write(unit)
        f.write(unit[: size % len(unit)].strip() + '"}\n')
    plan = {
        "seed": 1,
        "sources": [{"name": "one", "path": "a.jsonl", "format": "jsonl"}],
        "batch": {"tokens_per_step": 8192, "max_seq_len": 1024, "long_docs": policy},
        "world": {"dp": 1},
        "loading": {"max_record_bytes": 1 << 30, "timeout_s": 300},
    }
    (root / "plan.yaml").write_text(yaml.safe_dump(plan))
    return root / "plan.yaml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=20, help="MB of the baseline record")
    ap.add_argument("--large", type=int, default=120, help="MB of the large record")
    ap.add_argument("--steps", type=int, default=2, help="batches taken")
    ap.add_argument("--policies", default="truncate,split", help="long_docs policies, by commas")
    a = ap.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(prefix="overlord-long-records-") as tmp:
        for policy in a.policies.split(","):
            peaks = {}
            for mb in (a.small, a.large):
                plan = write_source(Path(tmp) / f"{policy}-{mb}", mb * 1_000_000, policy)
                peaks[mb] = peak_kib(plan, a.steps, timeout=1800) / 1024**2
                (plan.parent / "a.jsonl").unlink()
            report[policy] = {
                f"peak_gib_{a.small}mb": round(peaks[a.small], 3),
                f"peak_gib_{a.large}mb": round(peaks[a.large], 3),
                "ratio": round(peaks[a.large] / peaks[a.small], 2),
            }
            print(policy, json.dumps(report[policy]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
