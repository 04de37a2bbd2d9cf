"""``overlord simulate``: a plan's run, planned on its real metadata, before any trainer starts.

The planner plans every step as a run would (:meth:`overlord.Loader.dry_run`,
one step at a time, timed): the loaders read and tokenize the plan's files to
learn each item's length, as planning needs, and keep no payload; no batch is
built and nothing is packed into arrays. What the planner records of each
step (:func:`overlord.plan.step.plan_step`'s statistics) is then summed into:

- each source's tokens and samples, its share against the schedule's target
  (over the run, and between each pair of schedule points), and how many
  epochs of it the run reads;
- balance by the plan's cost model *as written* (``balance.cost``): the most
  loaded rank's cost per step over the lower bound ``max(total / dp, largest
  item)``, for the plan's method and for two loaders that do not balance:
  per-rank packing (each rank packs its own share of the stream: the step's
  reference rows cut into contiguous blocks, overlord's ``none``) and
  equal documents (every rank the same number of the step's items, unpacked:
  :func:`overlord.plan.step.equal_docs_max_cost`); each baseline's step time
  over the plan's, summed over the steps, is the speed-up the cost model
  predicts;
- the planner's seconds per step at the plan's DP;
- the memory of each source's loaders by the read-ahead rules
  (:func:`overlord.plan.budget.token_budget`,
  :class:`overlord.roles.read_ahead.ReadAhead`);
- the CPU the loaders spend per token, as they measured it while the
  simulation read (:class:`overlord.roles.read_stats.ReadStats`), and with
  ``step_seconds`` the cores that tokenizing needs to keep up.

Keys of the result (and of ``--json``), a JSON object:

- ``steps``, ``dp``, ``seconds`` (the simulation's wall time);
- ``cost_model``: ``alpha``, ``beta`` (those of the plan, not refitted);
- ``sources``: per source name, ``tokens``, ``samples``, ``share``, ``target``,
  ``read_tokens`` (what its loaders tokenized, read-ahead included),
  ``epochs`` (whole epochs read plus the bytes of the current epoch's shards
  passed, to half a shard), ``cpu_s_per_token``, ``tokens_per_step`` (mean),
  ``peak_tokens_per_step``,
  ``cpu_s_per_step`` (mean), ``cores`` (at ``peak_tokens_per_step``, the
  schedule's target at the source's highest share in the run; None without
  ``step_seconds``) and
  ``memory`` (bytes: ``held``, ``text``, ``per_loader``, ``per_shadow``,
  ``loaders``, ``shadows``, ``total``);
- ``segments``: between schedule points, ``steps`` ``[first, end)``, and
  per source ``share`` and ``target``;
- ``balance``: ``method``; ``max_over_lb`` (mean, p95) for the plan's method,
  ``per_rank_packing`` and ``equal_docs``; ``speedup_vs_per_rank_packing``
  and ``speedup_vs_equal_docs``;
- ``planner``: ``first_s`` (the first step, which waits for the loaders to
  start), then ``mean_s``, ``p50_s``, ``p95_s``, ``max_s`` per step over the
  others;
- ``memory_bytes``, ``cpu_s_per_step``, ``step_seconds`` and ``cores``: the
  sums over the sources.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from overlord.errors import OutputError
from overlord.loader import Loader
from overlord.plan.budget import token_budget
from overlord.plan.cost import CostModel
from overlord.plan.kinds import Format
from overlord.plan.spec import Plan
from overlord.roles.read_ahead import LEAD_SHARE
from overlord.sources.catalog import SourceFiles
from overlord.sources.shard import shard_order
from overlord.sources.window import PIECE_BYTES

# what a held item costs beside its int32 tokens: its start (int64), length (int32), row
# (int64), chunk and patches (int32) in overlord.sources.shard.ShardItems
ITEM_BYTES = 8 + 4 + 8 + 4 + 4
TOKEN_BYTES = 4  # a held token: int32


def simulate(
    plan: Plan, steps: int, step_seconds: float | None = None, progress: bool = False
) -> dict[str, Any]:
    """Plan ``steps`` steps of ``plan`` from its start, without batches; the figures above."""
    from overlord.ops.run import _progress

    if steps < 1:
        raise ValueError(f"a simulation plans at least one step, asked for {steps}")
    t0 = time.perf_counter()
    hist: list[dict[str, Any]] = []
    times = np.zeros(steps)
    with Loader(plan, build_batches=False) as loader:
        bar = _progress(steps, 0, "overlord simulate") if progress else None
        for k in range(steps):
            t = time.perf_counter()
            hist += loader.dry_run(1)
            times[k] = time.perf_counter() - t
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        loaders = loader.stats()["loaders"]
        files = dict(loader.files)
    return summarize_simulation(plan, hist, times, loaders, files, step_seconds, t0)


def summarize_simulation(
    plan: Plan,
    hist: list[dict[str, Any]],
    times: np.ndarray,
    loaders: list[dict[str, Any]],
    files: dict[str, SourceFiles],
    step_seconds: float | None,
    t0: float,
) -> dict[str, Any]:
    """The figures of a simulation from the planner's history of its steps (see the module)."""
    names = plan.source_names
    tokens = np.array([h["tokens"] for h in hist], dtype=np.float64).reshape(len(hist), -1)
    samples = np.array([h["samples"] for h in hist], dtype=np.int64).reshape(len(hist), -1)
    weights = np.array([h["weights"] for h in hist], dtype=np.float64).reshape(len(hist), -1)
    segments = _segments(plan, len(hist), tokens, weights)
    share, target = _shares(tokens, weights)
    cost = CostModel.from_spec(plan.balance.cost)
    sources: dict[str, Any] = {}
    for i, n in enumerate(names):
        spec = plan.sources[i]
        mine = [s for s in loaders if s["source"] == n]
        read_tokens = sum(int(s["tokens"]) for s in mine)
        per_token = sum(float(s["read_s"]) for s in mine) / read_tokens if read_tokens else 0.0
        mean_tokens = float(tokens[:, i].mean()) if len(hist) else 0.0
        # the schedule's target at the source's highest share in the run: what tokenizing
        # must keep up with at the busiest step, not the tokens one step happened to draw
        peak = float((weights[:, i] * tokens.sum(axis=1)).max()) if len(hist) else 0.0
        tokens_per_item = float(tokens[:, i].sum()) / max(1, int(samples[:, i].sum()))
        last = next((h["last"][i] for h in reversed(hist) if h["last"][i] is not None), None)
        cpu = mean_tokens * per_token
        sources[n] = {
            "tokens": int(tokens[:, i].sum()),
            "read_tokens": read_tokens,
            "samples": int(samples[:, i].sum()),
            "share": float(share[i]),
            "target": float(target[i]),
            "epochs": _epochs(plan, n, files[n], last),
            "cpu_s_per_token": per_token,
            "tokens_per_step": mean_tokens,
            "peak_tokens_per_step": peak,
            "cpu_s_per_step": cpu,
            "cores": None if step_seconds is None else peak * per_token / step_seconds,
            "memory": _memory(plan, spec.name, files[n], tokens_per_item, mine),
        }
    out = {
        "steps": len(hist),
        "dp": plan.world.dp,
        "cost_model": {"alpha": cost.alpha, "beta": cost.beta},
        "sources": sources,
        "segments": segments,
        "balance": _balance(plan, hist),
        "planner": _quantiles(times),
        "memory_bytes": sum(s["memory"]["total"] for s in sources.values()),
        "cpu_s_per_step": sum(s["cpu_s_per_step"] for s in sources.values()),
        "step_seconds": step_seconds,
        "cores": None if step_seconds is None else sum(s["cores"] for s in sources.values()),
        "seconds": time.perf_counter() - t0,
    }
    return out


