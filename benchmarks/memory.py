"""Loader memory: colocated per-rank DataLoaders against one overlord job on Ray, same work.

What is measured: the total proportional set size (PSS, ``/proc/PID/smaps_rollup``) of every
process of a run, at steady state (the largest of several samples taken while the trainers
iterate, after a warm-up). PSS splits each shared page among the processes that map it, so
the sum over a run's processes is the memory the run takes, counted once.

Both runs feed R trainer processes (plain Python processes standing in for DP ranks; they
import torch, as trainers do), the same mixture of the same S sources, the same batch shape
(rows of ``max_seq_len`` tokens per rank and step) and the same bytes tokenizer:

- **baseline**, the colocated design as people write it: each trainer iterates a
  ``torch.utils.data.DataLoader(num_workers=W)`` (fork) over an IterableDataset whose every
  worker opens every source: the source's files, kept open; a row index per file as numpy
  arrays (the line offsets of each JSONL file, the row-group starts of each Parquet file);
  a read-ahead/shuffle buffer (the tokens of the current shard, read whole and tokenized,
  as overlord's SourceLoader also holds whole shards); the tokenizer. It mixes sources by
  weight, document by document, and yields packed token batches.
- **overlord**: a driver process runs ``Loader(plan, runtime="ray", job=...)`` (a local Ray
  instance, one SourceLoader actor per source, one Planner actor, batches built inside each
  trainer: ``placement.constructors: trainer``); the R trainers call
  ``overlord.connect(job, rank)``.

Every process of a run is counted: the trainers, their DataLoader workers, the driver and all
of Ray's processes (GCS, raylet, agents, idle workers, actors), found as descendants of the
processes this script starts and as every process of the loopback network namespace the
script runs in. A **bare** run (R trainers that import torch and train on random tokens, no
loader) gives what the trainers cost without any loader; ``loader memory`` is a run's total
less that. The paper's 13.5x is about loader memory; the total ratio is printed too.

Sources are clones of the 4 sources of ``overlord demo``'s corpus (Python's own files, 33 MB):
source k is a folder of symlinks to the shards of demo source ``k % 4``, with that source's
weight. Per-actor overhead (what one more SourceLoader process costs before it holds data)
is measured on an idle actor with the same imports, after the samples of the overlord runs
of the three required settings.

Run (Ray must stay on loopback; about 6 minutes on 2 cores, ``--quick`` under one)::

    tools/loopback .venv/bin/python -m benchmarks.memory [--quick] [--json results.json]

It prints Markdown tables and a summary, and writes the plot ``benchmarks/memory.png``
(``--png`` to choose another path). Peak memory: about 8 GiB (the 8x4x32 baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._lib.procfs import (
    CATEGORIES,
    classify,
    leftovers,
    private_netns,
    rollup,
    run_pids,
    short_name,
)
from benchmarks._lib.timing import REPO, module_command

# ---- the work -----------------------------------------------------------------------------

BASES = ["stdlib", "tests", "docs", "licenses"]  # demo sources; source k clones BASES[k % 4]
BASE_WEIGHT = {"stdlib": 4.0, "tests": 3.0, "docs": 2.0, "licenses": 1.0}
SEQ = 8192  # max_seq_len
ROWS = 4  # rows per rank and step: 32K tokens per trainer per step
EOD, PAD = 256, 257  # the bytes tokenizer's end-of-document and padding ids
PACE = 0.05  # seconds of simulated training per step
WARM = 8  # steps every trainer takes before the first sample
SAMPLES = 5  # PSS samples per run, SAMPLE_EVERY seconds apart; the largest total is reported
SAMPLE_EVERY = 0.5

REQUIRED = [(4, 2, 5), (8, 2, 16), (8, 4, 32)]  # (R, W, S)
# curves over S (R=8, W=2) and over R (W=2, S=16); overlord runs are shared across W
EXTRA = [(8, 2, 1), (8, 2, 32), (8, 2, 64), (2, 2, 16), (4, 2, 16)]

MiB = 2**20


# ---- corpus and plan ----------------------------------------------------------------------


def make_corpus(root: Path, max_sources: int) -> list[dict[str, Any]]:
    """Demo corpus in ``root/demo``, ``max_sources`` clones of its sources, their row indexes."""
    import numpy as np
    import pyarrow.parquet as pq

    from overlord.demo import build_corpus

    build_corpus(root / "demo")
    index = root / "index"
    for base in BASES:  # one row index per file, as a loader's setup writes them
        (index / base).mkdir(parents=True, exist_ok=True)
        for f in sorted((root / "demo" / base).iterdir()):
            if f.suffix == ".parquet":
                md = pq.ParquetFile(f).metadata
                rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
                offsets = np.concatenate(([0], np.cumsum(rows))).astype(np.int64)
            else:
                raw = f.read_bytes()
                raw = gzip.decompress(raw) if f.name.endswith(".gz") else raw
                nl = np.flatnonzero(np.frombuffer(raw, dtype=np.uint8) == 10)
                offsets = np.concatenate(([0], nl + 1)).astype(np.int64)
            np.save(index / base / (f.name + ".npy"), offsets)
    sources = []
    for k in range(max_sources):
        base = BASES[k % len(BASES)]
        folder = root / "sources" / f"s{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        files = []
        for f in sorted((root / "demo" / base).iterdir()):
            link = folder / f.name
            if not link.exists():
                link.symlink_to(f)
            files.append(str(link))
        parquet = base == "docs"
        sources.append(
            {
                "name": f"s{k:03d}",
                "base": base,
                "files": files,
                "index": [str(index / base / (Path(f).name + ".npy")) for f in files],
                "format": "parquet" if parquet else "jsonl",
                "text_field": "content" if parquet else "text",
                "weight": BASE_WEIGHT[base],
            }
        )
    return sources


def write_plan(root: Path, sources: list[dict[str, Any]], dp: int) -> Path:
    """The one plan both designs follow: sources, mixture, batch shape, tokenizer."""
    import yaml

    plan = {
        "seed": 7,
        "sources": [
            {
                "name": s["name"],
                "path": f"sources/{s['name']}/*",
                "format": s["format"],
                "text_field": s["text_field"],
            }
            for s in sources
        ],
        "tokenizer": {"kind": "bytes"},
        "mixture": {
            "schedule": [{"step": 0, "weights": {s["name"]: s["weight"] for s in sources}}]
        },
        "batch": {"tokens_per_step": dp * ROWS * SEQ, "max_seq_len": SEQ},
        "world": {"dp": dp},
        "placement": {"constructors": "trainer", **LOADER_PLACEMENT},
        "on_error": "skip",
    }
    path = root / f"plan-dp{dp}-s{len(sources)}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    (root / f"sources-s{len(sources)}.json").write_text(json.dumps(sources))
    return path


# ---- the baseline's dataset (runs in DataLoader workers) ---------------------------------


class SourceReader:
    """One source as a colocated worker holds it.

    Its files stay open; a row index per file (numpy); the tokens of the current shard, read
    whole, tokenized and shuffled (the read-ahead/shuffle buffer); the next document to give.
    """

    def __init__(self, spec: dict[str, Any], seed: list[int]):
        import numpy as np

        self.spec = spec
        self.handles = [open(f, "rb") for f in spec["files"]]  # noqa: SIM115 (held open)
        self.index = [np.load(p) for p in spec["index"]]
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(self.handles))
        self.pos = 0
        self._next_shard()

    def _texts(self, i: int) -> list[str]:
        fh, field = self.handles[i], self.spec["text_field"]
        fh.seek(0)
        if self.spec["format"] == "parquet":
            import pyarrow.parquet as pq

            return [t for t in pq.read_table(fh, columns=[field]).column(field).to_pylist() if t]
        raw = fh.read()
        if self.spec["files"][i].endswith(".gz"):
            raw = gzip.decompress(raw)
        off = self.index[i].tolist()
        texts = []
        for a, b in zip(off[:-1], off[1:]):
            if b - a > 1:
                texts.append(json.loads(raw[a:b])[field])
        return texts

    def _next_shard(self) -> None:
        import numpy as np

        if self.pos == len(self.order):
            self.order, self.pos = self.rng.permutation(len(self.handles)), 0
        encoded = [t.encode("utf-8", "replace") for t in self._texts(int(self.order[self.pos]))]
        self.pos += 1
        lengths = np.array([len(e) + 1 for e in encoded], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        tokens = np.empty(int(lengths.sum()), dtype=np.int32)
        for e, s, n in zip(encoded, starts.tolist(), lengths.tolist()):
            tokens[s : s + n - 1] = np.frombuffer(e, dtype=np.uint8)
            tokens[s + n - 1] = EOD
        self.tokens, self.starts, self.lengths = tokens, starts, lengths
        self.doc_order, self.next = self.rng.permutation(len(lengths)), 0

    def next_doc(self) -> Any:
        if self.next == len(self.doc_order):
            self._next_shard()
        j = int(self.doc_order[self.next])
        self.next += 1
        return self.tokens[self.starts[j] : self.starts[j] + self.lengths[j]]


def baseline_batches(sources: list[dict[str, Any]], rank: int, seed: int) -> Iterator[Any]:
    """What each DataLoader worker runs: open every source, mix by weight, pack rows."""
    import numpy as np
    import torch
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    wid = info.id if info is not None else 0
    readers = [SourceReader(s, [seed, rank, wid, k]) for k, s in enumerate(sources)]
    weights = np.array([s["weight"] for s in sources], dtype=np.float64)
    p = weights / weights.sum()
    rng = np.random.default_rng([seed, rank, wid])
    need = ROWS * SEQ
    carry = np.zeros(0, dtype=np.int32)
    while True:
        parts, have = [carry], len(carry)
        while have < need:  # concatenate documents and cut rows: GPT-style packing
            doc = readers[int(rng.choice(len(readers), p=p))].next_doc()
            parts.append(doc)
            have += len(doc)
        flat = np.concatenate(parts)
        carry = flat[need:].copy()
        ids = torch.from_numpy(flat[:need].astype(np.int64)).view(ROWS, SEQ)
        labels = torch.roll(ids, -1, dims=1)
        positions = torch.arange(SEQ, dtype=torch.int32).expand(ROWS, SEQ).contiguous()
        yield {"input_ids": ids, "labels": labels, "position_ids": positions, "tokens": need}


# ---- child processes ------------------------------------------------------------------------


def _write_progress(d: Path, rank: int, step: int, tokens: int) -> None:
    tmp = d / f".progress-{rank}"
    tmp.write_text(f"{step} {tokens}")
    os.replace(tmp, d / f"progress-{rank}")


def trainer_main(a: argparse.Namespace) -> int:
    """One DP rank: import torch, take batches, 'train' on them, report progress."""
    import torch

    d, rank = Path(a.dir), a.rank
    torch.set_num_threads(1)
    loader: Any = None
    if a.mode == "baseline":
        import pyarrow.parquet  # noqa: F401 (the dataset module's imports, before the fork)
        from torch.utils.data import DataLoader, IterableDataset

        sources = json.loads(Path(a.sources).read_text())

        class Mixed(IterableDataset):
            def __iter__(self) -> Iterator[Any]:
                return baseline_batches(sources, rank, a.seed)

        loader = DataLoader(Mixed(), batch_size=None, num_workers=a.workers, prefetch_factor=2)
        batches: Iterator[Any] = iter(loader)
    elif a.mode == "overlord":
        import overlord
        from overlord.torch import to_torch

        def stream() -> Iterator[Any]:
            for b in overlord.connect(a.job, rank):
                yield {**to_torch(b), "tokens": b.num_tokens}

        batches = stream()
    else:  # bare: no loader at all, random tokens of the same shape

        def random() -> Iterator[Any]:
            while True:
                ids = torch.randint(0, 256, (ROWS, SEQ), dtype=torch.int64)
                yield {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "tokens": ROWS * SEQ}

        batches = random()
    step = tokens = 0
    for batch in batches:
        x = batch["input_ids"]
        float((x[:, :64] == batch["labels"][:, :64]).float().mean())  # the stand-in step
        step, tokens = step + 1, tokens + int(batch["tokens"])
        _write_progress(d, rank, step, tokens)
        if (d / "stop").exists():
            break
        time.sleep(PACE)
    del batches, loader  # joins the DataLoader's workers
    return 0


class _Probe:
    """An actor with a SourceLoader's imports and nothing else: the cost of one more actor."""

    def __init__(self) -> None:
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401

        import overlord.roles.source_loader  # noqa: F401

    def pid(self) -> int:
        return os.getpid()


