"""``overlord demo``: a corpus from Python's own files, a plan with a curriculum, a run, a report.

Everything comes from what ships with Python, so the demo needs no network:

- ``stdlib``: the standard library's modules (JSONL, the last shards gzip-compressed),
- ``tests``: the standard library's own tests (JSONL),
- ``docs``: the documentation topics of ``pydoc_data`` (Parquet, column ``content``),
- ``licenses``: the licence texts of Python and of the installed packages (JSONL).

One record is one file's text. The corpus is built once per output folder, from
sorted file lists into byte-identical shards, so a second demo starts at once.

Run it with ``overlord demo`` (or ``make demo``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from overlord.errors import OverlordError
from overlord.loader import Loader
from overlord.ops.report import Report, write_report
from overlord.ops.run import gather_history, summarize
from overlord.plan.spec import Plan
from overlord.plans import load_plan
from overlord.roles import planner as planner_module
from overlord.state import checkpoint

MANIFEST = "corpus.json"  # written last: its presence means the corpus is complete
JSONL_SHARDS = 8  # per JSONL source; the last GZIP_SHARDS of them compressed
GZIP_SHARDS = 2
PARQUET_SHARDS = 2
TEST_DIRS = {"test", "tests", "idle_test"}
LICENSE_PREFIXES = ("license", "licence", "copying", "notice")

# Token shares at the first and the last step; the plan interpolates linearly between them.
START = {"stdlib": 0.60, "tests": 0.25, "docs": 0.10, "licenses": 0.05}
END = {"stdlib": 0.30, "tests": 0.10, "docs": 0.35, "licenses": 0.25}

# 16 rows of 32K tokens (524,288 tokens) per step: 4 rows per rank at dp=4. A dp that
# does not divide 16 gets the next multiple of dp rows, so that any --dp runs. At 32K
# context attention is about a fifth of a 7B model's FLOPs, which is where balance pays.
ROWS_PER_STEP = 16
MAX_SEQ_LEN = 32768
MODEL = {"params": 7e9, "layers": 32, "hidden": 4096}
CHECKPOINT_EVERY = 100


# ---- corpus ------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    # a few files are not UTF-8; replacing their odd bytes keeps every record valid JSON
    return path.read_bytes().decode("utf-8", errors="replace")


def _python_files(tests: bool) -> list[tuple[str, Path]]:
    """The standard library's .py files, (relative name, path), sorted; tests or the rest."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib.rglob("*.py"):
        parts = path.relative_to(stdlib).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if bool(TEST_DIRS.intersection(parts[:-1])) == tests:
            out.append(("/".join(parts), path))
    return sorted(out)


def _license_files() -> list[tuple[str, Path]]:
    """Python's licence and those of the distributions in this environment, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])  # the venv's, not the machine's
    candidates = [p for top in (Path(sys.base_prefix), stdlib) for p in top.iterdir()]
    candidates += [p for d in purelib.glob("*.dist-info") for p in d.rglob("*")]
    found = {
        os.path.relpath(p, purelib if p.is_relative_to(purelib) else sys.base_prefix): p
        for p in candidates
        if p.is_file() and p.name.lower().startswith(LICENSE_PREFIXES)
    }
    return sorted(found.items())


def _records(files: Iterable[tuple[str, Path]], dedupe: bool = False) -> list[dict[str, str]]:
    seen: set[str] = set()
    out = []
    for name, path in files:
        text = _read_text(path)
        digest = hashlib.sha256(text.encode()).hexdigest()
        if not text.strip() or (dedupe and digest in seen):
            continue  # many packages ship the very same licence text
        seen.add(digest)
        out.append({"path": name, "text": text})
    return out


def _split(items: list[Any], n: int) -> Iterator[list[Any]]:
    n = max(1, min(n, len(items)))
    for k in range(n):
        yield items[k * len(items) // n : (k + 1) * len(items) // n]


def _write_jsonl(records: list[dict[str, str]], folder: Path, shards: int, gz: int) -> None:
    folder.mkdir(parents=True)
    parts = list(_split(records, shards))
    for k, part in enumerate(parts):
        blob = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part).encode()
        if k >= len(parts) - gz:
            # mtime=0 and no file name in the header: the same input gives the same bytes
            with (
                open(folder / f"part-{k:03d}.jsonl.gz", "wb") as f,
                gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as z,
            ):
                z.write(blob)
        else:
            (folder / f"part-{k:03d}.jsonl").write_bytes(blob)


def _write_parquet(records: list[dict[str, str]], folder: Path, shards: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for k, part in enumerate(_split(records, shards)):
        table = pa.table({"name": [r["path"] for r in part], "content": [r["text"] for r in part]})
        pq.write_table(table, folder / f"part-{k:03d}.parquet")


def build_corpus(data: Path) -> dict[str, Any]:
    """Build the demo corpus in ``data`` unless it is there; returns its manifest."""
    if (data / MANIFEST).is_file():
        manifest: dict[str, Any] = json.loads((data / MANIFEST).read_text())
        return manifest
    if data.exists() and any(data.iterdir()):
        raise OverlordError(
            f"{data} exists and is not a demo corpus (it has no {MANIFEST}): the demo "
            "writes its corpus there and removes nothing of yours; choose another --out"
        )
    from pydoc_data.topics import topics

    sources = {
        "stdlib": _records(_python_files(tests=False)),
        "tests": _records(_python_files(tests=True)),
        "docs": [{"path": k, "text": topics[k]} for k in sorted(topics) if topics[k].strip()],
        "licenses": _records(_license_files(), dedupe=True),
    }
    # built aside and renamed at the end, so that an interrupted build is never taken as done
    tmp = data.with_name(data.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = {}
    for name, records in sources.items():
        if name == "docs":
            _write_parquet(records, tmp / name, PARQUET_SHARDS)
        else:
            _write_jsonl(records, tmp / name, JSONL_SHARDS, GZIP_SHARDS if name == "stdlib" else 0)
        manifest[name] = {
            "format": "parquet" if name == "docs" else "jsonl",
            "shards": len(list((tmp / name).iterdir())),
            "records": len(records),
            "bytes": sum(len(r["text"].encode()) for r in records),
        }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    if data.exists():
        data.rmdir()  # empty, as checked above; os.replace needs it gone on some systems
    os.replace(tmp, data)
    return manifest


# ---- plan --------------------------------------------------------------------------------


def plan_data(steps: int, dp: int) -> dict[str, Any]:
    """The demo's data plan, as it is written to ``plan.yaml``."""
    last = max(steps - 1, 1)
    rows = dp * math.ceil(ROWS_PER_STEP / dp)
    return {
        "seed": 1234,
        "sources": [
            {"name": "stdlib", "path": "data/stdlib/*.jsonl*", "format": "jsonl"},
            {"name": "tests", "path": "data/tests/*.jsonl", "format": "jsonl"},
            {
                "name": "docs",
                "path": "data/docs/*.parquet",
                "format": "parquet",
                "text_field": "content",
            },
            {"name": "licenses", "path": "data/licenses/*.jsonl", "format": "jsonl"},
        ],
        "tokenizer": {"kind": "bytes"},
        "mixture": {
            "interpolation": "linear",
            "schedule": [{"step": 0, "weights": START}, {"step": last, "weights": END}],
        },
        "batch": {"tokens_per_step": rows * MAX_SEQ_LEN, "max_seq_len": MAX_SEQ_LEN},
        "world": {"dp": dp},
        "balance": {"method": "kk", "cost": {"model": MODEL}},
        "on_error": "skip",
    }


