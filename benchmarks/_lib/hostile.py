"""Hostile inputs for ``benchmarks/faults.py``: corpora whose one record (or plan) attacks.

Every case writes a small corpus and its plan twice: *with* the hostile piece
and *without* it (the same corpus, that piece replaced by an ordinary record),
so that the run's peak memory with it is compared with the same run without
it. The runs are processes of their own (:func:`run_case`), each under a
timeout; a run reads ``steps`` steps of rank 0 with ``on_error: skip`` and
reports what its loaders skipped (counted, with the file and row named) or the
error that stopped it.

The cases: a JSONL line larger than ``loading.max_record_bytes``; a gzip and a
zstd file of a few MB whose one line decompresses past the bound (a
decompression bomb); a WebDataset tar whose member declares gigabytes (a
sparse file: it takes no disk); a Parquet cell of hundreds of MB; a plan that
is a YAML alias bomb (10**10 values from under 1 KB); and a JSONL record nested
200,000 deep.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

LINES, AT = 120, 40  # records per corpus, and the row of the hostile one
CHUNK = 1 << 20

PLAN: dict[str, Any] = {
    "seed": 3,
    "batch": {"tokens_per_step": 512, "max_seq_len": 128},
    "world": {"dp": 1},
    "shuffle": {"block_bytes": 4096, "window_blocks": 2},
    "on_error": "skip",
    "loading": {"timeout_s": 60},  # max_record_bytes: its default, 64 MiB
}


def _record(i: int) -> bytes:
    return (json.dumps({"text": f"record {i} " * 5}) + "\n").encode()


def _write_lines(f: Any, huge: Callable[[Any], None] | None) -> None:
    """The corpus's lines into ``f``; row AT is written by ``huge`` when given."""
    for i in range(LINES):
        if i == AT and huge is not None:
            huge(f)
        else:
            f.write(_record(i))


def _long_line(size: int) -> Callable[[Any], None]:
    """A record of ``size`` bytes, written in chunks (never held whole here)."""

    def write(f: Any) -> None:
        f.write(b'{"text": "')
        left = size - 12
        while left > 0:
            n = min(CHUNK, left)
            f.write(b"x" * n)
            left -= n
        f.write(b'"}\n')

    return write