def driver_main(a: argparse.Namespace) -> int:
    """The overlord job: a Loader on a local Ray instance, until told to stop."""
    import ray

    from overlord import Loader, load_plan
    from overlord.roles.source_loader import SourceLoader

    d = Path(a.dir)
    plan = load_plan(a.plan)
    with Loader(plan, runtime="ray", job=a.job) as loader:
        (d / "ready.tmp").write_text(ray.get_runtime_context().gcs_address)
        os.replace(d / "ready.tmp", d / "ready")
        while not (d / "stop").exists():
            if (d / "stats-req").exists() and not (d / "stats.json").exists():
                stats = loader.stats()["loaders"]
                keep = ("source", "held_tokens", "held_shards", "budget_tokens", "shards")
                (d / "stats.tmp").write_text(json.dumps([{k: s[k] for k in keep} for s in stats]))
                os.replace(d / "stats.tmp", d / "stats.json")
            if (d / "probe-req").exists() and not (d / "probe").exists():
                actor = (
                    ray.remote(_Probe)
                    .options(num_cpus=0, max_concurrency=SourceLoader.CONCURRENCY)
                    .remote()
                )
                (d / "probe").write_text(str(ray.get(actor.pid.remote())))
            time.sleep(0.1)
    return 0


# ---- one run --------------------------------------------------------------------------------


