"""Planner scale: time and metadata bytes of one planned step at DP 1,024 to 16,384.

What is timed is overlord's real planner, :class:`overlord.roles.planner.Planner`
(the role that Ray runs as an actor), with its real ``LoaderPool`` and one
``SourceCursor`` per source, built as a job builds it: ``Planner(plan, files,
runtime, PoolConfig(...))`` and ``planner.start()``, which spawns the loaders
through the runtime. Only the source loaders are stand-ins: the benchmark's
runtime (the inline one) hands the pool a :class:`FakeLoader` wherever it
spawns a ``SourceLoader``. A FakeLoader serves metadata blocks shaped exactly
like a SourceLoader's (per shard: epoch, shard position, file index; per item:
index int64, tokens int32, record row int64, chunk int32, image patches int32),
drawn from ``synthetic.SOURCES`` (web, code, papers, books; long-tailed
lengths, split at ``max_seq_len``), one shard of about 1M tokens per block;
each source has one stand-in file, read once per epoch, so block ``k`` is shard
0 of epoch ``k``. The blocks are made before the step is timed (in a real job
loaders make them in other processes).

A step is driven as ranks drive it: ``rank_plan(step, 0)`` plans the step (and
cuts rank 0's plan: *full* is the time of that call), then ``rank_plan(step,
r)`` for every rank (*rank plans*: the planner keeps the step's columns sorted
by rank and row and slices one rank's plan per call), then ``mark_consumed(r,
step)`` for every rank (*consume*: the last one releases the step's items to
the loaders). Within *full*, the parts are timed by wrapping, for this
planner only, what it calls:

- ``ingest``: the cursors' ``fetch`` calls, which bring loader blocks (the loader
  call; turning the blocks into the cursor's lists counts in select);
- ``select``: ``select_step`` (token-share mixing and the reference packing), less ingest;
- ``cost``: the cost model; ``assign``: balancing (``kk``, ``lpt`` or ``none``);
- ``take``: the cursors' ``take``, removing the step's items from them;
- ``rest``: gathering the step's columns, sorting them by rank and row, the history
  entry and the snapshot.

``select`` and ``assign`` are the names ``overlord.roles.planner`` calls: they
are wrapped in that module's namespace while a benchmark planner runs (there
is no timing hook); the cursors and the cost model are wrapped on this
planner's instance. ``select + cost + assign`` is the planning proper. Bytes:
*in* is what the loaders send the planner for the step's items (pickled
blocks, protocol 5, per item times items per step); *out* is what the planner
sends the constructors: every rank's ``rank_plan`` pickled.

Grid: DP 1,024, 4,096, 16,384 and 16M, 64M tokens per step; ``max_seq_len`` is
the tokens per rank, at most 8,192 (16M: 8,192 x 2 rows at DP 1,024, 4,096 x
1 at DP 4,096, 1,024 x 1 at DP 16,384; 64M: 8,192 x 8, 8,192 x 2, 4,096 x 1).
``lpt`` is left out of the grid: one step at 64M and DP 4,096 takes about 30 s
(its search for the least loaded rank with room pops full ranks again and
again); it is in the target table.

Target: full planning under 50 ms (5% of a 1-s step) at DP 4,096 with 16M
tokens. That is 4,096 tokens per rank, so the target table runs it with rows
of 4,096 x 1, 2,048 x 2 and 1,024 x 4 per rank, each method, and these
bounds and PROTOTYPES (marked *, not in overlord yet):

- ``LB_pig``: the pigeonhole lower bound (``overlord.plan.balance.pigeonhole_bound``)
  that sees that dp + 1 full-length chunks put two on one rank; ``assign``
  keeps the whole rows without running its solver when they meet it. 'early
  exit' is what that check costs on its own.
- ``split assign (G)``: one global selection; the reference rows are balanced
  whole over G groups of dp/G ranks, and each group is assigned on its own
  (critical path = the slowest group, as if each ran in its own process).
- ``independent groups (G)``: G real planners, each with dp/G ranks, 1/G of
  the tokens and its own share of every source's loaders: selection too runs
  per group. Critical path = the slowest group's full step.

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
from typing import TYPE_CHECKING, Any

import numpy as np

import overlord.roles.planner as planner_mod
from benchmarks._lib.synthetic import SOURCES, SourceShape, doc_lengths, model_7b
from benchmarks._lib.timing import pin_one_cpu
from overlord.plan import balance as bal
from overlord.plan.bounds import capacity_bound
from overlord.plan.spec import BalanceMethod, Plan, validate_plan
from overlord.roles.api import LoaderRole
from overlord.roles.loader_pool import PoolConfig
from overlord.roles.planner import Planner
from overlord.roles.source_loader import SourceLoader
from overlord.runtime.base import DEFAULT_OPTIONS, Handle, RoleOptions
from overlord.runtime.inline import InlineRuntime
from overlord.sources.catalog import File, SourceFiles

MIB = 1 << 20
DPS = (1024, 4096, 16384)
TOKENS = (16 * MIB, 64 * MIB)
TARGET = (4096, 16 * MIB)
TARGET_SEQ_LENS = (4096, 2048, 1024)
TARGET_MS = 50.0
BLOCK_TOKENS = 1 << 20  # tokens of one loader block (one shard)
GROUPS = (16, 64)
# what a SourceLoader's metadata block holds, and what the planner's cursor reads of it
BLOCK_SCALARS = ("epoch", "shard_pos", "file_index")
BLOCK_COLUMNS = {
    "index": np.int64,
    "tokens": np.int32,
    "row": np.int64,
    "chunk": np.int32,
    "patches": np.int32,
}


# ---- stand-in loaders --------------------------------------------------------------------


class FakeLoader:
    """A SourceLoader that serves synthetic metadata blocks and holds no payloads.

    It answers every call of :class:`~overlord.roles.api.LoaderRole`; the
    planner and its pool call ``metadata``, ``release``, ``stats`` and
    ``close`` here. The calls a fault or a resize would make (``promote``,
    ``rewind``, ``freeze``, ``until``) and ``take`` (a constructor's) are not
    part of this benchmark and raise.
    """

    def __init__(self, shape: SourceShape, cap: int, seed: int):
        self.shape, self.cap = shape, cap
        self.rng = np.random.default_rng(seed)
        mean = shape.median * np.exp(shape.sigma**2 / 2)
        self.docs = max(8, int(BLOCK_TOKENS / mean))
        self.epoch = 0  # one file per source: block k is (epoch k, shard 0)
        self.ready: deque[tuple[dict[str, Any], int]] = deque()
        self.ready_tokens = 0
        self.sent_bytes = self.sent_items = self.released = 0
        self.threads = 1
        self.fields: dict[str, int] = {}

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
        check_block(block)
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
        """The next prepared block (the benchmark prepares enough before each step)."""
        if not self.ready:
            raise RuntimeError(f"FakeLoader {self.shape.name}: no block prepared")
        block, size = self.ready.popleft()
        self.ready_tokens -= int(block["tokens"].sum())
        self.sent_bytes += size
        self.sent_items += len(block["index"])
        return [block]

    def release(self, keys: np.ndarray) -> None:
        """Nothing is held: count the released items."""
        self.released += len(keys)

    def stats(self) -> dict[str, Any]:
        """The counters a pool reads of a loader."""
        return {
            "source": self.shape.name,
            "loader": 0,
            "items": self.sent_items,
            "released": self.released,
            "threads": self.threads,
            "cpu_s_per_token": float("nan"),
            "rss_bytes": 0,
        }

    def set_threads(self, threads: int) -> None:
        """Recorded only: the blocks are made up front."""
        self.threads = threads

    def pid(self) -> int:
        """This process."""
        return os.getpid()

    def close(self) -> None:
        """Drop the prepared blocks."""
        self.ready.clear()

    def take(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """No payloads: no constructor runs here."""
        raise RuntimeError("FakeLoader holds no payloads")

    def promote(self, after: list[int] | None) -> None:
        """No shadows run here."""
        raise RuntimeError("FakeLoader: no failover in this benchmark")

    def rewind(self, start: dict[str, Any]) -> None:
        """No planner restarts here."""
        raise RuntimeError("FakeLoader: no planner restart in this benchmark")

    def freeze(self) -> list[int] | None:
        """No re-partition here."""
        raise RuntimeError("FakeLoader: no re-partition in this benchmark")

    def until(self, limit: list[int]) -> None:
        """No re-partition here."""
        raise RuntimeError("FakeLoader: no re-partition in this benchmark")


if TYPE_CHECKING:  # it answers every call of a SourceLoader
    _role: type[LoaderRole] = FakeLoader


def check_block(block: dict[str, Any]) -> None:
    """Fail unless ``block`` has the fields and dtypes of a SourceLoader's metadata block."""
    assert set(block) == {*BLOCK_SCALARS, *BLOCK_COLUMNS}, sorted(block)
    n = len(block["index"])
    for k, dtype in BLOCK_COLUMNS.items():
        v = block[k]
        assert v.dtype == dtype and v.shape == (n,), (k, v.dtype, v.shape)


class StandInRuntime(InlineRuntime):
    """The inline runtime, with a :class:`FakeLoader` wherever a ``SourceLoader`` is spawned.

    It serves one primary loader per source (the benchmark's plan has one
    loader and no shadows per source); ``loaders`` are those it started.
    """

    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed
        self.loaders: dict[str, FakeLoader] = {}

    def spawn(
        self, cls: type[Any], *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS
    ) -> Handle[Any]:
        """A FakeLoader for a SourceLoader's arguments; any other role as the inline runtime."""
        if cls is not SourceLoader:
            return super().spawn(cls, *args, name=name, options=options)
        plan, _files, source, k, n, start, _keep, shadow, limit = args
        assert isinstance(plan, Plan)
        fresh = {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []}
        if (k, n, shadow, limit, start) != (0, 1, False, None, fresh) or source in self.loaders:
            raise RuntimeError(
                f"the stand-in runtime serves one primary loader per source from the start; "
                f"asked for loader {k} of {n} of '{source}' (shadow={shadow}, limit={limit}, "
                f"start={start})"
            )
        i = next(i for i, s in enumerate(SOURCES) if s.name == source)
        fake = (SOURCES[i], plan.batch.max_seq_len, self.seed * 1009 + i)
        handle = super().spawn(FakeLoader, *fake, name=name, options=options)
        self.loaders[source] = handle.obj
        return handle


class Bench:
    """A real Planner over stand-in loaders, for one (dp, tokens, max_seq_len, method)."""

    def __init__(self, folder: str, dp: int, tokens: int, cap: int, method: str, seed: int):
        self.tokens, self.dp = tokens, dp
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
        plan = validate_plan(data, base_dir=folder)
        files = {}
        for s in SOURCES:  # one stand-in file per source; the FakeLoaders never read it
            url = os.path.join(folder, f"{s.name}.jsonl")
            size = os.path.getsize(url)
            files[s.name] = SourceFiles(s.name, [(0, (File(f"{s.name}.jsonl", url, size),))])
        self.runtime = StandInRuntime(seed)
        config = PoolConfig(shadows={s.name: 0 for s in SOURCES})
        self.planner = Planner(plan, files, self.runtime, config)
        self.planner.start()
        self.loaders = [self.runtime.loaders[s.name] for s in SOURCES]

    def prepare(self) -> None:
        for s, f in zip(SOURCES, self.loaders):
            f.prepare(2.0 * s.weight * self.tokens + BLOCK_TOKENS)

    def step(self) -> dict[str, Any]:
        """Plan one step and hand it out to every rank, as ranks ask for it; what it took.

        ``seconds``: ``rank_plan(step, 0)``, which plans the step; ``slice_s``:
        ``rank_plan(step, r)`` for every rank; ``consume_s``: ``mark_consumed``
        for every rank. Also every rank's plan, and the step's history entry.
        """
        self.prepare()
        p = self.planner
        step = p.next_step
        t0 = time.perf_counter()
        p.rank_plan(step, 0)
        t1 = time.perf_counter()
        plans = [p.rank_plan(step, r) for r in range(self.dp)]
        t2 = time.perf_counter()
        for r in range(self.dp):
            p.mark_consumed(r, step)
        t3 = time.perf_counter()
        assert step not in p.plans, "every rank consumed the step: its columns are released"
        return {
            "seconds": t1 - t0,
            "slice_s": t2 - t1,
            "consume_s": t3 - t2,
            "plans": plans,
            "history": p.history[-1],
        }

    def bytes_per_item_in(self) -> float:
        items = sum(f.sent_items for f in self.loaders)
        return sum(f.sent_bytes for f in self.loaders) / max(1, items)

    def close(self) -> None:
        self.runtime.shutdown()


# ---- timing the planner's parts ------------------------------------------------------------


class Parts:
    """Seconds per part of one planner's steps, and ``assign``'s last call (inputs, result)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last_assign: tuple[tuple[Any, ...], Any] | None = None

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    def timed(self, fn: Callable[..., Any], part: str, keep: bool = False) -> Callable[..., Any]:
        """``fn``, its time added to ``part`` (and its call kept, with ``keep``)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(part, time.perf_counter() - t0)
            if keep:
                self.last_assign = (args, out)
            return out

        return call

    @contextlib.contextmanager
    def installed(self, planner: Planner) -> Iterator[Parts]:
        """Time ``planner``'s parts: its cursors' fetches and takes, its cost model, and the
        planner module's ``select_step`` and ``assign`` (all restored on exit)."""
        cursors, cost = planner.cursors, planner.cost
        fetches = [c.fetch for c in cursors]
        for c in cursors:  # instance attributes: the cursors' own peek runs unwrapped
            c.fetch = self.timed(c.fetch, "ingest")
            c.take = self.timed(c.take, "take")  # type: ignore[method-assign]
        planner.cost = TimedCost(cost, self)  # type: ignore[assignment]
        names = {"select_step": "select", "assign": "assign"}
        saved = {name: getattr(planner_mod, name) for name in names}
        for name, part in names.items():
            setattr(planner_mod, name, self.timed(saved[name], part, keep=part == "assign"))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(planner_mod, name, fn)
            for c, fetch in zip(cursors, fetches):
                c.fetch = fetch
                del c.take
            planner.cost = cost


class TimedCost:
    """A planner's cost model whose ``cost`` calls count as cost."""

    def __init__(self, model: Any, parts: Parts):
        self._model = model
        self.cost = parts.timed(model.cost, "cost")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def measure(bench: Bench, steps: int, warmup: int) -> dict[str, Any]:
    """Plan ``warmup + steps`` steps; medians of each part, bytes, balance, assign's inputs."""
    parts = Parts()
    rows: list[dict[str, float]] = []
    out_bytes, items, quality, calls = [], [], [], []
    with parts.installed(bench.planner):
        for i in range(warmup + steps):
            parts.seconds = {}
            got = bench.step()
            if i < warmup:
                continue
            seconds, plans, hist = got["seconds"], got["plans"], got["history"]
            s = dict(parts.seconds)
            s["select"] = s.get("select", 0.0) - s.get("ingest", 0.0)
            s["full"] = seconds
            s["plan"] = s["select"] + s.get("cost", 0.0) + s.get("assign", 0.0)
            s["rest"] = seconds - sum(s.get(k, 0.0) for k in ("plan", "ingest", "take"))
            s["slice"], s["consume"] = got["slice_s"], got["consume_s"]
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
    bench.close()
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


def split_assign(call: tuple[tuple[Any, ...], Any], groups: int) -> dict[str, float]:
    """PROTOTYPE: reference rows balanced whole over groups, then each group assigned alone."""
    (tokens, cost, ref_row, dp, rpr, cap, method), _ = call
    rows = dp * rpr
    per = rows // groups
    t0 = time.perf_counter()
    # the reference rows balanced whole over the groups, ``per`` rows each (a group is a rank)
    new_ref = bal.whole_rows(cost, ref_row, groups, per)
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
        times = [g["seconds"] for g in got]
        crit.append(max(times))
        total.append(sum(times))
        # the step's lower bound over all groups: the mean, or a group's largest item
        hist = [g["history"] for g in got]
        mean = sum(h["mean_cost"] for h in hist) / groups
        largest = max(
            (h["lower_bound"] for h in hist if h["lower_bound"] > h["mean_cost"]), default=0.0
        )
        ratio.append(max(h["max_cost"] for h in hist) / max(mean, largest))
    for b in benches:
        b.close()
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
    print("## Grid\n")
    print(
        "full: rank_plan(step, 0), which plans the step; rest: its columns sorted by rank and "
        "row, history and snapshot. rank_plan x DP: every rank's plan sliced from those columns "
        "(one call per rank); mark_consumed x DP: every rank's notice (the last releases the "
        "step's items). out: every rank plan pickled.\n"
    )
    print(
        "| tokens/step | DP | max_seq_len x rows/rank | method | items/step | select+cost+assign "
        "| (select / assign) | ingest | take | rest | full | full p95 | rank_plan x DP "
        "| mark_consumed x DP | makespan/LB | in MB/step | out MB/step |"
    )
    print("|" + "---:|" * 3 + "---|" + "---:|" * 13)
    for g_tokens, g_dp, cap, method, r in grid:
        print(row_line(f"{g_tokens // MIB}M", g_dp, cap, g_tokens // (g_dp * cap), method, r))

    print(f"\n## Target point: DP {TARGET[0]}, {TARGET[1] // MIB}M tokens per step\n")
    print(
        "| tokens/step | DP | max_seq_len x rows/rank | method | items/step | select+cost+assign "
        "| (select / assign) | ingest | take | rest | full | full p95 | rank_plan x DP "
        "| mark_consumed x DP | makespan/LB | in MB/step | out MB/step |"
    )
    print("|" + "---:|" * 3 + "---|" + "---:|" * 13)
    for cap, method, r in target:
        print(row_line(f"{tokens // MIB}M", dp, cap, tokens // (dp * cap), method, r))

    print("\n## Bounds and prototypes at the target point (prototypes * not in overlord yet)\n")
    print(
        "LB_pig is the pigeonhole bound (overlord.plan.balance.pigeonhole_bound); "
        "'early exit' is what assign spends on it before its solver: rows balanced whole, "
        "then the bound (assign returns the whole rows when they meet it). rank_plan x DP: "
        "kk's, from the table above. 'slowest (sum)': the critical path with one process per "
        "group, and the one-core total.\n"
    )
    print(
        "| max_seq_len x rows/rank | whole rows/LB | whole rows/LB_cap | whole rows/LB_pig "
        "| kk/LB_pig | early exit ms | rank_plan x DP ms "
        + "".join(
            f"| split assign* G={g}: slowest (sum) ms, makespan/LB "
            f"| independent groups* G={g}: slowest (sum) ms, makespan/LB "
            for g in GROUPS
        )
        + "|"
    )
    print("|" + "---:|" * (7 + 2 * len(GROUPS)))
    for e in protos:
        kk = next(r for c, m, r in target if c == e["cap"] and m == "kk")["ms"]
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
            f"| {kk['slice']:.1f} {cells}|"
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
        "and one rank_plan call per rank per step, each slicing the step's columns."
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
            f"{ms['full']:.1f} ms ({'meets' if ms['full'] < TARGET_MS else 'MISSES'}); then "
            f"{ms['slice']:.1f} ms of rank_plan calls and {ms['consume']:.1f} ms of "
            "mark_consumed for the step's ranks"
        )
    for e in protos:
        none = next(r for c, m, r in target if c == e["cap"] and m == "none")["ms"]
        parts = [
            f"independent groups G={g}: {e['groups'][g]['critical_ms']:.1f} ms critical path "
            f"({'meets' if e['groups'][g]['critical_ms'] < TARGET_MS else 'MISSES'})"
            for g in GROUPS
        ]
        if e["whole_pig"] <= 1 + 1e-9:
            parts.insert(
                0,
                "one process: whole rows meet LB_pig, so kk and lpt take assign's early exit "
                f"({e['exit_ms']:.1f} ms; measured above)",
            )
        else:
            parts.insert(
                0,
                f"one process: whole rows are {100 * (e['whole_pig'] - 1):.2f}% above LB_pig, "
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
    ax.set_title("Grid (labels: max_seq_len x rows/rank)", fontsize=10)
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
        f"| {ms['full_p95']:.1f} | {ms['slice']:.1f} | {ms['consume']:.1f} | {r['ratio']:.4f} "
        f"| {fmt_mb(r['in_bytes'])} "
        f"| {fmt_mb(r['out_bytes'])} |"
    )


if __name__ == "__main__":
    sys.exit(main())
