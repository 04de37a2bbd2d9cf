"""Planner scale: time and metadata bytes of one planned step at DP 1,024 to 16,384.

What is timed is overlord's real planner, ``Planner._plan_next`` (the role that
Ray runs as an actor), with its real ``SourceCursor`` per source. Only the
source loaders are stand-ins: each serves metadata blocks shaped exactly like
``SourceLoader._publish``'s (per shard: epoch, shard position, file index;
per item: index int64, tokens int32, record row int64, chunk int32, image
patches int32), drawn
from ``synthetic.SOURCES`` (web, code, papers, books; long-tailed lengths,
split at ``max_seq_len``), one shard of about 1M tokens per block. The blocks
are made before the step is timed (in a real job loaders make them in other
processes). Per step the parts are timed by wrapping the functions the
planner calls:

- ``ingest``: ``SourceCursor._fetch``, turning loader blocks into the cursor's lists;
- ``select``: ``select_step`` (token-share mixing and the reference packing), less ingest;
- ``cost``: the cost model; ``assign``: balancing (``kk``, ``lpt`` or ``none``);
- ``take``: ``SourceCursor.take``, removing the step's items from the cursors;
- ``rest``: the rank plans (one dict of arrays per rank) and the snapshot.

``select + cost + assign`` is the planning proper; ``full`` is all of
``_plan_next``. Bytes: *in* is what the loaders send the planner for the
step's items (pickled blocks, protocol 5, per item times items per step);
*out* is what the planner sends the constructors: every rank plan pickled.

Grid: DP 1,024, 4,096, 16,384 and 16M, 64M tokens per step; ``max_seq_len`` is
the tokens per rank, at most 8,192 (16M: 8,192 x 2 rows at DP 1,024, 4,096 x
1 at DP 4,096, 1,024 x 1 at DP 16,384; 64M: 8,192 x 8, 8,192 x 2, 4,096 x 1).
``lpt`` is left out of the grid: one step at 64M and DP 4,096 takes about 30 s
(its search for the least loaded rank with room pops full ranks again and
again); it is in the target table.

Target: full planning under 50 ms (5% of a 1-s step) at DP 4,096 with 16M
tokens. That is 4,096 tokens per rank, so the target table runs it with rows
of 4,096 x 1, 2,048 x 2 and 1,024 x 4 per rank, each method, and these
PROTOTYPES (marked *, not in overlord yet):

- ``LB_pig`` and the early exit: a pigeonhole lower bound (now in overlord:
  ``overlord.plan.balance.pigeonhole_bound``)
  that sees that dp + 1 full-length chunks put two on one rank; with it,
  ``assign`` would keep the whole rows without running its solver.
- rank plans as views of columns permuted once, or lazily (the planner keeps
  the permuted columns and slices one rank's plan when asked), against a copy
  of the shipped loop (one stable argsort, then fancy indexing per rank).
- ``split assign (G)``: one global selection; the reference rows are balanced
  whole over G groups of dp/G ranks, and each group is assigned on its own
  (critical path = the slowest group, as if each ran in its own process).
- ``independent groups (G)``: G real planners, each with dp/G ranks, 1/G of
  the tokens and its own share of every source's loaders: selection too runs
  per group. Critical path = the slowest group's full ``_plan_next``.

The process is pinned to one CPU; the load average is printed next to the
timings (other work on the machine inflates them). Medians over the steps.

Run from the repository root::

    .venv/bin/python -m benchmarks.planner_scale            # about three minutes
    .venv/bin/python -m benchmarks.planner_scale --quick    # about 30 s (16M only)

Besides the tables it writes the plot ``benchmarks/planner_scale.png`` (``--plot`` to
choose another path, ``--plot ''`` for none): per-step time against DP for the grid, the
target point's rows per rank and methods, and metadata bytes per step against DP.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import overlord.roles.planner as planner_mod
from benchmarks._lib.synthetic import SOURCES, SourceShape, doc_lengths, model_7b
from benchmarks._lib.timing import pin_one_cpu
from overlord.plan import balance as bal
from overlord.plan.bounds import capacity_bound
from overlord.plan.cost import CostModel
from overlord.plan.spec import BalanceMethod
from overlord.roles.cursor import SourceCursor
from overlord.roles.planner import Planner
from overlord.runtime.base import Handle
from overlord.runtime.inline import InlineHandle, InlineRuntime

MIB = 1 << 20
DPS = (1024, 4096, 16384)
TOKENS = (16 * MIB, 64 * MIB)
TARGET = (4096, 16 * MIB)
TARGET_SEQ_LENS = (4096, 2048, 1024)
TARGET_MS = 50.0
BLOCK_TOKENS = 1 << 20  # tokens of one loader block (one shard)
GROUPS = (16, 64)


# ---- stand-in loaders --------------------------------------------------------------------


class FakeLoader:
    """A SourceLoader's ``metadata`` call, serving blocks shaped like ``_publish``'s."""

    def __init__(self, shape: SourceShape, cap: int, seed: int):
        self.shape, self.cap = shape, cap
        self.rng = np.random.default_rng(seed)
        mean = shape.median * np.exp(shape.sigma**2 / 2)
        self.docs = max(8, int(BLOCK_TOKENS / mean))
        self.epoch = 0  # one file per source: block k is (epoch k, shard 0)
        self.ready: deque[tuple[dict[str, Any], int]] = deque()
        self.ready_tokens = 0
        self.sent_bytes = self.sent_items = 0

    def _block(self) -> dict[str, Any]:
        length = doc_lengths(self.shape, self.docs, self.rng)
        n = np.maximum(1, -(-length // self.cap))
        doc = np.repeat(np.arange(len(length)), n)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(n) - n, n)
        block = {
            "epoch": self.epoch,
            "shard_pos": 0,
            "file_index": 0,
            "index": np.arange(len(doc), dtype=np.int64),
            "tokens": np.minimum(self.cap, length[doc] - k * self.cap).astype(np.int32),
            "row": doc.astype(np.int64),
            "chunk": np.where(n[doc] > 1, k, -1).astype(np.int32),
            "patches": np.zeros(len(doc), dtype=np.int32),  # text: no image patches
        }
        self.epoch += 1
        self.fields = {k: v.dtype.itemsize for k, v in block.items() if isinstance(v, np.ndarray)}
        return block

    def prepare(self, tokens: float) -> None:
        """Make blocks (untimed) until ``tokens`` are ready to serve."""
        while self.ready_tokens < tokens:
            b = self._block()
            self.ready.append((b, len(pickle.dumps(b, protocol=5))))
            self.ready_tokens += int(b["tokens"].sum())

    def metadata(self, timeout: float) -> list[dict[str, Any]]:
        block, size = self.ready.popleft()
        self.ready_tokens -= int(block["tokens"].sum())
        self.sent_bytes += size
        self.sent_items += len(block["index"])
        return [block]


class Bench:
    """A real Planner over stand-in loaders, for one (dp, tokens, max_seq_len, method)."""

    def __init__(self, folder: str, dp: int, tokens: int, cap: int, method: str, seed: int):
        self.tokens = tokens
        data = {
            "sources": [
                {"name": s.name, "path": f"{s.name}.jsonl", "format": "jsonl"} for s in SOURCES
            ],
            "batch": {"tokens_per_step": tokens, "max_seq_len": cap},
            "mixture": {"schedule": [{"step": 0, "weights": {s.name: s.weight for s in SOURCES}}]},
            "world": {"dp": dp},
            "balance": {
                "method": method,
                "cost": {"model": {"params": 7e9, "layers": 32, "hidden": 4096}},
            },
        }
        self.loaders = [FakeLoader(s, cap, seed * 1009 + i) for i, s in enumerate(SOURCES)]
        handles: dict[str, list[Handle]] = {
            s.name: [InlineHandle(f, s.name)] for s, f in zip(SOURCES, self.loaders)
        }
        self.planner = Planner(data, folder, handles, InlineRuntime())

    def prepare(self) -> None:
        for s, f in zip(SOURCES, self.loaders):
            f.prepare(2.0 * s.weight * self.tokens + BLOCK_TOKENS)

    def step(self) -> tuple[float, list[dict[str, Any]], dict[str, Any]]:
        """Plan one step: (seconds, the rank plans, the step's history entry)."""
        self.prepare()
        p = self.planner
        t0 = time.perf_counter()
        p._plan_next()
        seconds = time.perf_counter() - t0
        plans = p.plans.pop(p.next_step - 1)
        p.snapshots.pop(p.next_step - 1, None)
        return seconds, plans, p.history[-1]

    def bytes_per_item_in(self) -> float:
        items = sum(f.sent_items for f in self.loaders)
        return sum(f.sent_bytes for f in self.loaders) / max(1, items)


# ---- timing the planner's parts ------------------------------------------------------------


class Parts:
    """Wraps what ``_plan_next`` calls; accumulates seconds per part, keeps assign's call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last_assign: tuple[tuple[Any, ...], Any] | None = None

    def _wrap(self, owner: Any, name: str, part: str, keep: bool = False) -> Callable[[], None]:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0
            if keep:
                self.last_assign = (args, out)
            return out

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, fn)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Parts]:
        undo = [
            self._wrap(planner_mod, "select_step", "select"),
            self._wrap(planner_mod, "assign", "assign", keep=True),
            self._wrap(SourceCursor, "_fetch", "ingest"),
            self._wrap(SourceCursor, "take", "take"),
            self._wrap(CostModel, "cost", "cost"),
        ]
        try:
            yield self
        finally:
            for u in reversed(undo):
                u()


def measure(bench: Bench, steps: int, warmup: int) -> dict[str, Any]:
    """Plan ``warmup + steps`` steps; medians of each part, bytes, balance, assign's inputs."""
    parts = Parts()
    rows: list[dict[str, float]] = []
    out_bytes, items, quality, calls = [], [], [], []
    with parts.installed():
        for i in range(warmup + steps):
            parts.seconds = {}
            seconds, plans, hist = bench.step()
            if i < warmup:
                continue
            s = dict(parts.seconds)
            s["select"] = s.get("select", 0.0) - s.get("ingest", 0.0)
            s["full"] = seconds
            s["plan"] = s["select"] + s.get("cost", 0.0) + s.get("assign", 0.0)
            s["rest"] = seconds - sum(s.get(k, 0.0) for k in ("plan", "ingest", "take"))
            rows.append(s)
            out_bytes.append(sum(len(pickle.dumps(rp, protocol=5)) for rp in plans))
            fields = {
                k: v.dtype.itemsize * (v.shape[1] if v.ndim > 1 else 1)
                for k, v in plans[0].items()
                if isinstance(v, np.ndarray)
            }
            items.append(sum(len(rp["tokens"]) for rp in plans))
            quality.append((hist["max_cost"] / hist["lower_bound"], hist["baseline_max_cost"]))
            calls.append(parts.last_assign)
    med = {k: 1e3 * float(np.median([r.get(k, 0.0) for r in rows])) for k in rows[0]}
    med["full_p95"] = 1e3 * float(np.percentile([r["full"] for r in rows], 95))
    n_items = float(np.mean(items))
    return {
        "ms": med,
        "items": n_items,
        "in_bytes": bench.bytes_per_item_in() * n_items,
        "out_bytes": float(np.mean(out_bytes)),
        "ratio": float(np.mean([q for q, _ in quality])),
        "calls": calls,
        "out_fields": fields,
        "in_fields": bench.loaders[0].fields,
    }


# ---- prototypes ------------------------------------------------------------------------------


def columns_by_rank(
    cols: dict[str, np.ndarray], row: np.ndarray, dp: int, rpr: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """PROTOTYPE: every column permuted once into rank order, rows made local, rank bounds."""
    order = np.argsort(row, kind="stable")
    sorted_row = row[order]
    bounds = np.searchsorted(sorted_row, np.arange(dp + 1) * rpr)
    return {k: v[order] for k, v in cols.items()}, sorted_row % rpr, bounds


def rank_plans_vectorized(cols: dict[str, np.ndarray], row: np.ndarray, dp: int, rpr: int) -> list:
    """PROTOTYPE: every rank's plan as views of the columns permuted once."""
    sorted_cols, local, bounds = columns_by_rank(cols, row, dp, rpr)
    return [
        {"rank": r, "rows": rpr, "row": local[bounds[r] : bounds[r + 1]]}
        | {k: v[bounds[r] : bounds[r + 1]] for k, v in sorted_cols.items()}
        for r in range(dp)
    ]


def rank_plans_lazy(cols: dict[str, np.ndarray], row: np.ndarray, dp: int, rpr: int) -> list:
    """PROTOTYPE: only the permuted columns per step; ``rank_plan`` would slice on request."""
    sorted_cols, local, bounds = columns_by_rank(cols, row, dp, rpr)
    return [{} for _ in range(dp)]  # stand-ins, so that the per-rank cost is set as for the others


def rank_plans_shipped(cols: dict[str, np.ndarray], row: np.ndarray, dp: int, rpr: int) -> list:
    """A copy of ``Planner._plan_next``'s rank-plan loop (commit 26aa1db), for an A/B timing."""
    plans = []
    by_row = np.argsort(row, kind="stable")
    bounds = np.searchsorted(row[by_row], np.arange(dp + 1) * rpr)
    for r in range(dp):
        mine = by_row[bounds[r] : bounds[r + 1]]
        plans.append(
            {"rank": r, "rows": rpr, "row": row[mine] - r * rpr}
            | {k: v[mine] for k, v in cols.items()}
        )
    return plans


def time_rank_plans(call: tuple[tuple[Any, ...], Any], repeats: int = 3) -> dict[str, float]:
    """Milliseconds to build every rank plan of one step: shipped loop, and views."""
    (tokens, cost, _ref, dp, rpr, _cap, _m), row = call
    n = len(tokens)
    rng = np.random.default_rng(0)
    cols = {k: rng.integers(0, 1 << 20, n) for k in ("source", "loader", "file_index", "rec_row")}
    cols |= {"tokens": tokens, "chunk": rng.integers(-1, 4, n), "key": rng.integers(0, 9, (n, 3))}
    out = {}
    variants = (
        ("shipped", rank_plans_shipped),
        ("views", rank_plans_vectorized),
        ("lazy", rank_plans_lazy),
    )
    for name, fn in variants:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plans = fn(cols, row, dp, rpr)
            for rp, c in zip(plans, np.bincount(row // rpr, weights=cost, minlength=dp)):
                rp["cost"] = float(c)
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * float(np.median(times))
    return out


def split_assign(call: tuple[tuple[Any, ...], Any], groups: int) -> dict[str, float]:
    """PROTOTYPE: reference rows balanced whole over groups, then each group assigned alone."""
    (tokens, cost, ref_row, dp, rpr, cap, method), _ = call
    rows = dp * rpr
    per = rows // groups
    t0 = time.perf_counter()
    by_rows = np.bincount(ref_row, weights=cost, minlength=rows)
    new_ref = bal._rows_balanced(by_rows, groups, per)[ref_row]
    group = new_ref // per
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(groups + 1))
    split_s = time.perf_counter() - t0
    row = np.empty(len(tokens), dtype=np.int64)
    times = []
    for g in range(groups):
        idx = order[bounds[g] : bounds[g + 1]]
        t0 = time.perf_counter()
        got = bal.assign(
            tokens[idx], cost[idx], new_ref[idx] - g * per, dp // groups, rpr, cap, method
        )
        times.append(time.perf_counter() - t0)
        row[idx] = got + g * per
    span = bal.rank_costs(cost, row, dp, rpr).max()
    return {
        "critical_ms": 1e3 * (split_s + max(times)),
        "sum_ms": 1e3 * (split_s + sum(times)),
        "ratio": float(span / bal.lower_bound(cost, dp)),
    }


def independent_groups(
    folder: str, dp: int, tokens: int, cap: int, method: str, groups: int, steps: int, seed: int
) -> dict[str, float]:
    """PROTOTYPE: ``groups`` real planners of dp/groups ranks each; slowest and summed times."""
    benches = [
        Bench(folder, dp // groups, tokens // groups, cap, method, seed * 7919 + g)
        for g in range(groups)
    ]
    crit, total, ratio = [], [], []
    for i in range(steps + 1):
        got = [b.step() for b in benches]
        if i == 0:
            continue  # warm-up
        times = [s for s, _, _ in got]
        crit.append(max(times))
        total.append(sum(times))
        # the step's lower bound over all groups: the mean, or a group's largest item
        mean = sum(h["mean_cost"] for _, _, h in got) / groups
        largest = max(
            (h["lower_bound"] for _, _, h in got if h["lower_bound"] > h["mean_cost"]), default=0.0
        )
        ratio.append(max(h["max_cost"] for _, _, h in got) / max(mean, largest))
    return {
        "critical_ms": 1e3 * float(np.median(crit)),
        "sum_ms": 1e3 * float(np.median(total)),
        "ratio": float(np.mean(ratio)),
    }


def kk_partition_bytes(dp: int) -> float:
    """Memory of ``kk_partition``'s k-tuples: head items x dp x (float64 sum + int64 node)."""
    head = max(bal.KK_MIN_ITEMS, bal.KK_ITEMS_PER_RANK * dp)
    return head * dp * 16.0


# ---- tables ---------------------------------------------------------------------------------


def seq_len_for(tokens: int, dp: int) -> int:
    return min(8192, tokens // dp)


def fmt_mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 measured steps, 16M tokens only")
    ap.add_argument("--steps", type=int, help="measured steps per setting (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default="benchmarks/planner_scale.png", help="PNG path ('' for none)")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 5)
    tokens_grid = TOKENS[:1] if args.quick else TOKENS
    pinned = pin_one_cpu()
    folder = tempfile.mkdtemp(prefix="overlord-planner-scale-")
    for s in SOURCES:  # the plan needs its files to exist; the stand-in loaders never read them
        with open(os.path.join(folder, f"{s.name}.jsonl"), "w") as f:
            f.write('{"text": "x"}\n')
    t_start = time.perf_counter()

    grid = []
    for g_tokens in tokens_grid:
        for g_dp in DPS:
            cap = seq_len_for(g_tokens, g_dp)
            for method in ("kk", "none"):
                r = measure(Bench(folder, g_dp, g_tokens, cap, method, args.seed), steps, 1)
                grid.append((g_tokens, g_dp, cap, method, r))
    load_grid = os.getloadavg()

    target = []
    dp, tokens = TARGET
    for cap in TARGET_SEQ_LENS:
        for method in ("kk", "lpt", "none"):
            r = measure(Bench(folder, dp, tokens, cap, method, args.seed), steps, 1)
            target.append((cap, method, r))
    protos = []
    for cap in TARGET_SEQ_LENS:
        call = next(r for c, m, r in target if c == cap and m == "kk")["calls"][-1]
        (tok, cost, ref_row, _dp, rpr, _c, _m), _ = call
        lb = bal.lower_bound(cost, dp)
        cm = model_7b()
        lb_cap = capacity_bound(tok, cost, cm.alpha, cm.beta, dp, rpr * cap)
        t0 = time.perf_counter()
        # assign's early exit with this bound: the rows balanced whole, compared with it
        whole = bal.whole_rows(cost, ref_row, dp, rpr)
        whole_span = bal.rank_costs(cost, whole, dp, rpr).max()
        lb_pig = bal.pigeonhole_bound(tok, cost, dp, rpr * cap)
        exit_ms = 1e3 * (time.perf_counter() - t0)
        kk_span = call[1]
        entry: dict[str, Any] = {
            "cap": cap,
            "rpr": rpr,
            "vec_ms": time_rank_plans(call),
            "whole_lb": whole_span / lb,
            "whole_lbcap": whole_span / lb_cap,
            "whole_pig": whole_span / lb_pig,
            "kk_pig": bal.rank_costs(cost, kk_span, dp, rpr).max() / lb_pig,
            "exit_ms": exit_ms,
            "split": {},
            "groups": {},
        }
        for g in GROUPS:
            kk_call = ((tok, cost, ref_row, dp, rpr, cap, BalanceMethod.KK), None)
            entry["split"][g] = split_assign(kk_call, g)
            entry["groups"][g] = independent_groups(
                folder, dp, tokens, cap, "kk", g, max(2, steps // 2), args.seed
            )
        protos.append(entry)
    load = os.getloadavg()

    print(f"# Planner scale: one step of overlord's real Planner, {pinned}\n")
    print(
        f"{steps} measured steps per setting after one warm-up; medians, ms. Load average "
        f"{load_grid[0]:.2f} {load_grid[1]:.2f} {load_grid[2]:.2f} after the grid, "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; "
        f"{time.perf_counter() - t_start:.0f} s in all. max_seq_len = tokens per rank, "
        "at most 8,192.\n"
    )
    print("## Grid (as shipped)\n")
    print(
        "| tokens/step | DP | max_seq_len x rows/rank | method | items/step | select+cost+assign "
        "| (select / assign) | ingest | take | rest (rank plans) | full | full p95 "
        "| makespan/LB | in MB/step | out MB/step |"
    )
    print("|" + "---:|" * 3 + "---|" + "---:|" * 11)
    for g_tokens, g_dp, cap, method, r in grid:
        print(row_line(f"{g_tokens // MIB}M", g_dp, cap, g_tokens // (g_dp * cap), method, r))

    print(f"\n## Target point: DP {TARGET[0]}, {TARGET[1] // MIB}M tokens per step\n")
    print(
        "| tokens/step | DP | max_seq_len x rows/rank | method | items/step | select+cost+assign "
        "| (select / assign) | ingest | take | rest (rank plans) | full | full p95 "
        "| makespan/LB | in MB/step | out MB/step |"
    )
    print("|" + "---:|" * 3 + "---|" + "---:|" * 11)
    for cap, method, r in target:
        print(row_line(f"{tokens // MIB}M", dp, cap, tokens // (dp * cap), method, r))

    print("\n## Prototypes at the target point (not in overlord yet)\n")
    print(
        "LB_pig* is the pigeonhole bound (overlord.plan.balance.pigeonhole_bound); "
        "'early exit*' is what assign "
        "would spend with it: rows balanced whole, then the bound. Rank plans: the shipped loop "
        "(fancy indexing per rank) against views of columns permuted once, and against only "
        "permuting them (lazy: rank_plan would slice on each request). 'slowest (sum)': "
        "the critical path with one process per group, and the one-core total.\n"
    )
    print(
        "| max_seq_len x rows/rank | whole rows/LB | whole rows/LB_cap | whole rows/LB_pig* "
        "| kk/LB_pig* | early exit* ms | rank plans ms: shipped / views* / lazy* "
        + "".join(
            f"| split assign* G={g}: slowest (sum) ms, makespan/LB "
            f"| independent groups* G={g}: slowest (sum) ms, makespan/LB "
            for g in GROUPS
        )
        + "|"
    )
    print("|" + "---:|" * (7 + 2 * len(GROUPS)))
    for e in protos:
        cells = "".join(
            f"| {e['split'][g]['critical_ms']:.1f} ({e['split'][g]['sum_ms']:.0f}), "
            f"{e['split'][g]['ratio']:.4f} "
            f"| {e['groups'][g]['critical_ms']:.1f} ({e['groups'][g]['sum_ms']:.0f}), "
            f"{e['groups'][g]['ratio']:.4f} "
            for g in GROUPS
        )
        print(
            f"| {e['cap']} x {e['rpr']} | {e['whole_lb']:.4f} | {e['whole_lbcap']:.4f} "
            f"| {e['whole_pig']:.4f} | {e['kk_pig']:.4f} | {e['exit_ms']:.1f} "
            f"| {e['vec_ms']['shipped']:.1f} / {e['vec_ms']['views']:.1f} "
            f"/ {e['vec_ms']['lazy']:.1f} {cells}|"
        )

    print("\n## Metadata bytes\n")
    sample = grid[0][4]
    per_in = sample["in_bytes"] / sample["items"]
    fin, fout = sample["in_fields"], sample["out_fields"]
    # what a rank plan costs beyond its items' arrays (pickled dict, array headers)
    overhead = (sample["out_bytes"] - sample["items"] * sum(fout.values())) / grid[0][1]
    print(
        f"- In (loaders to planner): {per_in:.1f} B per item as pickled blocks of about "
        f"{BLOCK_TOKENS // MIB}M tokens: per item "
        + " + ".join(f"{k} {v}" for k, v in fin.items())
        + f" = {sum(fin.values())} B, plus a few hundred bytes per block."
    )
    print(
        "- Out (planner to constructors): per item "
        + " + ".join(f"{k} {v}" for k, v in fout.items())
        + f" = {sum(fout.values())} B, plus {overhead:.0f} B per rank (the pickled dict and "
        f"array headers): {overhead * 16384 / 1e6:.1f} MB per step at DP 16,384 before any item, "
        "and one rank_plan call per rank per step."
    )
    for d in DPS:
        print(
            f"- kk_partition at DP {d}: its k-tuples hold {kk_partition_bytes(d) / 1e9:.2f} GB "
            "(4 * dp items x dp x 16 B); it runs whenever whole rows miss the bound."
        )

    print(f"\n## Target: full planning under {TARGET_MS:.0f} ms at DP 4,096 with 16M tokens\n")
    for cap, method, r in target:
        ms = r["ms"]
        print(
            f"- {cap} x {tokens // (dp * cap)} rows, {method}: select+cost+assign "
            f"{ms['plan']:.1f} ms ({'meets' if ms['plan'] < TARGET_MS else 'MISSES'}), full "
            f"{ms['full']:.1f} ms ({'meets' if ms['full'] < TARGET_MS else 'MISSES'})"
        )
    for e in protos:
        none = next(r for c, m, r in target if c == e["cap"] and m == "none")["ms"]
        parts = [
            f"independent groups G={g}: {e['groups'][g]['critical_ms']:.1f} ms critical path "
            f"({'meets' if e['groups'][g]['critical_ms'] < TARGET_MS else 'MISSES'})"
            for g in GROUPS
        ]
        if e["whole_pig"] <= 1 + 1e-9:
            # none's measured step (whole rows, no solver) plus the early exit's own cost
            one = none["full"] + e["exit_ms"]
            lazy = one - e["vec_ms"]["shipped"] + e["vec_ms"]["lazy"]
            parts.insert(
                0,
                f"one process, kk with the pigeonhole early exit (none's measured step + "
                f"{e['exit_ms']:.1f} ms): {one:.1f} ms "
                f"({'meets' if one < TARGET_MS else 'MISSES'}), and with lazy rank plans "
                f"{lazy:.1f} ms ({'meets' if lazy < TARGET_MS else 'MISSES'})",
            )
        else:
            parts.insert(
                0,
                f"one process: whole rows are {100 * (e['whole_pig'] - 1):.2f}% above LB_pig*, "
                f"so the solver must run; select alone is {none['select']:.1f} ms",
            )
        print(f"- {e['cap']} x {e['rpr']} rows, PROTOTYPES: " + "; ".join(parts))
    if args.plot:
        plot(grid, target, args.plot)
        print(f"\nPlot: {args.plot}")
    return 0


def plot(grid: list[tuple[int, int, int, str, dict[str, Any]]], target: list, path: str) -> None:
    """Step time against DP (grid), the target point's settings, metadata bytes against DP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 6.2), gridspec_kw={"width_ratios": [5, 4, 4]})
    tokens_grid = sorted({g[0] for g in grid})
    methods = [m for m in ("kk", "none") if any(g[3] == m for g in grid)]
    colors = {
        (t, m): plt.get_cmap("tab10")(2 * i + j)
        for i, t in enumerate(tokens_grid)
        for j, m in enumerate(methods)
    }

    ax = axes[0]
    for t in tokens_grid:
        for m in methods:
            pts = sorted((g for g in grid if g[0] == t and g[3] == m), key=lambda g: g[1])
            dps = [g[1] for g in pts]
            c = colors[(t, m)]
            ax.plot(
                dps,
                [g[4]["ms"]["full"] for g in pts],
                "o-",
                color=c,
                label=f"{t // MIB}M tokens/step, {m}: full step",
            )
            ax.plot(
                dps,
                [g[4]["ms"]["plan"] for g in pts],
                "x:",
                color=c,
                alpha=0.7,
                label=f"{t // MIB}M, {m}: select+cost+assign",
            )
        for g in sorted((g for g in grid if g[0] == t and g[3] == methods[0]), key=lambda g: g[1]):
            top = max(x[4]["ms"]["full"] for x in grid if x[0] == t and x[1] == g[1])
            ax.annotate(
                f"{g[2]} x {t // (g[1] * g[2])}",
                (g[1], top),
                textcoords="offset points",
                xytext=(0, 7),
                ha="center",
                fontsize=7,
                color=colors[(t, methods[0])],
            )
    ax.axhline(
        TARGET_MS, color="red", ls="--", lw=1, label=f"target {TARGET_MS:.0f} ms (5% of a 1 s step)"
    )
    dps_all = sorted({g[1] for g in grid})
    log_dp_axes(ax, dps_all)
    ax.set_ylabel("planner time per step, ms (median)")
    ax.set_title("Grid as shipped (labels: max_seq_len x rows/rank)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.margins(x=0.08, y=0.12)
    plain_log_ticks(ax)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)

    ax = axes[1]
    caps = list(dict.fromkeys(c for c, _, _ in target))
    tmethods = list(dict.fromkeys(m for _, m, _ in target))
    width = 0.8 / len(tmethods)
    for j, m in enumerate(tmethods):
        rs = [next(r for c, mm, r in target if c == cap and mm == m) for cap in caps]
        x = np.arange(len(caps)) + (j - (len(tmethods) - 1) / 2) * width
        c = plt.get_cmap("tab10")(j)
        ax.bar(
            x,
            [r["ms"]["full"] for r in rs],
            width,
            color=c,
            alpha=0.85,
            label=f"{m}: full step",
        )
        ax.scatter(
            x,
            [r["ms"]["plan"] for r in rs],
            marker="_",
            s=120,
            color="k",
            zorder=3,
            label="select+cost+assign" if j == 0 else None,
        )
    ax.axhline(TARGET_MS, color="red", ls="--", lw=1, label=f"target {TARGET_MS:.0f} ms")
    dp, tokens = TARGET
    ax.set_xticks(range(len(caps)), [f"{c} x {tokens // (dp * c)}" for c in caps])
    ax.set_yscale("log")
    ax.set_xlabel("max_seq_len x rows/rank")
    ax.set_ylabel("planner time per step, ms (median)")
    ax.set_title(f"Target point: DP {dp:,}, {tokens // MIB}M tokens/step", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    plain_log_ticks(ax)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)

    ax = axes[2]
    for t in tokens_grid:
        m = methods[0]
        pts = sorted((g for g in grid if g[0] == t and g[3] == m), key=lambda g: g[1])
        dps = [g[1] for g in pts]
        c = colors[(t, m)]
        ax.plot(
            dps,
            [g[4]["in_bytes"] / 1e6 for g in pts],
            "s--",
            color=c,
            label=f"{t // MIB}M: in (loaders to planner)",
        )
        ax.plot(
            dps,
            [g[4]["out_bytes"] / 1e6 for g in pts],
            "o-",
            color=c,
            label=f"{t // MIB}M: out (rank plans)",
        )
    log_dp_axes(ax, dps_all)
    ax.set_ylabel("MB per step (pickled)")
    ax.set_title(f"Metadata bytes per step ({methods[0]})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    plain_log_ticks(ax)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle("overlord planner scale: one step of the real Planner on one CPU (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_dp_axes(ax: Any, dps: list[int]) -> None:
    """Log axes, x the DP sizes (base 2, a tick at each), y log 10."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(dps, [f"{d:,}" for d in dps])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("DP (ranks)")


def plain_log_ticks(ax: Any) -> None:
    """Ticks at 1, 2, 5 x 10^k on a log y axis, written as plain numbers."""
    lo, hi = ax.get_ylim()
    ticks = [m * 10.0**k for k in range(-3, 6) for m in (1, 2, 5) if lo <= m * 10.0**k <= hi]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(lo, hi)


def row_line(tokens: str, dp: int, cap: int, rpr: int, method: str, r: dict[str, Any]) -> str:
    ms = r["ms"]
    return (
        f"| {tokens} | {dp} | {cap} x {rpr} | {method} | {r['items']:.0f} | {ms['plan']:.1f} "
        f"| ({ms['select']:.1f} / {ms.get('assign', 0.0):.1f}) | {ms.get('ingest', 0.0):.1f} "
        f"| {ms.get('take', 0.0):.1f} | {ms['rest']:.1f} | {ms['full']:.1f} "
        f"| {ms['full_p95']:.1f} | {r['ratio']:.4f} | {fmt_mb(r['in_bytes'])} "
        f"| {fmt_mb(r['out_bytes'])} |"
    )


if __name__ == "__main__":
    sys.exit(main())
