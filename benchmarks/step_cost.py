"""CPU time per step of the embedded runtime, fitted over sources, DP ranks and tokens per step.

The corpus: ``--files`` flat token files (``.npy``, uint16 ids, documents ending with eos 0)
of ``--tokens`` ids in all, document lengths drawn from a long-tailed law (median about 500
ids), written once. A cell of the grid is a plan of ``S`` sources (each a clone reading the
same files, so that only the count changes), ``dp`` DP ranks and ``T`` tokens per step (rows
of ``min(8192, T / dp)`` ids). Pre-tokenized ids keep the tokenizer out of the figure: what
is measured is overlord's own per-step work (planning, balancing, consumption, taking and
packing).

Each cell runs in a fresh process: ``overlord.Loader(plan)`` (embedded runtime, every role an
object in this process), a client per DP rank, warm-up steps, then ``--steps`` steps (every
rank's batch taken in turn) timed by ``time.process_time`` (every thread of the process).
The warm-up is ``--warmup`` steps and, before them, as many as it takes every source to read
its first window (:func:`fill_steps`): a loader reads its first window ahead once, when the
run starts, and a run of many sources that timed its first steps would count each source's
start as work per step (32 sources at 32K tokens per step read 64M ids before their first
window is used up). A least-squares fit over the cells then gives::

    CPU per step = fixed + a * (dp - 1) + b * (sources - 1) + c * tokens

and the figures are printed beside their targets, with CPU per token at the small and the
large step (a per-token cost that rises with the step is a super-linear term)::

    .venv/bin/python -m benchmarks.step_cost            # a few minutes on 2 cores
    .venv/bin/python -m benchmarks.step_cost --quick    # fewer steps, about a minute
    .venv/bin/python -m benchmarks.step_cost --profile 8,8,32768   # cProfile of one cell, calls
    .venv/bin/python -m benchmarks.step_cost --baseline ../before  # each cell there, then here
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._lib.timing import REPO, module_command

EOS = 0
TARGETS = {"fixed": 200e-6, "per_rank": 40e-6, "per_source": 10e-6}


def write_corpus(root: Path, files: int, tokens: int, seed: int = 0) -> None:
    """``files`` .npy token files of ``tokens`` ids in all, documents ending with eos."""
    rng = np.random.default_rng(seed)
    per = tokens // files
    for k in range(files):
        lengths = rng.lognormal(6.2, 1.0, size=per // 300 + 16).astype(np.int64) + 1
        lengths = np.minimum(lengths, 40_000)
        lengths = lengths[np.cumsum(lengths) <= per]
        ids = rng.integers(1, 60_000, size=int(lengths.sum()), dtype=np.uint16)
        ids[np.cumsum(lengths) - 1] = EOS
        np.save(root / f"part-{k:03d}.npy", ids)


def fill_steps(sources: int, step_tokens: int, file_tokens: int) -> int:
    """Steps until every source has used up its first window (read ahead when it starts).

    A source's first window is the ids of ``shuffle.window_blocks`` blocks of
    ``shuffle.block_bytes`` (uint16 ids: two bytes each), or its first file if smaller.
    """
    from overlord.plan.spec import ShuffleSpec

    shuffle = ShuffleSpec()
    window = min(file_tokens, shuffle.block_bytes * shuffle.window_blocks // 2)
    return -(-sources * window // step_tokens)


def write_plan(root: Path, sources: int, dp: int, tokens: int) -> Path:
    """The cell's plan: ``sources`` clones of the corpus, ``dp`` ranks, ``tokens`` per step."""
    import yaml

    seq = min(8192, tokens // dp)
    plan = {
        "seed": 1,
        "sources": [
            {"name": f"s{k:02d}", "format": "tokens", "path": "part-*.npy", "eos_id": EOS}
            for k in range(sources)
        ],
        "batch": {"tokens_per_step": tokens, "max_seq_len": seq},
        "world": {"dp": dp},
    }
    path = root / f"plan-{sources}-{dp}-{tokens}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def run_cell(root: Path, sources: int, dp: int, tokens: int, warmup: int, steps: int,
             profile: str | None = None) -> dict[str, float]:  # fmt: skip
    """CPU seconds per step of one cell, in this process."""
    import overlord

    profiles: list[Any] = []
    if profile:
        import cProfile
        import threading

        def start(*_: Any) -> None:  # the first event of a new thread: profile that thread
            prof = cProfile.Profile(time.thread_time)
            profiles.append(prof)
            prof.enable()

        threading.setprofile(start)
    loader = overlord.Loader(write_plan(root, sources, dp, tokens), runtime="inline")
    try:
        clients = [iter(loader.client(r)) for r in range(dp)]
        seen = 0

        def step() -> int:
            return sum(next(c).num_tokens for c in clients)

        for _ in range(warmup):
            step()
        warm: list[dict[Any, Any]] = []  # each profile as it stood after the warm-up
        if profile:
            for prof in profiles:
                prof.snapshot_stats()
                warm.append(dict(prof.stats))
            start()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            seen += step()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    finally:
        loader.close()
    if profile:
        import pstats

        threading.setprofile(None)  # type: ignore[arg-type]
        profiles[-1].disable()
        parts = []
        for prof, before in itertools.zip_longest(profiles, warm, fillvalue={}):
            prof.snapshot_stats()
            parts.append(_Made(_timed_part(prof.stats, before)))
        # (pstats.Stats(prof) would make prof's stats again, warm-up included)
        stats = pstats.Stats(parts[0])  # type: ignore[arg-type]
        for part in parts[1:]:
            stats.add(part)
        stats.dump_stats(profile)
    return {"cpu_per_step": cpu / steps, "wall_per_step": wall / steps,
            "tokens_per_step": seen / steps}  # fmt: skip