def _wait(what: str, cond: Any, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a process exited ({dead[0].args[3:7]}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _progress(d: Path, ranks: int) -> list[tuple[int, int]]:
    out = []
    for r in range(ranks):
        try:
            step, tokens = (d / f"progress-{r}").read_text().split()
            out.append((int(step), int(tokens)))
        except (OSError, ValueError):
            out.append((0, 0))
    return out


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def snapshot(trainers: set[int], driver: int | None) -> dict[str, Any]:
    roots = trainers | ({driver} if driver else set())
    parts = {c: 0 for c in CATEGORIES}
    kinds = {"anon": 0, "file": 0, "shmem": 0}
    count = {c: 0 for c in CATEGORIES}
    procs = []
    for pid in sorted(run_pids(roots)):
        r = rollup(pid)
        if r is None:
            continue
        c = classify(pid, trainers, driver)
        parts[c] += r["pss"]
        count[c] += 1
        for k in kinds:
            kinds[k] += r[k]
        procs.append({"pid": pid, "category": c, "name": short_name(pid), **r})
    total = sum(parts.values())
    return {"total": total, "parts": parts, "kinds": kinds, "count": count, "procs": procs}


def measure(
    kind: str, root: Path, r: int, w: int, s: int, plan: Path, job: str, probe: bool = False
) -> dict[str, Any]:
    """Run one design on (R, W, S); return its steady-state PSS.

    With ``probe`` (overlord), also the PSS of one more idle actor, started after the samples.
    """
    t0 = time.monotonic()
    d = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root))
    me = module_command("memory")  # run from REPO, where ``benchmarks`` imports
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    logs = []

    def start(args: list[str]) -> subprocess.Popen[bytes]:
        log = open(d / f"log-{len(logs)}.txt", "wb")  # noqa: SIM115 (closed below)
        logs.append(log)
        return subprocess.Popen(me + args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    common = ["--dir", str(d), "--job", job, "--seed", "7"]
    driver = None
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"kind": kind, "R": r, "W": w, "S": s}
    try:
        if kind == "overlord":
            driver = start(["--child", "driver", "--plan", str(plan), *common])
            procs.append(driver)
            _wait("the overlord job", (d / "ready").exists, procs, 300)
            env["RAY_ADDRESS"] = (d / "ready").read_text()
            out["t_ready"] = time.monotonic() - t0
        src = str(root / f"sources-s{s}.json")
        for rank in range(r):
            args = ["--child", "trainer", "--mode", kind, "--rank", str(rank), "--workers", str(w)]
            procs.append(start([*args, "--sources", src, *common]))
        trainers = {p.pid for p in procs if p is not driver}
        _wait(
            f"{WARM} steps on every rank",
            lambda: min(st for st, _ in _progress(d, r)) >= WARM,
            procs,
            300,
        )
        out["t_warm"] = time.monotonic() - t0
        before = _progress(d, r)
        samples = []
        for _ in range(SAMPLES):
            samples.append(snapshot(trainers, driver.pid if driver else None))
            time.sleep(SAMPLE_EVERY)
        after = _progress(d, r)
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited while sampling")
        best = max(samples, key=lambda x: x["total"])
        out.update(best)
        out["steps_while_sampling"] = min(a[0] - b[0] for a, b in zip(after, before))
        out["tokens_per_step"] = after[0][1] / after[0][0]
        if kind == "overlord":
            (d / "stats-req").touch()
            _wait("the loaders' stats", (d / "stats.json").exists, procs, 60)
            out["loaders"] = json.loads((d / "stats.json").read_text())
        if kind == "overlord" and probe:
            (d / "probe-req").touch()
            _wait("the probe actor", (d / "probe").exists, procs, 120)
            pid = int((d / "probe").read_text())
            seen = []
            for _ in range(3):
                time.sleep(SAMPLE_EVERY)
                seen.append(rollup(pid) or {"pss": 0, "uss": 0})
            out["probe"] = max(seen, key=lambda x: x["pss"])
    except Exception as e:
        for i, _ in enumerate(logs):
            tail = (d / f"log-{i}.txt").read_text(errors="replace")[-3000:]
            if tail.strip():
                print(f"--- log {i} ---\n{tail}", file=sys.stderr)
        raise RuntimeError(f"{kind} R={r} W={w} S={s}: {e}") from e
    finally:
        out["t_stop"] = time.monotonic() - t0
        (d / "stop").touch()
        deadline = time.monotonic() + 60
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for _ in range(30):  # Ray's processes go down after the driver's; then we kill them
            if not leftovers():
                break
            time.sleep(0.1)
        _kill(leftovers())
        for _ in range(50):
            if not leftovers():
                break
            time.sleep(0.1)
        out["t_gone"] = time.monotonic() - t0
        for log in logs:
            log.close()
        shutil.rmtree(d, ignore_errors=True)
    out["seconds"] = time.monotonic() - t0
    return out