def _shares(tokens: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Realized shares of tokens, and the targets: each step's weights times its tokens."""
    per_step = tokens.sum(axis=1, keepdims=True)
    total = max(float(per_step.sum()), 1.0)
    return tokens.sum(axis=0) / total, (weights * per_step).sum(axis=0) / total


def _segments(
    plan: Plan, steps: int, tokens: np.ndarray, weights: np.ndarray
) -> list[dict[str, Any]]:
    """The run cut at the schedule's points: each part's steps, shares and targets."""
    points = [p.step for p in plan.mixture.schedule] if plan.mixture is not None else []
    cuts = sorted({0, steps, *(p for p in points if 0 < p < steps)})
    names = plan.source_names
    out = []
    for a, b in zip(cuts, cuts[1:]):
        share, target = _shares(tokens[a:b], weights[a:b])
        out.append(
            {
                "steps": [a, b],
                "share": dict(zip(names, share.tolist())),
                "target": dict(zip(names, target.tolist())),
            }
        )
    return out


def _epochs(plan: Plan, name: str, files: SourceFiles, last: list[int] | None) -> float:
    """Epochs of ``name`` read up to its furthest item ``last`` ``[epoch, shard_pos, index]``.

    Whole epochs, plus the bytes of the shards before the item's shard in its
    epoch's order, plus half of that shard (how far into it is not known
    without its length), over the epoch's bytes.
    """
    if last is None:
        return 0.0
    epoch, pos = int(last[0]), int(last[1])
    listed = files.at(epoch)
    sizes = np.array([f.size for f in listed], dtype=np.float64)
    total = float(sizes.sum())
    if total <= 0:
        return float(epoch)
    order = shard_order(plan.seed, name, epoch, len(listed))
    passed = float(sizes[order[:pos]].sum()) + 0.5 * float(sizes[order[pos]])
    return epoch + passed / total


def window_bytes(plan: Plan, name: str, files: SourceFiles) -> int:
    """Bytes of text in one window of ``name``: ``window_blocks`` blocks, at most a shard.

    A JSONL block is ``block_bytes`` of (decompressed) text; a block of
    another format is a unit of its file (a row group, a tar), so its largest
    file stands for its window there (a bound: a file of many row groups is
    read a window at a time).
    """
    spec = next(s for s in plan.sources if s.name == name)
    largest = max((f.size for f in files.at(0)), default=0)
    if spec.format is Format.JSONL:
        block = plan.shuffle.window_blocks * plan.shuffle.block_bytes
        plain = all(not f.name.endswith((".gz", ".zst")) for f in files.at(0))
        return min(block, largest) if plain else block
    return largest


def _memory(
    plan: Plan,
    name: str,
    files: SourceFiles,
    tokens_per_item: float,
    stats: list[dict[str, Any]],
) -> dict[str, Any]:
    """What a source's loaders hold by the read-ahead rules, in bytes.

    Per loader: its share of the source's read-ahead budget of tokens, plus
    the pieces its threads may tokenize past it (one piece each, at most a
    window), at 4 bytes a
    token and :data:`ITEM_BYTES` an item; and its text: the window being cut
    and the next one, read once the first has ``LEAD_SHARE`` of it left
    (``1 + LEAD_SHARE`` windows). A standby holds the same items and at most
    one window of text (compressed: this counts it whole). Images are not
    counted.
    """
    spec = next(s for s in plan.sources if s.name == name)
    loaders, shadows = spec.loaders, spec.shadows or 0
    per_byte = np.mean([float(s["tokens_per_byte"]) for s in stats]) if stats else 1.0
    window = window_bytes(plan, name, files)
    in_flight = plan.loading.threads * min(PIECE_BYTES, window) * float(per_byte)
    held_tokens = token_budget(plan, loaders, name) + in_flight
    held = int(held_tokens * (TOKEN_BYTES + ITEM_BYTES / max(tokens_per_item, 1.0)))
    text = int((1 + LEAD_SHARE) * window)
    per_loader, per_shadow = held + text, held + window
    return {
        "held": held,
        "text": text,
        "per_loader": per_loader,
        "per_shadow": per_shadow,
        "loaders": loaders,
        "shadows": shadows,
        "total": loaders * (per_loader + shadows * per_shadow),
    }


def _balance(plan: Plan, hist: list[dict[str, Any]]) -> dict[str, Any]:
    """Most loaded rank over the lower bound, for the plan's method and the two baselines."""
    steps = [h for h in hist if h["lower_bound"] > 0]
    lb = np.array([h["lower_bound"] for h in steps])
    cols = {
        "max_over_lb": np.array([h["max_cost"] for h in steps]),
        "per_rank_packing": np.array([h["baseline_max_cost"] for h in steps]),
        "equal_docs": np.array([h["equal_docs_max_cost"] for h in steps]),
    }
    out: dict[str, Any] = {"method": plan.balance.method.value}
    for key, span in cols.items():
        ratio = span / lb if len(lb) else np.ones(1)
        out[key] = {"mean": float(ratio.mean()), "p95": float(np.percentile(ratio, 95))}
    own = float(cols["max_over_lb"].sum()) or 1.0
    out["speedup_vs_per_rank_packing"] = float(cols["per_rank_packing"].sum()) / own
    out["speedup_vs_equal_docs"] = float(cols["equal_docs"].sum()) / own
    return out


def _quantiles(times: np.ndarray) -> dict[str, float]:
    """Seconds per step; the first step, which waits for the loaders to start, apart."""
    first, rest = (float(times[0]), times[1:]) if len(times) else (0.0, times)
    if not len(rest):
        return {"first_s": first, "mean_s": first, "p50_s": first, "p95_s": first, "max_s": first}
    return {
        "first_s": first,
        "mean_s": float(rest.mean()),
        "p50_s": float(np.median(rest)),
        "p95_s": float(np.percentile(rest, 95)),
        "max_s": float(rest.max()),
    }


# ---- for people ------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable: GiB is the last unit


def print_simulation(r: dict[str, Any], out: TextIO | None = None) -> None:
    """The simulation as plain-text tables (on stdout by default)."""
    out = out or sys.stdout
    w = max(8, *(len(n) for n in r["sources"]))
    print(
        f"simulated {r['steps']} steps at dp={r['dp']} in {r['seconds']:.1f} s "
        f"(cost model as written: alpha={r['cost_model']['alpha']:.4g}, "
        f"beta={r['cost_model']['beta']:.4g})",
        file=out,
    )
    print(
        f"\n{'source':<{w}}  {'tokens':>14}  {'samples':>9}  {'share':>7}  {'target':>7}  "
        f"{'epochs':>8}  {'memory':>10}  {'CPU ns/token':>12}  {'cores':>6}",
        file=out,
    )
    for n, s in r["sources"].items():
        cores = "-" if s["cores"] is None else f"{s['cores']:.3g}"
        print(
            f"{n:<{w}}  {s['tokens']:>14,}  {s['samples']:>9,}  {100 * s['share']:6.2f}%  "
            f"{100 * s['target']:6.2f}%  {s['epochs']:>8.2f}  "
            f"{_size(s['memory']['total']):>10}  {1e9 * s['cpu_s_per_token']:>12.1f}  {cores:>6}",
            file=out,
        )
    if len(r["segments"]) > 1:
        print("\nshare (target) between the schedule's points:", file=out)
        for seg in r["segments"]:
            a, b = seg["steps"]
            parts = "  ".join(
                f"{n} {100 * seg['share'][n]:.1f}% ({100 * seg['target'][n]:.1f}%)"
                for n in r["sources"]
            )
            print(f"  steps {a}..{b - 1}: {parts}", file=out)
    b = r["balance"]
    print(
        f"\nbalance, most loaded rank / lower bound (mean, p95): {b['method']} "
        f"{b['max_over_lb']['mean']:.4f}, {b['max_over_lb']['p95']:.4f}; per-rank packing "
        f"{b['per_rank_packing']['mean']:.4f}, {b['per_rank_packing']['p95']:.4f}; equal "
        f"documents {b['equal_docs']['mean']:.4f}, {b['equal_docs']['p95']:.4f}",
        file=out,
    )
    print(
        f"step time by the cost model: {b['speedup_vs_per_rank_packing']:.3f}x faster than "
        f"per-rank packing, {b['speedup_vs_equal_docs']:.3f}x than equal documents",
        file=out,
    )
    p = r["planner"]
    print(
        f"planner: {1e3 * p['mean_s']:.1f} ms per step (p50 {1e3 * p['p50_s']:.1f}, p95 "
        f"{1e3 * p['p95_s']:.1f}, max {1e3 * p['max_s']:.1f}; the first "
        f"{1e3 * p['first_s']:.0f}, the loaders starting) at dp={r['dp']}, the loaders "
        "reading in the same process",
        file=out,
    )
    cores = (
        f"; {r['cores']:.3g} core(s) at {r['step_seconds']:g} s per step"
        if r["cores"] is not None
        else " (--step-seconds gives the cores)"
    )
    print(
        f"loaders: {_size(r['memory_bytes'])} by the read-ahead rules; tokenizing "
        f"{r['cpu_s_per_step']:.3g} CPU-s per step{cores}",
        file=out,
    )


def write_json(path: str, result: dict[str, Any]) -> None:
    """``--json``: the result; :class:`OutputError` naming the file if it cannot be written."""
    try:
        Path(path).write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    except OSError as e:
        raise OutputError(f"cannot write the simulation to {path}: {e.strerror or e}") from None
    except ValueError:  # a figure that is not finite has no JSON: a bug, said so
        bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
        raise OutputError(f"cannot write {path}: figures not finite: {bad}") from None