class _Made:
    """Stats made already, as ``pstats.Stats`` loads a profile (its ``create_stats``: nothing)."""

    def __init__(self, stats: dict[Any, Any]):
        self.stats = stats

    def create_stats(self) -> None:
        pass


def _timed_part(stats: dict[Any, Any], before: dict[Any, Any]) -> dict[Any, Any]:
    """A thread's profile less what it held after the warm-up: the timed steps' part.

    Callers' figures are dropped (a caller's share is not subtracted), so a
    profile written here answers by function, not by call graph.
    """
    out = {}
    for func, (cc, nc, tt, ct, _) in stats.items():
        bcc, bnc, btt, bct, _ = before.get(func, (0, 0, 0.0, 0.0, {}))
        if nc > bnc:
            out[func] = (cc - bcc, nc - bnc, tt - btt, ct - bct, {})
    return out


def fit(cells: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares: cost = fixed + a (dp - 1) + b (sources - 1) + c tokens.

    Relative errors are minimised (each cell weighted by 1 / its cost), so that the
    large cells do not drown the small ones the fixed terms are read from.
    """
    x = np.array([[1.0, c["dp"] - 1, c["sources"] - 1, c["tokens"]] for c in cells])
    y = np.array([c["cpu_per_step"] for c in cells])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    resid = y - x @ coef
    return {"fixed": float(coef[0]), "per_rank": float(coef[1]), "per_source": float(coef[2]),
            "per_token": float(coef[3]),
            "rel_residual": float(np.sqrt(np.mean((resid / y) ** 2)))}  # fmt: skip


def measure(
    root: Path, cell: tuple[int, int, int], args: argparse.Namespace, repo: Path = REPO
) -> dict[str, Any]:
    """One cell, in a fresh process of checkout ``repo`` (its ``overlord`` imported)."""
    sources, dp, tokens = cell
    steps = max(args.min_steps, args.tokens_timed // tokens)
    warmup = args.warmup + fill_steps(sources, tokens, args.tokens // args.files)
    cmd = [*module_command("step_cost"), "--cell", f"{sources},{dp},{tokens}",
           "--corpus", str(root), "--warmup", str(warmup), "--steps", str(steps)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"cell {cell} failed in {repo}:\n{out.stderr[-4000:]}")
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return {"sources": sources, "dp": dp, "tokens": tokens, **got}


def report(cells: list[dict[str, Any]]) -> None:
    print(f"{'sources':>7} {'dp':>4} {'tokens/step':>11} {'CPU us/step':>12} {'ns/token':>9}")
    for c in cells:
        print(f"{c['sources']:7d} {c['dp']:4d} {c['tokens']:11d} {c['cpu_per_step'] * 1e6:12.0f} "
              f"{c['cpu_per_step'] / c['tokens'] * 1e9:9.1f}")  # fmt: skip
    f = fit(cells)
    print(f"\nfit: CPU per step = fixed + a (dp - 1) + b (sources - 1) + c tokens "
          f"(RMS relative residual {f['rel_residual']:.0%})")  # fmt: skip
    labels = {"fixed": "fixed cost at dp 1, one source", "per_rank": "per extra DP rank",
              "per_source": "per extra source"}  # fmt: skip
    for key, label in labels.items():
        print(f"  {label:32} {f[key] * 1e6:9.1f} us   target <= {TARGETS[key] * 1e6:.0f} us")
    print(f"  {'per token':32} {f['per_token'] * 1e9:9.2f} ns")
    small, large = min(c["tokens"] for c in cells), max(c["tokens"] for c in cells)
    ratios = []
    for _, group in itertools.groupby(
        sorted(cells, key=lambda c: (c["sources"], c["dp"], c["tokens"])),
        key=lambda c: (c["sources"], c["dp"]),
    ):
        by = {c["tokens"]: c["cpu_per_step"] / c["tokens"] for c in group}
        if small in by and large in by:
            ratios.append(by[large] / by[small])
    if ratios:
        print(f"  CPU per token at {large} vs {small} tokens per step: median ratio "
              f"{statistics.median(ratios):.2f} over {len(ratios)} (sources, dp) pairs "
              f"(target: not rising, <= 1)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sources", default="1,8,32")
    p.add_argument("--dp", default="1,8,64")
    p.add_argument("--step-tokens", default="32768,524288")
    p.add_argument("--tokens", type=int, default=8_000_000, help="ids in the corpus")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--tokens-timed", type=int, default=24_000_000,
                   help="tokens per timed cell (steps = this / tokens per step)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="fewer steps per cell")
    p.add_argument("--profile", metavar="S,DP,T", help="cProfile one cell; print its top")
    p.add_argument("--pstats", type=Path, help="with --profile: keep the profile here")
    p.add_argument("--json", type=Path, help="write the cells and the fit here")
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="another checkout (e.g. a git worktree of the commit before): each cell runs "
        "there, then here, so that the machine's load hits both alike",
    )
    args = p.parse_args()
    if args.cell:
        s, d, t = (int(v) for v in args.cell.split(","))
        got = run_cell(Path(args.corpus), s, d, t, args.warmup, args.steps)
        print(json.dumps(got))
        return
    if args.quick:
        args.min_steps, args.tokens_timed, args.tokens = 8, 4_000_000, 4_000_000
    with tempfile.TemporaryDirectory(prefix="overlord-stepcost-") as tmp:
        root = Path(tmp)
        write_corpus(root, args.files, args.tokens)
        if args.profile:
            import pstats

            s, d, t = (int(v) for v in args.profile.split(","))
            out = args.pstats or root / "step.pstats"
            steps = max(args.min_steps, args.tokens_timed // t)
            warmup = args.warmup + fill_steps(s, t, args.tokens // args.files)
            got = run_cell(root, s, d, t, warmup, steps, str(out))
            print(json.dumps(got))
            stats = pstats.Stats(str(out))
            # a count that does not move with the machine's load, as CPU time does
            print(f"{stats.total_calls / steps:.0f} Python calls per step, every thread")
            stats.sort_stats("tottime").print_stats(30)
            return
        grid = itertools.product(*(map(int, v.split(",")) for v in
                                   (args.sources, args.dp, args.step_tokens)))  # fmt: skip
        cells, base = [], []
        for cell in grid:
            if args.baseline:
                base.append(measure(root, cell, args, args.baseline.resolve()))
            cells.append(measure(root, cell, args))
    print(f"embedded runtime, pre-tokenized corpus; CPU by time.process_time, "
          f"{args.warmup} warm-up steps after every source's first window, "
          f"then >= {args.min_steps} timed per cell")  # fmt: skip
    if base:
        print(f"\nbaseline ({args.baseline}):")
        report(base)
        print(f"\nthis checkout ({REPO}):")
    report(cells)
    if args.json:
        out: dict[str, Any] = {"cells": cells, "fit": fit(cells)}
        if base:
            out["baseline"] = {"dir": str(args.baseline), "cells": base, "fit": fit(base)}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