# ---- report -----------------------------------------------------------------------------------


def mib(x: float) -> str:
    return f"{x / MiB:,.0f}"


def table(results: list[dict[str, Any]], bare: dict[int, dict[str, Any]]) -> str:
    lines = [
        "| R | W | S | baseline PSS MiB | overlord PSS MiB | ratio | baseline loader MiB "
        "| overlord loader MiB | loader ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in results:
        b, o, t = x["baseline"], x["overlord"], bare[x["R"]]["total"]
        lb, lo = b["total"] - t, o["total"] - t
        lines.append(
            f"| {x['R']} | {x['W']} | {x['S']} | {mib(b['total'])} | {mib(o['total'])} "
            f"| {b['total'] / o['total']:.2f}x | {mib(lb)} | {mib(lo)} | {lb / lo:.2f}x |"
        )
    lines += [
        "",
        "Breakdown (PSS MiB; process count in brackets). Bare trainers: R processes that import",
        "torch and train on random tokens, no loader; loader = run total - bare.",
        "",
        "| R | W | S | design | trainers | loader workers | driver | Ray system | actors "
        "| total | bare trainers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in results:
        for kind in ("baseline", "overlord"):
            y = x[kind]
            cells = [f"{mib(y['parts'][c])} [{y['count'][c]}]" for c in CATEGORIES]
            lines.append(
                f"| {x['R']} | {x['W']} | {x['S']} | {kind} | {' | '.join(cells)} "
                f"| {mib(y['total'])} | {mib(bare[x['R']]['total'])} |"
            )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], bare: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, probe_uss = _probe_uss(results)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))

    def curve(ax: Any, pts: list[dict[str, Any]], key: str, title: str) -> None:
        pts = sorted(pts, key=lambda x: x[key])
        xs = [x[key] for x in pts]
        tb = [bare[x["R"]]["total"] / MiB for x in pts]
        for kind, color in (("baseline", "tab:red"), ("overlord", "tab:blue")):
            tot = [x[kind]["total"] / MiB for x in pts]
            ax.plot(
                xs, [a - b for a, b in zip(tot, tb)], "o-", color=color, label=f"{kind}: loader"
            )
            ax.plot(xs, tot, "s--", color=color, alpha=0.45, label=f"{kind}: total")
        proj = [grouped(x, probe_uss) / MiB - b for x, b in zip(pts, tb)]
        ax.plot(
            xs,
            proj,
            "^:",
            color="tab:blue",
            label="overlord: loader, one loader process\nfor all sources (projected)",
        )
        ax.plot(xs, tb, "k:", alpha=0.6, label="bare trainers (no loader)")
        ax.set_xlabel(key)
        ax.set_ylabel("PSS, MiB (loader = total - bare trainers)")
        ax.set_title(title)
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    by_s = [x for x in results if x["R"] == 8 and x["W"] == 2]
    by_r = [x for x in results if x["S"] == 16 and x["W"] == 2]
    if len(by_s) > 1:
        curve(axes[0], by_s, "S", "growth with sources S (R=8 trainers, W=2 workers)")
    if len(by_r) > 1:
        curve(axes[1], by_r, "R", "growth with trainers R (W=2 workers, S=16 sources)")
    ax = axes[2]
    req = [x for x in results if (x["R"], x["W"], x["S"]) in REQUIRED] or results
    colors = ["0.65", "tab:red", "tab:green", "tab:purple", "tab:blue"]
    labels, bars = [], []
    for x in req:
        for kind in ("baseline", "overlord"):
            labels.append(f"{x['R']}x{x['W']}x{x['S']}\n{kind}")
            bars.append([x[kind]["parts"][c] / MiB for c in CATEGORIES])
    bottoms = [0.0] * len(bars)
    for i, c in enumerate(CATEGORIES):
        vals = [b[i] for b in bars]
        ax.bar(range(len(bars)), vals, bottom=bottoms, color=colors[i], label=c)
        bottoms = [a + v for a, v in zip(bottoms, vals)]
    for j, x in enumerate(req):
        t = bare[x["R"]]["total"]
        ax.hlines(t / MiB, 2 * j - 0.4, 2 * j + 1.4, colors="k", linestyles=":")
        ratio = (x["baseline"]["total"] - t) / (x["overlord"]["total"] - t)
        ax.annotate(
            f"loader {ratio:.2f}x\ntotal {x['baseline']['total'] / x['overlord']['total']:.2f}x",
            (2 * j + 0.5, max(bottoms[2 * j], bottoms[2 * j + 1])),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(range(len(bars)), labels, fontsize=7)
    ax.set_ylim(0, max(bottoms) * 1.15)
    ax.set_ylabel("PSS, MiB (dotted: bare trainers)")
    ax.set_title("where the memory goes (R x W x S)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        "Loader memory (PSS of every process): colocated DataLoaders (baseline) vs one "
        "overlord job on Ray, same plan and batches"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _probe_uss(results: list[dict[str, Any]]) -> tuple[float, float]:
    """Median PSS and USS of the idle probe actors: what one more actor process costs."""
    probes = [x["overlord"]["probe"] for x in results if x["overlord"].get("probe")]
    if not probes:
        return 0.0, 0.0
    mid = len(probes) // 2
    return sorted(p["pss"] for p in probes)[mid], sorted(p["uss"] for p in probes)[mid]


def grouped(x: dict[str, Any], probe_uss: float) -> float:
    """Projected overlord total with every source in one loader process (not measured).

    One process less per loader process beyond the first, each costing what an idle actor
    with a SourceLoader's imports costs privately (USS); the state the loaders hold is kept.
    """
    kinds = ("ray::SourceLoader", "ray::LoaderGroup")
    loaders = sum(1 for p in x["overlord"]["procs"] if p["name"].startswith(kinds)) or x["S"]
    return float(x["overlord"]["total"] - (loaders - 1) * probe_uss)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((a - mx) ** 2 for a in xs)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / var
    return slope, my - slope * mx


def summary(results: list[dict[str, Any]], bare: dict[int, dict[str, Any]]) -> str:
    """Where overlord's memory goes, what each source costs, and what grouping would save."""
    probe_pss, probe_uss = _probe_uss(results)
    lines = [
        f"Per-actor overhead (an idle actor with a SourceLoader's imports and concurrency, "
        f"median of the runs): PSS {mib(probe_pss)} MiB, private (USS) {mib(probe_uss)} MiB.",
        "",
    ]
    for x in results:
        if (x["R"], x["W"], x["S"]) not in REQUIRED:
            continue
        o, b, t = x["overlord"], x["baseline"], bare[x["R"]]["total"]
        n, held = o["count"]["actors"], o.get("loaders", [])
        untaken = sum(h["held_tokens"] for h in held) * 4
        state = o["parts"]["actors"] - n * probe_pss
        ray = ", ".join(
            f"{p['name']} {mib(p['pss'])}" for p in o["procs"] if p["category"] == "ray system"
        )
        nw = b["count"]["loader workers"]
        lines += [
            f"R={x['R']} W={x['W']} S={x['S']}:",
            f"  baseline loader {mib(b['total'] - t)} MiB: {nw} DataLoader workers of "
            f"{mib((b['total'] - t) / nw)} MiB (loader memory per worker, fork included).",
            f"  overlord loader {mib(o['total'] - t)} MiB: {n} actors {mib(o['parts']['actors'])}"
            f" = {n} x {mib(probe_pss)} per-actor overhead + {mib(state)} of state and allocator "
            f"retention ({mib(state / max(1, len(held)))} per loader, planner included; "
            f"untaken tokens {untaken / MiB / max(1, len(held)):.1f}; budget "
            f"{(held[0]['budget_tokens'] * 4 / MiB) if held else 0:.1f} per loader); "
            f"trainers {mib((o['parts']['trainers'] - t) / x['R'])} each above bare "
            f"(Ray's core worker and imports); Ray system {mib(o['parts']['ray system'])} "
            f"({ray}); driver {mib(o['parts']['driver'])}.",
            f"  projected, all sources in one SourceLoader process (not measured): overlord "
            f"loader {mib(grouped(x, probe_uss) - t)} MiB, loader ratio "
            f"{(b['total'] - t) / (grouped(x, probe_uss) - t):.2f}x.",
        ]
    per_step = {k: [x[k]["tokens_per_step"] for x in results] for k in ("baseline", "overlord")}
    lines += [
        "",
        f"Tokens per trainer and step: {ROWS} rows of {SEQ} in both designs; real tokens "
        f"(padding excluded) {min(per_step['baseline']):,.0f} in the baseline (rows cut from "
        f"concatenated documents), {min(per_step['overlord']):,.0f} to "
        f"{max(per_step['overlord']):,.0f} with overlord (whole documents packed, padded). "
        f"Every run kept iterating while sampled (at least "
        f"{min(x[k]['steps_while_sampling'] for x in results for k in per_step)} steps per "
        "trainer during the samples).",
    ]
    curve = sorted((x for x in results if x["R"] == 8 and x["W"] == 2), key=lambda x: x["S"])
    if len(curve) >= 2:
        t = bare[8]["total"]
        xs = [float(x["S"]) for x in curve]
        bs, bi = _fit(xs, [(x["baseline"]["total"] - t) / MiB for x in curve])
        os_, oi = _fit(xs, [(x["overlord"]["total"] - t) / MiB for x in curve])
        lines += [
            "",
            f"Loader memory against S at R=8, W=2 (least squares over S = "
            f"{', '.join(str(x['S']) for x in curve)}): baseline {bi:,.0f} + {bs:,.1f} MiB per "
            f"source ({bs / 16:.1f} per source per worker); overlord {oi:,.0f} + {os_:,.1f} MiB "
            f"per source. A source costs overlord less than the colocated loaders only where "
            f"R x W > {os_ / (bs / 16):.0f}.",
        ]
    return "\n".join(lines)


LOADER_PLACEMENT: dict[str, Any] = {}  # set from --loader-processes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only R x W x S = 4 x 2 x 5")
    ap.add_argument("--no-extra", action="store_true", help="only the three required settings")
    ap.add_argument("--png", type=Path, default=Path(__file__).with_suffix(".png"))
    ap.add_argument("--json", type=Path, help="also write every sample's numbers here")
    ap.add_argument(
        "--loader-processes",
        type=int,
        help="overlord: SourceLoaders in this many processes (placement.loader_processes)",
    )
    ap.add_argument("--child", choices=["trainer", "driver"], help=argparse.SUPPRESS)
    for opt in ("--mode", "--dir", "--job", "--plan", "--sources"):
        ap.add_argument(opt, help=argparse.SUPPRESS)
    for opt in ("--rank", "--workers", "--seed"):
        ap.add_argument(opt, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.loader_processes:
        LOADER_PLACEMENT["loader_processes"] = a.loader_processes
    if a.child == "trainer":
        return trainer_main(a)
    if a.child == "driver":
        return driver_main(a)

    if private_netns() is None:
        print(
            "warning: not in a private network namespace: Ray may listen on the machine's "
            "address; run it as: tools/loopback .venv/bin/python -m benchmarks.memory",
            file=sys.stderr,
        )
    stale = leftovers()
    if stale:
        print(f"error: processes of an earlier run are still alive: {sorted(stale)}")
        return 1
    settings = REQUIRED[:1] if a.quick else REQUIRED + ([] if a.no_extra else EXTRA)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="overlord-memory-") as tmp:
        root = Path(tmp)
        sources = make_corpus(root, max(s for _, _, s in settings))
        plans = {}
        for r, _, s in settings:
            if (r, s) not in plans:
                plans[(r, s)] = write_plan(root, sources[:s], r)
        print(
            f"{os.cpu_count()} CPU cores; {len(settings)} settings; rows of {SEQ} tokens, "
            f"{ROWS} per rank and step\n",
            flush=True,
        )
        bare: dict[int, dict[str, Any]] = {}
        done_overlord: dict[tuple[int, int], dict[str, Any]] = {}
        results = []
        for r, w, s in settings:
            if r not in bare:
                bare[r] = measure("bare", root, r, 0, s, plans[(r, s)], "none")
            base = measure("baseline", root, r, w, s, plans[(r, s)], "none")
            if (r, s) not in done_overlord:
                job = f"mem-{r}-{s}-{os.getpid()}"
                probe = (r, w, s) in REQUIRED
                done_overlord[(r, s)] = measure(
                    "overlord", root, r, 0, s, plans[(r, s)], job, probe
                )
            o = done_overlord[(r, s)]
            results.append({"R": r, "W": w, "S": s, "baseline": base, "overlord": o})
            tb = bare[r]["total"]
            print(
                f"R={r} W={w} S={s}: baseline {mib(base['total'])} MiB ({base['seconds']:.0f} s),"
                f" overlord {mib(o['total'])} MiB ({o['seconds']:.0f} s), bare {mib(tb)} MiB: "
                f"total {base['total'] / o['total']:.2f}x, loader "
                f"{(base['total'] - tb) / (o['total'] - tb):.2f}x",
                flush=True,
            )
    print()
    print(table(results, bare))
    print()
    print(summary(results, bare))
    plot(results, bare, a.png)
    written = [str(a.png)]
    if a.json:
        a.json.write_text(json.dumps({"bare": bare, "results": results}, indent=1))
        written.append(str(a.json))
    print(f"\nwrote {' and '.join(written)}; {time.monotonic() - t_start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
