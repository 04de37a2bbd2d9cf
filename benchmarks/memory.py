"""Loader memory against colocated loaders, swept over the per-source state a loader holds.

What is measured: the total proportional set size (PSS, ``/proc/PID/smaps_rollup``) of every
process of a run, at steady state (the largest of several samples taken while the trainers
iterate, after a warm-up). PSS splits each shared page among the processes that map it, so
the sum over a run's processes is the memory the run takes, counted once.

Three designs (``--designs``, default all three) feed R trainer processes (plain Python
processes standing in for DP ranks; they import torch, as trainers do), the same mixture of
the same S sources, the same batch shape (rows of ``max_seq_len`` tokens per rank and step)
and the same tokenizer (``--tokenizer``: ``bpe``, the byte-level BPE of 8,000 tokens that
``benchmarks/throughput_vs.py`` trains, a ``tokenizers`` tokenizer; or ``bytes``):

- **baseline**, the colocated design: each trainer iterates a
  ``torch.utils.data.DataLoader(num_workers=W)`` (fork) whose every worker opens every
  source and holds, per source, its open file, its line index and the per-source *state*
  (``--state``, ``benchmarks/_lib/colocated.py``): ``index`` (nothing more: a document is
  read by a seek), or ``shuffle:<N>MB`` (a shuffle buffer of N MiB of the source's records,
  filled before the first document, as HuggingFace's ``shuffle(buffer_size)`` is), or
  ``images[:<N>MB]`` (the sources are image-text WebDataset tars of generated JPEGs of mixed
  sizes; a read-ahead buffer of N MiB, default 16, of decoded samples: each image decoded
  by plain Pillow, resized by the vision rule, cut into float32 normalized patches, with its
  caption). Each worker loads one tokenizer; it mixes sources by weight and packs rows (at
  ``images``: image tokens, one per 4 patches, then the caption; a batch carries its
  samples' float32 ``pixel_values``; 1 row per rank and step, ``IMAGE_ROWS``).
- **overlord**: a driver process runs ``Loader(plan, runtime="ray", job=...)`` (a local Ray
  instance; all SourceLoaders in ``--loader-processes`` processes; one Planner; batches built
  in each trainer: ``placement.constructors: trainer``; ``shadows`` from ``--shadows``); the
  R trainers call ``overlord.connect(job, rank)``. It holds the same shuffle state once per
  source: its window (``shuffle: {block_bytes, window_blocks}``) is N MiB of the same
  records; a loader holds the window being cut and at most one read ahead, plus its
  read-ahead of tokens (its budget, by the source's share of the mixture). At ``index``
  its window is one block of 64 KiB (overlord has no window-free mode). At ``images`` the
  plan has a ``vision:`` section and a window of about as many images as a worker's buffer
  (``images_shuffle``; held encoded), and the read-ahead holds uint8 patches.
- **overlord-node**, overlord's node mode (one node, no Ray): the R trainers are started
  with the variables ``torchrun --standalone`` sets (``WORLD_SIZE``, ``RANK``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``;
  torchrun's agent process is not run: a DP job's trainers have a launcher in every design,
  so it is no loader's cost) and each calls
  ``overlord.Loader(plan, runtime="inline").client(rank)``: a ``Loader`` in node mode
  hosted by rank 0 (the data process, the default under torchrun, is
  ``benchmarks/node_memory.py``'s), whose rank 0 runs the embedded Loader (every SourceLoader as
  threads in rank 0's process, the planner, the constructors) and sends each other rank its
  batches over gloo. The Ray design's plan with ``world.dp = R`` and no standby (``shadows: 0``).
  The report splits its memory between rank 0 and the other trainers.

Sources are clones of 4 base sources (the records of ``overlord demo``'s sources, repeated
into one JSONL file each of at least 2 windows of the largest state): source k is a
symlink to base file ``k % 4`` with that base's weight.

Every process of a run is counted: the trainers, their DataLoader workers, the driver and all
of Ray's processes (GCS, raylet, agents, idle workers, actors), found as descendants of the
processes this script starts and as every process of the loopback network namespace the
script runs in. A **bare** run (R trainers that import torch and train on random tokens, no
loader) gives what the trainers cost without any loader; ``loader memory`` is a run's total
less that.

The target is R x W x S = 8 x 4 x 32; what does not fit this machine (24 GiB shared) is
measured smaller and carried there: the baseline is measured with one trainer (R=1; each
trainer's DataLoader is independent, so R trainers cost R times its loader memory) at the
largest S that fits, or at two S and along the line through them; overlord (either mode) at
R=8 and the largest S that fits, or along the line through two S. The report says which
figures are measured and which carried, and from what. The index-only target (8 x 2 x 16) is
measured.

Run (Ray must stay on loopback; about 40 minutes on 2 cores, ``--quick`` about 5)::

    tools/loopback .venv/bin/python -m benchmarks.memory [--quick] [--state index,shuffle:16MB]
        [--shadows 0,1] [--designs baseline,overlord,overlord-node] [--tokenizer bpe|bytes]
        [--json results.json [--resume]]

``--resume`` keeps the runs ``--json`` holds (those of earlier sweeps too: a run's ``kind``
is its design) and measures the others; with ``--designs`` naming fewer designs, the kept
runs of the others are reported beside the new ones.

It prints Markdown tables and writes the plot ``benchmarks/memory.png`` (``--png``).
Peak memory of one run: about 8 GiB (overlord at shuffle:16MB x 32 sources with a standby);
at ``images``, 5.2 GiB (the baseline at images:64MB, S=16). ``--state images,images:64MB``
takes about 8 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._lib.colocated import (
    MiB,
    baseline_batches,
    image_batches,
    make_corpus,
    make_image_corpus,
    parse_state,
)
from benchmarks._lib.memory_cells import (
    DESIGNS,
    IMAGE_ROWS,
    NODE,
    ROWS,
    SEQ,
    Cell,
    keys,
    parse_designs,
    plan_cells,
    rows_of,
    run_key,
    write_plan,
)
from benchmarks._lib.memory_report import TARGET, mib, plot, report
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

PACE = 0.05  # seconds of simulated training per step
WARM = 8  # steps every trainer takes before the first sample
SAMPLES = 5  # PSS samples per run, SAMPLE_EVERY seconds apart; the largest total is reported
SAMPLE_EVERY = 0.5

STATES = "index,shuffle:4MB,shuffle:16MB,shuffle:64MB"
QUICK = (2, 2, 4)


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
        from torch.utils.data import DataLoader, IterableDataset

        import benchmarks._lib.colocated  # noqa: F401 (the dataset module, before the fork)

        sources = json.loads(Path(a.sources).read_text())
        state, tok = parse_state(a.state), a.tokenizer or None

        make = image_batches if state.kind == "images" else baseline_batches

        class Mixed(IterableDataset):
            def __iter__(self) -> Iterator[Any]:
                return make(sources, state, tok, rows_of(a.state), SEQ, rank, a.seed)

        loader = DataLoader(Mixed(), batch_size=None, num_workers=a.workers, prefetch_factor=2)
        batches: Iterator[Any] = iter(loader)
    elif a.mode == "overlord":
        import overlord
        from overlord.torch import to_torch

        def stream() -> Iterator[Any]:
            for b in overlord.connect(a.job, rank):
                yield {**to_torch(b), "tokens": b.num_tokens}

        batches = stream()
    elif a.mode == NODE:
        batches = _node_stream(a, d)
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
    if a.mode in ("overlord", NODE):
        # measured already: not waiting for the client's goodbye to the job, nor for every
        # rank to reach the node's stop step
        os._exit(0)
    del batches, loader  # joins the DataLoader's workers
    return 0


def _write_stats(d: Path, stats: list[dict[str, Any]]) -> None:
    keep = ("source", "held_tokens", "held_shards", "budget_tokens", "shards")
    (d / "stats.tmp").write_text(json.dumps([{k: s[k] for k in keep} for s in stats]))
    os.replace(d / "stats.tmp", d / "stats.json")


def _node_stream(a: argparse.Namespace, d: Path) -> Iterator[dict[str, Any]]:
    """This rank's batches in node mode hosted by rank 0, under torchrun's variables.

    Rank 0's process runs the node's one embedded Loader; it answers the stats request.
    """
    import overlord
    from overlord.dist.node import NodeClient
    from overlord.torch import to_torch

    loader = overlord.Loader(a.plan, runtime="inline")  # rank 0 hosts (the design measured)
    if not loader.node:
        raise RuntimeError(f"expected node mode under torchrun's variables, got {loader!r}")
    client = loader.client(a.rank)
    assert isinstance(client, NodeClient)
    for b in client:
        if a.rank == 0 and (d / "stats-req").exists() and not (d / "stats.json").exists():
            _write_stats(d, loader.stats()["loaders"])
        yield {**to_torch(b), "tokens": b.num_tokens}


def driver_main(a: argparse.Namespace) -> int:
    """The overlord job: a Loader on a local Ray instance, until told to stop."""
    import ray

    from overlord import Loader, load_plan

    d = Path(a.dir)
    plan = load_plan(a.plan)
    with Loader(plan, runtime="ray", job=a.job) as loader:
        (d / "ready.tmp").write_text(ray.get_runtime_context().gcs_address)
        os.replace(d / "ready.tmp", d / "ready")
        while not (d / "stop").exists():
            if (d / "stats-req").exists() and not (d / "stats.json").exists():
                _write_stats(d, loader.stats()["loaders"])
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


def free_port() -> int:
    """A TCP port free on loopback now, for the node's rendezvous (``MASTER_PORT``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_env(ranks: int, port: int) -> list[dict[str, str]]:
    """What ``torchrun --standalone --nproc_per_node ranks`` sets in each rank's process.

    The agent torchrun would add (a process of its own) is not run: the benchmark is it.
    Gloo on the loopback interface (the only one in ``tools/loopback``'s namespace).
    """
    common = {
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    return [{**common, "RANK": str(k), "LOCAL_RANK": str(k)} for k in range(ranks)]


def measure(cell: Cell, root: Path, plan: Path | None, extra: list[str]) -> dict[str, Any]:
    """Run one design on (R, W, S) at a state; return its steady-state PSS.

    ``extra``: the trainers' arguments for the dataset (sources, state, tokenizer).
    """
    kind, r, w, s = cell.kind, cell.r, cell.w, cell.s
    t0 = time.monotonic()
    d = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root))
    me = module_command("memory")  # run from REPO, where ``benchmarks`` imports
    # one thread per tokenizer in every process of both designs (the tokenizers docs'
    # advice for forked workers): no thread pools counted on either side
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    logs = []

    def start(args: list[str], more: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(d / f"log-{len(logs)}.txt", "wb")  # noqa: SIM115 (closed below)
        logs.append(log)
        return subprocess.Popen(
            me + args, env={**env, **(more or {})}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )

    job = f"mem-{os.getpid()}-{d.name}"
    common = ["--dir", str(d), "--job", job, "--seed", "7"]
    driver = None
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"kind": kind, "R": r, "W": w, "S": s, "state": cell.state}
    out["shadows"] = cell.shadows
    try:
        if kind == "overlord":
            driver = start(["--child", "driver", "--plan", str(plan), *common])
            procs.append(driver)
            _wait("the overlord job", (d / "ready").exists, procs, 600)
            env["RAY_ADDRESS"] = (d / "ready").read_text()
            out["t_ready"] = time.monotonic() - t0
        node = torchrun_env(r, free_port()) if kind == NODE else None
        for rank in range(r):
            args = ["--child", "trainer", "--mode", kind, "--rank", str(rank), "--workers", str(w)]
            args += ["--plan", str(plan)] if kind == NODE else []
            procs.append(start([*args, *extra, *common], node[rank] if node else None))
        ranks = [p.pid for p in procs if p is not driver]  # in rank order
        trainers = set(ranks)
        _wait(
            f"{WARM} steps on every rank",
            lambda: min(st for st, _ in _progress(d, r)) >= WARM,
            procs,
            900,
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
        pss = {x["pid"]: x["pss"] for x in best["procs"]}
        out["trainer_pss"] = [pss.get(pid, 0) for pid in ranks]  # rank 0 first
        out["steps_while_sampling"] = min(a[0] - b[0] for a, b in zip(after, before))
        out["tokens_per_step"] = after[0][1] / after[0][0]
        if kind in ("overlord", NODE):
            (d / "stats-req").touch()
            _wait("the loaders' stats", (d / "stats.json").exists, procs, 60)
            out["loaders"] = json.loads((d / "stats.json").read_text())
    except Exception as e:
        for i, _ in enumerate(logs):
            tail = (d / f"log-{i}.txt").read_text(errors="replace")[-3000:]
            if tail.strip():
                print(f"--- log {i} ---\n{tail}", file=sys.stderr)
        raise RuntimeError(f"{kind} R={r} W={w} S={s}: {e}") from e
    finally:
        out["t_stop"] = time.monotonic() - t0
        (d / "stop").touch()
        deadline = time.monotonic() + 20
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


# ---- main -------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"R x W x S = {' x '.join(map(str, QUICK))}, index and shuffle:4MB",
    )
    ap.add_argument("--state", default=None, help=f"comma-separated states (default {STATES})")
    ap.add_argument("--shadows", default="0,1", help="overlord's shadows per source: 0, 1 or 0,1")
    ap.add_argument(
        "--designs",
        default=",".join(DESIGNS),
        help=f"designs to measure (default {','.join(DESIGNS)}; runs of the others that "
        "--resume keeps are reported beside them)",
    )
    ap.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe")
    ap.add_argument(
        "--loader-processes",
        type=int,
        default=1,
        help="overlord: SourceLoaders in this many processes (0: one per source)",
    )
    ap.add_argument("--png", type=Path, default=Path(__file__).with_suffix(".png"))
    ap.add_argument("--json", type=Path, help="also write every run's numbers here (as it goes)")
    ap.add_argument(
        "--resume", action="store_true", help="keep the runs --json holds; measure the others"
    )
    ap.add_argument("--child", choices=["trainer", "driver"], help=argparse.SUPPRESS)
    for opt in ("--mode", "--dir", "--job", "--plan", "--sources", "--tok"):
        ap.add_argument(opt, help=argparse.SUPPRESS)
    for opt in ("--rank", "--workers", "--seed"):
        ap.add_argument(opt, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "trainer":
        a.tokenizer = a.tok
        return trainer_main(a)
    if a.child == "driver":
        return driver_main(a)
    try:
        states = [
            parse_state(t)
            for t in (a.state or ("index,shuffle:4MB" if a.quick else STATES)).split(",")
        ]
        shadows = sorted({int(x) for x in a.shadows.split(",")})
        designs = parse_designs(a.designs)
    except ValueError as e:
        ap.error(str(e))
    if any(sh not in (0, 1) for sh in shadows):
        ap.error(f"--shadows {a.shadows!r}: expected 0, 1 or 0,1")

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
    target = QUICK if a.quick else TARGET
    cells = plan_cells(states, shadows, target, a.quick, designs)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="overlord-memory-") as tmp:
        root = Path(tmp)
        biggest = max([st.bytes for st in states if st.kind != "images"] + [0])
        sources = make_corpus(root, max(c.s for c in cells), max(8 * MiB, 2 * biggest + MiB))
        image_sources = (
            make_image_corpus(root, max(c.s for c in cells))
            if any(st.kind == "images" for st in states)
            else []
        )
        tok = None
        if a.tokenizer == "bpe":
            from benchmarks._lib.corpus import train_bpe

            tok = str(train_bpe({"all": [root / "train.jsonl"]}, root / "bpe.json", 8000))
        print(
            f"{os.cpu_count()} CPU cores; {len(cells)} runs; tokenizer {a.tokenizer}; rows of "
            f"{SEQ} tokens, {ROWS} per rank and step ({IMAGE_ROWS} at images); overlord's "
            "SourceLoaders in "
            f"{a.loader_processes or 'one per source'} process(es)\n",
            flush=True,
        )
        runs: list[dict[str, Any]] = []
        if a.resume and a.json and a.json.exists():
            runs = json.loads(a.json.read_text())["runs"]
        done = {run_key(x) for x in runs}
        for c in cells:
            if keys(c, target) & done:
                continue  # measured already (--resume), at this S or at the target's
            src = root / f"sources-{c.state.split(':')[0] or 'index'}-s{c.s}.json"
            these = (image_sources if c.state.startswith("images") else sources)[: c.s]
            src.write_text(json.dumps(these))
            extra = ["--sources", str(src), "--tok", tok or "", "--state", c.state or "index"]
            plan = None
            if c.kind in ("overlord", NODE):
                plan = write_plan(
                    root,
                    these,
                    c.r,
                    parse_state(c.state),
                    tok,
                    c.shadows,
                    a.loader_processes or None,
                )
            m = measure(c, root, plan, extra)
            runs.append(m)
            if a.json:  # as it goes: a sweep cut short keeps what it measured (--resume)
                a.json.write_text(json.dumps({"runs": runs}, indent=1))
            print(
                f"{c.kind} {c.state or '-'} shadows {c.shadows} R={c.r} W={c.w} S={c.s}: "
                f"{mib(m['total'])} MiB ({m['seconds']:.0f} s)",
                flush=True,
            )
    # --resume: only this sweep's cells, of every design (the others' earlier runs too)
    every = plan_cells(states, shadows, target, a.quick)
    keep = set().union(*(keys(c, target) for c in every))
    runs = [x for x in runs if run_key(x) in keep]
    text, rows = report(runs, states, shadows, target)
    print()
    print(text)
    plot(rows, target, a.png)
    written = [str(a.png)]
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "target": rows}, indent=1))
        written.append(str(a.json))
    print(f"\nwrote {' and '.join(written)}; {time.monotonic() - t_start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