def write_plan(out: Path, steps: int, dp: int) -> Path:
    """Write ``out/plan.yaml``; returns its path."""
    path = out / "plan.yaml"
    text = yaml.safe_dump(plan_data(steps, dp), sort_keys=False, default_flow_style=None)
    path.write_text("# written by `overlord demo`; paths are relative to this folder\n" + text)
    return path


# ---- run ---------------------------------------------------------------------------------


def consume(plan: Plan, steps: int, ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Take every rank's batch of every step, as trainers would; returns summary and stats.

    The same loop as ``overlord run``, kept here because the report also needs
    the planner's per-step history, which the run summary leaves out.
    """
    from tqdm import tqdm

    # a stale checkpoint from a longer earlier run would pass for this run's newest
    for old in ckpt_dir.glob("step-*.json"):
        old.unlink()
    t0 = time.perf_counter()
    tokens = ckpt_bytes = 0
    # every role in this process: the report's memory (this process's peak) is the job's
    with Loader(plan, runtime="inline") as loader:
        clients = [loader.client(r, stop_step=steps) for r in range(plan.world.dp)]
        with tqdm(total=steps, desc="overlord demo", unit="step", disable=None, leave=False) as bar:
            history: dict[int, dict[str, Any]] = {}  # the planner keeps only recent steps'
            pull = max(1, planner_module.HISTORY_STEPS // 4)
            for step in range(steps):
                tokens += sum(next(c).num_tokens for c in clients)
                if (step + 1) % pull == 0:
                    gather_history(loader.stats(), history)
                if (step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == steps:
                    saved = checkpoint.save(ckpt_dir, loader.state_dict())
                    ckpt_bytes = saved.stat().st_size
                bar.update(1)
        seconds = time.perf_counter() - t0
        stats = gather_history(loader.stats(), history)
    # a step planned ahead but never consumed is not part of what the trainer got
    stats["history"] = [h for h in stats["history"] if h["step"] < steps]
    return summarize(plan, stats, 0, steps, tokens, seconds, ckpt_bytes), stats


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB."""
    import resource  # POSIX only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes there, KiB here


def run_demo(out: Path, steps: int = 300, dp: int = 4) -> int:
    """Build the corpus, write the plan, run it for ``steps`` steps on ``dp`` ranks, report."""
    if steps < 1 or dp < 1:
        raise OverlordError(f"the demo needs --steps >= 1 and --dp >= 1, found {steps} and {dp}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"overlord demo: corpus in {out / 'data'} ...", flush=True)
    reused = (out / "data" / MANIFEST).is_file()
    manifest = build_corpus(out / "data")
    built = None if reused else time.perf_counter() - t0
    plan_path = write_plan(out, steps, dp)
    plan = load_plan(plan_path)
    print(f"plan {plan_path}: {steps} steps, dp={dp}, running ...", flush=True)
    summary, stats = consume(plan, steps, out / "checkpoints")
    report = Report(
        out=out.resolve(),
        plan=plan,
        manifest=manifest,
        summary=summary,
        history=stats["history"],
        corpus_seconds=built,
        peak_rss_mib=peak_rss_mib(),
    )
    print(write_report(report))
    return 0