def _deep(f: Any) -> None:
    f.write(b'{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n")


def _plan(root: Path, source: dict[str, Any], **extra: Any) -> Path:
    plan = {**PLAN, "sources": [{"name": "web", **source}], **extra}
    (root / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    return root / "plan.yaml"


def jsonl(root: Path, hostile: bool, size: int) -> Path:
    with open(root / "a.jsonl", "wb") as f:
        _write_lines(f, _long_line(size) if hostile else None)
    return _plan(root, {"path": "a.jsonl", "format": "jsonl"})


def deep_json(root: Path, hostile: bool, size: int) -> Path:
    with open(root / "a.jsonl", "wb") as f:
        _write_lines(f, _deep if hostile else None)
    return _plan(root, {"path": "a.jsonl", "format": "jsonl"})


def gzip_bomb(root: Path, hostile: bool, size: int) -> Path:
    with gzip.open(root / "a.jsonl.gz", "wb", compresslevel=9) as f:
        _write_lines(f, _long_line(size) if hostile else None)
    return _plan(root, {"path": "a.jsonl.gz", "format": "jsonl"})


def zstd_bomb(root: Path, hostile: bool, size: int) -> Path:
    import pyarrow as pa

    with pa.CompressedOutputStream(str(root / "a.jsonl.zst"), "zstd") as f:
        _write_lines(f, _long_line(size) if hostile else None)
    return _plan(root, {"path": "a.jsonl.zst", "format": "jsonl"})


def parquet_cell(root: Path, hostile: bool, size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"record {i} " * 5 for i in range(LINES)]
    if hostile:
        texts[AT] = "x" * size
    pq.write_table(pa.table({"text": texts}), root / "a.parquet", row_group_size=16)
    return _plan(root, {"path": "a.parquet", "format": "parquet"})


def tar_member(root: Path, hostile: bool, size: int) -> Path:
    """A WebDataset tar of images and captions; sample AT's image declares ``size`` bytes."""
    from overlord.ops.vision_data import caption, random_images

    images = random_images(LINES // 4, seed=2, sizes=(20, 60))
    with open(root / "a.tar", "wb") as f:
        for i, (ext, data) in enumerate(images):
            for member, body in ((ext, data), ("txt", caption(i).encode())):
                info = tarfile.TarInfo(f"s{i:06d}.{member}")
                if hostile and i == AT // 4 and member == ext:
                    info.size = size  # its body is a hole: the file is sparse
                    f.write(info.tobuf(tarfile.GNU_FORMAT))
                    f.seek(-(-size // 512) * 512, os.SEEK_CUR)
                    continue
                info.size = len(body)
                f.write(info.tobuf(tarfile.GNU_FORMAT))
                f.write(body + b"\0" * (-len(body) % 512))
        f.write(b"\0" * 1024)
    source = {"path": "a.tar", "format": "webdataset", "text_field": "txt"}
    # blocks of the default size: a block of a tar is the samples whose headers start in
    # it, so a member of gigabytes is followed by gigabytes / block_bytes empty blocks
    # (at 4 KiB blocks, a million: the run then takes longer than its timeout)
    batch = {"tokens_per_step": 2048, "max_seq_len": 1024}
    return _plan(root, source, vision={}, batch=batch, shuffle={})


def alias_bomb(root: Path, hostile: bool, size: int) -> Path:
    path = jsonl(root, False, 0)
    if hostile:
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        for i in range(1, 10):  # 10**10 values once its aliases are expanded
            lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
        path.write_text("\n".join(lines) + "\n" + path.read_text())
    return path


@dataclass(frozen=True)
class Case:
    name: str  # as the table shows it
    build: Callable[[Path, bool, int], Path]
    size: int  # bytes of the hostile piece once decoded (0: not a size)
    quick_size: int

    def write(self, root: Path, hostile: bool, quick: bool) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        return self.build(root, hostile, self.quick_size if quick else self.size)


MB = 1 << 20
CASES = [
    Case("huge JSONL line", jsonl, 300 * MB, 100 * MB),
    Case("gzip bomb (one line)", gzip_bomb, 1024 * MB, 200 * MB),
    Case("zstd bomb (one line)", zstd_bomb, 1024 * MB, 200 * MB),
    Case("huge tar member (sparse)", tar_member, 4095 * MB, 1024 * MB),
    Case("huge Parquet cell", parquet_cell, 300 * MB, 100 * MB),
    Case("alias-bomb plan", alias_bomb, 0, 0),
    Case("deep JSON record", deep_json, 0, 0),
]

# the run of one case, in a process of its own: JSON on its last line of output
CHILD = """
import json, sys
import overlord
from overlord.errors import OverlordError
out = {"error": None, "skipped": 0, "examples": []}
try:
    plan = overlord.load_plan(sys.argv[1])
    with overlord.Loader(plan, runtime="inline") as loader:
        client = loader.client(0)
        for _ in range(int(sys.argv[2])):
            next(client)
        stats = loader.stats()["loaders"]
    out["skipped"] = sum(int(s.get("skipped", 0)) for s in stats)
    out["examples"] = [e for s in stats for e in s.get("skipped_examples", [])]
except OverlordError as e:
    out["error"] = f"{type(e).__name__}: {e}"
out["hwm_kib"] = next(int(l.split()[1]) for l in open("/proc/self/status")
                      if l.startswith("VmHWM"))
print(json.dumps(out))
"""


def _tree_rss_kib(root: int) -> int:
    """Resident memory of a process and its descendants now (KiB)."""
    from benchmarks._lib.procfs import descendants, parents

    total = 0
    for pid in descendants({root}, parents()):
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))
        except (OSError, StopIteration):
            pass  # gone, or a zombie
    return total


def run_case(plan: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    """Run a case's plan in a child process: its result, peak memory (KiB) and wall time."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(plan), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # the process tree's RSS, for a run that never reports its own
        while not done.wait(0.05):
            peak[0] = max(peak[0], _tree_rss_kib(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        timed_out = True
    done.set()
    sampler.join()
    wall = time.perf_counter() - t0
    result: dict[str, Any] = {"wall_s": wall, "timed_out": timed_out, "rc": proc.returncode}
    try:
        result.update(json.loads(out.decode().strip().splitlines()[-1]))
    except (IndexError, ValueError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        result.update(error=f"crashed (rc {proc.returncode}): {tail[0][:300]}", skipped=0)
        result.setdefault("examples", [])
    result["peak_kib"] = max(peak[0], int(result.get("hwm_kib", 0)))
    return result


def verdict(result: dict[str, Any]) -> str:
    """``named`` (an overlord error), ``skipped`` (counted), or what went wrong."""
    if result["timed_out"]:
        return "TIMEOUT"
    error = result.get("error")
    if error and not error.startswith("crashed"):
        return "named"
    if error:
        return "CRASHED"
    return "skipped" if result["skipped"] >= 1 else "READ (not bounded)"


def message(result: dict[str, Any]) -> str:
    """The error, or the first skipped record's line, as the table quotes it."""
    text = result.get("error") or next(iter(result.get("examples") or []), "")
    return " ".join(str(text).split())[:160]
