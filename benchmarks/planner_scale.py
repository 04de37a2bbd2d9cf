"""Planner scale: one planned step of overlord's planner at DP 512 to 16,384.

What is timed is overlord's real planner, :class:`overlord.roles.planner.Planner`
(the role that Ray runs as an actor), with its real ``LoaderPool``, one
``SourceCursor`` per source and its hierarchical assignment
(:mod:`overlord.plan.hierarchy`), built as a job builds it: ``Planner(plan,
files, runtime, PoolConfig(...))`` and ``planner.start()``. Only the source
loaders are stand-ins: the benchmark's runtime (the inline one) hands the pool
a :class:`FakeLoader` wherever it spawns a ``SourceLoader``. A FakeLoader
serves metadata blocks shaped exactly like a SourceLoader's (per shard: epoch,
shard position, file index; per item: index int64, tokens int32, record row
int64, chunk int32, image patches int32), drawn from ``synthetic.SOURCES``
(web, code, papers, books; long-tailed lengths, split at ``max_seq_len``), one
shard of about 1M tokens per block, made before the step is timed (in a job,
loaders make them in other processes). The cost model is the 7B one.

A step is driven as ranks drive it: ``rank_plan(step, 0)`` plans the step and
cuts rank 0's plan (*plan*), then ``rank_plan(step, r)`` for every other rank
(*rank plans*: slices of the step's columns, cut per call), then
``mark_consumed(r, step)`` for every rank (the last releases the step). The
planner balances its groups in its own thread here (the embedded runtime's
way: no assigners), and each group's balancing is timed, so that:

- **full** = plan + rank plans: everything the planner does for a step in one
  process (selection, the cost model, assignment, every rank's plan);
- **critical path** = plan - every group + the slowest group: the time to rank
  0's plan when the groups run in parallel, on assigner actors (Ray);
- ``select`` is mixing and the reference packing (selection proper, less the
  loader blocks' ingest), ``assign`` the whole assignment (split, groups, row
  swaps), ``groups`` its groups one after the other, ``slowest`` the slowest.

Balance: the most loaded rank over the capacity-aware bound (the tighter of
``pigeonhole_bound`` and ``capacity_bound``, :func:`overlord.plan.hierarchy.step_bound`),
for kk and for a per-rank loader (``none``, the reference rows cut in blocks),
and kk over the plain bound ``max(total / dp, largest item)``.

Bytes per step (measured as Ray would carry them, pickled; overlord itself
decodes none): *in*, the loader blocks of the step's items; *out*, every rank's
plan; *assigners*, each group's job and its result, there and back.

Grid: DP 512, 4,096, 16,384; 16M and 64M tokens per step; 1, 2, 4, 8 rows per
rank (``max_seq_len`` = tokens per rank / rows). Targets: full step under 50 ms
at DP 4,096 with 16M tokens, every rows-per-rank; under 200 ms at DP 16,384
with 64M. Then the planner's memory and its journal at DP 16,384 with 64M.

The process is pinned to one CPU; the load average is printed with the
timings (other work on the machine inflates them). Medians over the steps.
On a shared machine ``--cpu-time`` times the parts with the planner thread's
CPU time instead (``time.thread_time``): other processes then inflate the
figures far less (they still share the caches).

Run from the repository root::

    .venv/bin/python -m benchmarks.planner_scale            # the whole grid, ~3 minutes
    .venv/bin/python -m benchmarks.planner_scale --quick    # the two target points, ~30 s
    .venv/bin/python -m benchmarks.planner_scale --quick --cpu-time  # timed in CPU time

and it writes the plot ``benchmarks/planner_scale.png`` (``--plot ''`` for none).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import sys
import tempfile
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

import overlord.plan.hierarchy as hierarchy
import overlord.plan.step as step_mod
from benchmarks._lib.synthetic import SOURCES, SourceShape, doc_lengths, model_7b
from benchmarks._lib.timing import pin_one_cpu
from overlord.plan.balance import lower_bound
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.api import LoaderRole
from overlord.roles.loader_pool import PoolConfig
from overlord.roles.planner import Planner
from overlord.roles.source_loader import SourceLoader
from overlord.runtime.base import DEFAULT_OPTIONS, Handle, RoleOptions
from overlord.runtime.inline import InlineRuntime
from overlord.sources.catalog import File, SourceFiles

MIB = 1 << 20
DPS = (512, 4096, 16384)
TOKENS = (16 * MIB, 64 * MIB)
ROWS_PER_RANK = (1, 2, 4, 8)
TARGETS = {(4096, 16 * MIB): 50.0, (16384, 64 * MIB): 200.0}  # ms, full step
BLOCK_TOKENS = 1 << 20  # tokens of one loader block (one shard)
# what the parts are timed with: wall time, or this thread's CPU time (--cpu-time)
CLOCK: list[Callable[[], float]] = [time.perf_counter]
# what a SourceLoader's metadata block holds, and what the planner's cursor reads of it
BLOCK_SCALARS = ("epoch", "shard_pos", "file_index", "stop", "last")
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
            "stop": len(doc),
            "last": True,  # the whole shard in one block
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
    """A real Planner over stand-in loaders, for one (dp, tokens, max_seq_len) with kk."""

    def __init__(
        self, folder: str, dp: int, tokens: int, cap: int, seed: int, journal: str | None = None
    ):
        self.tokens, self.dp = tokens, dp
        data = {
            "sources": [
                {"name": s.name, "path": f"{s.name}.jsonl", "format": "jsonl"} for s in SOURCES
            ],
            "batch": {"tokens_per_step": tokens, "max_seq_len": cap},
            "mixture": {"schedule": [{"step": 0, "weights": {s.name: s.weight for s in SOURCES}}]},
            "world": {"dp": dp},
            "balance": {
                "method": "kk",
                "cost": {"model": {"params": 7e9, "layers": 32, "hidden": 4096}},
            },
        }
        self.plan = validate_plan(data, base_dir=folder)
        files = {}
        for s in SOURCES:  # one stand-in file per source; the FakeLoaders never read it
            url = os.path.join(folder, f"{s.name}.jsonl")
            size = os.path.getsize(url)
            files[s.name] = SourceFiles(s.name, [(0, (File(f"{s.name}.jsonl", url, size),))])
        self.runtime = StandInRuntime(seed)
        config = PoolConfig(shadows={s.name: 0 for s in SOURCES})
        self.planner = Planner(self.plan, files, self.runtime, config, journal=journal)
        self.planner.start()
        self.loaders = [self.runtime.loaders[s.name] for s in SOURCES]

    def prepare(self) -> None:
        for s, f in zip(SOURCES, self.loaders):
            f.prepare(2.0 * s.weight * self.tokens + BLOCK_TOKENS)

    def step(self, keep_plans: bool = False) -> dict[str, Any]:
        """Plan one step and hand it out to every rank, as ranks ask for it; what it took."""
        self.prepare()
        p = self.planner
        step = p.next_step
        t0 = CLOCK[0]()
        first = p.rank_plan(step, 0)
        t1 = CLOCK[0]()
        plans = [first] + [p.rank_plan(step, r) for r in range(1, self.dp)]
        t2 = CLOCK[0]()
        for r in range(self.dp):
            p.mark_consumed(r, step)
        t3 = CLOCK[0]()
        assert step not in p.plans, "every rank consumed the step: its columns are released"
        return {
            "plan_s": t1 - t0,
            "slice_s": t2 - t1,
            "consume_s": t3 - t2,
            "plans": plans if keep_plans else None,
            "history": p.history[-1],
        }

    def bytes_per_item_in(self) -> float:
        items = sum(f.sent_items for f in self.loaders)
        return sum(f.sent_bytes for f in self.loaders) / max(1, items)

    def close(self) -> None:
        self.planner.close()
        self.runtime.shutdown()


# ---- timing the planner's parts ------------------------------------------------------------


class Parts:
    """Seconds per part of one planner's step; each group's time; the step's items and jobs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.groups: list[float] = []
        self.jobs: list[tuple[Any, Any]] = []
        self.step_items: tuple[Any, ...] | None = None

    def reset(self) -> None:
        self.seconds, self.groups, self.jobs = {}, [], []

    def timed(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        """``fn``, its time added to ``part``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = CLOCK[0]()
            out = fn(*args, **kwargs)
            self.seconds[part] = self.seconds.get(part, 0.0) + CLOCK[0]() - t0
            if part == "assign":
                self.step_items = args[:3]  # tokens, cost, reference rows
            return out

        return call

    def group(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``assign_group``, each call timed, its job and result kept (to count bytes later)."""

        def call(job: dict[str, Any]) -> Any:
            t0 = CLOCK[0]()
            out = fn(job)
            self.groups.append(CLOCK[0]() - t0)
            self.jobs.append((job, out))
            return out

        return call

    @contextlib.contextmanager
    def installed(self, planner: Planner) -> Iterator[Parts]:
        """Time ``planner``'s parts: its cursors' fetches and takes, its cost model, and the
        step module's ``select_items`` and ``assign_step`` and every group (restored on exit)."""
        cursors, cost = planner.cursors, planner.cost
        fetches = [c.fetch for c in cursors]
        for c in cursors:  # instance attributes: the cursors' own peek runs unwrapped
            c.fetch = self.timed(c.fetch, "ingest")
            c.take = self.timed(c.take, "take")  # type: ignore[method-assign]
        planner.cost = TimedCost(cost, self)  # type: ignore[assignment]
        names = {"select_items": "select", "assign_step": "assign"}
        saved = {name: getattr(step_mod, name) for name in names}
        for name, part in names.items():
            setattr(step_mod, name, self.timed(saved[name], part))
        group = hierarchy.assign_group
        hierarchy.assign_group = self.group(group)  # run_here looks it up at each call
        try:
            yield self
        finally:
            hierarchy.assign_group = group
            for name, fn in saved.items():
                setattr(step_mod, name, fn)
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
    """Plan ``warmup + steps`` steps; medians of each part, bytes and balance."""
    parts = Parts()
    rows: list[dict[str, float]] = []
    out_bytes, job_bytes, items, quality = [], [], [], []
    cm = model_7b()
    p = bench.plan
    with parts.installed(bench.planner):
        for i in range(warmup + steps):
            parts.reset()
            got = bench.step(keep_plans=i == warmup)
            if i < warmup:
                continue
            s = dict(parts.seconds)
            s["select"] = s.get("select", 0.0) - s.get("ingest", 0.0)
            s["plan"] = got["plan_s"]
            s["groups"] = sum(parts.groups)
            s["slowest"] = max(parts.groups, default=0.0)
            s["critical"] = got["plan_s"] - s["groups"] + s["slowest"]
            s["slice"], s["consume"] = got["slice_s"], got["consume_s"]
            s["full"] = got["plan_s"] + got["slice_s"]
            s["rest"] = got["plan_s"] - sum(
                s.get(k, 0.0) for k in ("select", "ingest", "cost", "assign", "take")
            )
            rows.append(s)
            if got["plans"] is not None:  # bytes: once, outside the timed calls
                out_bytes.append(sum(len(pickle.dumps(rp, protocol=5)) for rp in got["plans"]))
                fields = {
                    k: v.dtype.itemsize * (v.shape[1] if v.ndim > 1 else 1)
                    for k, v in got["plans"][0].items()
                    if isinstance(v, np.ndarray)
                }
                job_bytes.append(
                    sum(len(pickle.dumps(x, protocol=5)) for pair in parts.jobs for x in pair)
                )
            hist = got["history"]
            tok, cost, _ = parts.step_items or ((), (), ())
            bound = hierarchy.step_bound(
                tok, cost, p.world.dp, p.rows_per_rank * p.batch.max_seq_len, cm.alpha, cm.beta
            )
            items.append(len(tok))
            quality.append(
                (
                    hist["max_cost"] / bound,
                    hist["baseline_max_cost"] / bound,
                    hist["max_cost"] / lower_bound(cost, p.world.dp),
                )
            )
    med = {k: 1e3 * float(np.median([r.get(k, 0.0) for r in rows])) for k in rows[0]}
    # the least of the steps: what the code costs when nothing else ran on its CPU meanwhile
    best = {k: 1e3 * float(min(r[k] for r in rows)) for k in ("full", "critical")}
    q = np.array(quality)
    n_items = float(np.mean(items))
    return {
        "ms": med,
        "best": best,
        "items": n_items,
        "groups": bench.planner.groups,
        "in_bytes": bench.bytes_per_item_in() * n_items,
        "out_bytes": float(np.mean(out_bytes)),
        "job_bytes": float(np.mean(job_bytes)),
        "kk_bound": float(q[:, 0].max()),
        "none_bound": float(q[:, 1].mean()),
        "kk_lb": float(q[:, 2].mean()),
        "out_fields": fields,
        "in_fields": bench.loaders[0].fields,
    }


def memory_and_journal(folder: str, dp: int, tokens: int, cap: int, seed: int) -> dict[str, Any]:
    """The planner's memory while it plans a step, and its journal's bytes per step."""
    journal = tempfile.mkdtemp(prefix="overlord-planner-scale-journal-")
    bench = Bench(folder, dp, tokens, cap, seed, journal=os.path.join(journal, "j"))
    p = bench.planner
    bench.step()  # warm-up
    before = (p.journal.stats() if p.journal else {})["bytes"]
    bench.prepare()
    step = p.next_step
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    p.rank_plan(step, 0)
    held, peak = (x - base for x in tracemalloc.get_traced_memory())
    tracemalloc.stop()
    columns = sum(v.nbytes for v in p.plans[step].values())
    for r in range(dp):
        p.mark_consumed(r, step)
    steps = 3
    for _ in range(steps - 1):
        bench.step()
    after = (p.journal.stats() if p.journal else {})["bytes"]
    per_kind = {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in after}
    bench.close()
    return {
        "held": held,
        "peak": peak,
        "columns": columns,
        "prefetch": bench.plan.batch.prefetch_steps,
        "journal": per_kind,
        "snapshot_every": bench.plan.recovery.snapshot_every,
    }


# ---- tables ---------------------------------------------------------------------------------


def fmt_mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def row_line(tokens: int, dp: int, cap: int, rpr: int, r: dict[str, Any]) -> str:
    ms = r["ms"]
    rest = ms["rest"] + ms.get("ingest", 0.0) + ms.get("take", 0.0)
    return (
        f"| {tokens // MIB}M | {dp:,} | {cap} x {rpr} | {r['items']:,.0f} | {r['groups']} "
        f"| {ms['select']:.1f} | {ms.get('cost', 0.0):.1f} | {ms.get('assign', 0.0):.1f} "
        f"| {ms['groups']:.1f} / {ms['slowest']:.1f} | {rest:.1f} "
        f"| {ms['plan']:.1f} | {ms['slice']:.1f} | **{ms['full']:.1f}** ({r['best']['full']:.1f}) "
        f"| **{ms['critical']:.1f}** ({r['best']['critical']:.1f}) "
        f"| {ms['consume']:.1f} | {r['kk_bound']:.4f} | {r['none_bound']:.4f} | {r['kk_lb']:.4f} "
        f"| {fmt_mb(r['in_bytes'])} | {fmt_mb(r['out_bytes'])} | {fmt_mb(r['job_bytes'])} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the two target points")
    ap.add_argument("--steps", type=int, help="measured steps per setting (default 3, quick 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this thread's CPU time, not wall time (a shared, loaded machine)",
    )
    ap.add_argument("--plot", default="benchmarks/planner_scale.png", help="PNG path ('' for none)")
    args = ap.parse_args(argv)
    steps = args.steps or (5 if args.quick else 3)
    CLOCK[0] = time.thread_time if args.cpu_time else time.perf_counter
    points = [
        (dp, tokens) for tokens in TOKENS for dp in DPS if not args.quick or (dp, tokens) in TARGETS
    ]
    pinned = pin_one_cpu()
    folder = tempfile.mkdtemp(prefix="overlord-planner-scale-")
    for s in SOURCES:  # the plan needs its files to exist; the stand-in loaders never read them
        with open(os.path.join(folder, f"{s.name}.jsonl"), "w") as f:
            f.write('{"text": "x"}\n')
    t_start = time.perf_counter()
    grid = []
    for dp, tokens in points:
        for rpr in ROWS_PER_RANK:
            cap = tokens // (dp * rpr)
            bench = Bench(folder, dp, tokens, cap, args.seed)
            grid.append((tokens, dp, cap, rpr, measure(bench, steps, 1)))
            bench.close()
            print(row_line(tokens, dp, cap, rpr, grid[-1][4]), file=sys.stderr, flush=True)
    load = os.getloadavg()
    mem = memory_and_journal(folder, 16384, 64 * MIB, 4096, args.seed)

    print(f"# Planner scale: one step of overlord's planner, {pinned}\n")
    print(
        f"{steps} measured steps per setting after one warm-up; medians (least of the steps in "
        f"brackets), ms of {'CPU time of the planner thread' if args.cpu_time else 'wall time'}. "
        "Load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} after the grid; "
        f"{time.perf_counter() - t_start:.0f} s in all. Groups of at most "
        f"{Plan.model_fields['balance'].default.group_ranks} ranks (balance.group_ranks).\n"
    )
    print(
        "| tokens/step | DP | max_seq_len x rows/rank | items | groups | select | cost "
        "| assign | groups: all / slowest | rest | plan | rank plans | full (least) "
        "| critical path (least) "
        "| consume | kk / bound (worst step) | none / bound | kk / LB | in MB | out MB "
        "| assigners MB |"
    )
    print("|" + "---:|" * 21)
    for tokens, dp, cap, rpr, r in grid:
        print(row_line(tokens, dp, cap, rpr, r))

    print("\n## Targets: the full step\n")
    for (dp, tokens), target in TARGETS.items():
        for g_tokens, g_dp, cap, rpr, r in grid:
            if (g_dp, g_tokens) != (dp, tokens):
                continue
            ms, best = r["ms"], r["best"]
            verdict = "meets" if ms["full"] < target else "MISSES"
            crit = "meets" if ms["critical"] < target else "MISSES"
            print(
                f"- DP {dp:,}, {tokens // MIB}M, {cap} x {rpr}: full {ms['full']:.1f} ms, least "
                f"{best['full']:.1f} ({verdict} {target:.0f} ms), of which rank plans "
                f"{ms['slice']:.1f}; critical path {ms['critical']:.1f} ms, least "
                f"{best['critical']:.1f} ({crit}); kk {100 * (r['kk_bound'] - 1):.2f}% above "
                "the bound"
            )

    print("\n## Metadata bytes per step\n")
    sample = grid[0][4]
    fin, fout = sample["in_fields"], sample["out_fields"]
    print(
        f"- In (loaders to planner): {sample['in_bytes'] / sample['items']:.1f} B per item, "
        "as pickled blocks of about 1M tokens: "
        + " + ".join(f"{k} {v}" for k, v in fin.items())
        + f" = {sum(fin.values())} B, plus a few hundred bytes per block. It grows with the "
        "items of a step (tokens per step / item length), not with DP."
    )
    per_rank = []
    for _, dp, _, _, r in grid:
        per_rank.append((r["out_bytes"] - r["items"] * sum(fout.values())) / dp)
    print(
        "- Out (planner to constructors): per item "
        + " + ".join(f"{k} {v}" for k, v in fout.items())
        + f" = {sum(fout.values())} B, plus {np.median(per_rank):.0f} B per rank (the pickled "
        "dict and array headers): items x 80 B + DP x that."
    )
    print(
        "- Assigners (there and back, on Ray): a group's tokens, costs and reference rows "
        "(24 B per item) out, its rows (8 B per item) back, plus a few hundred bytes per group."
    )

    print("\n## The planner's memory and journal at DP 16,384, 64M tokens, 4096 x 1\n")
    print(
        f"- Planning one step: {mem['peak'] / 1e6:.1f} MB at the peak (Python allocations, "
        f"tracemalloc), {mem['held'] / 1e6:.1f} MB still held after it; the step's columns "
        f"{mem['columns'] / 1e6:.1f} MB, kept until every rank consumed it (up to "
        f"prefetch_steps + 1 = {mem['prefetch'] + 1} steps ahead)."
    )
    print(
        "- Journal bytes per step: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(mem["journal"].items()))
        + f" (a full snapshot every {mem['snapshot_every']} steps; the deltas do not grow "
        "with DP)."
    )
    if args.plot:
        plot(grid, args.plot)
        print(f"\nPlot: {args.plot}")
    return 0


def plot(grid: list[tuple[int, int, int, int, dict[str, Any]]], path: str) -> None:
    """Full step and critical path against DP, per tokens and rows per rank; bytes against DP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 6.2))
    dps_all = sorted({g[1] for g in grid})
    for ax, key, title in (
        (axes[0], "full", "Full step, one process (select + assign + every rank plan)"),
        (axes[1], "critical", "Critical path (groups in parallel), to rank 0's plan"),
    ):
        for i, tokens in enumerate(sorted({g[0] for g in grid})):
            for j, rpr in enumerate(ROWS_PER_RANK):
                pts = sorted(
                    (g for g in grid if g[0] == tokens and g[3] == rpr), key=lambda g: g[1]
                )
                if not pts:
                    continue
                ax.plot(
                    [g[1] for g in pts],
                    [g[4]["ms"][key] for g in pts],
                    "o-" if i == 0 else "s--",
                    color=plt.get_cmap("tab10")(j),
                    label=f"{tokens // MIB}M, {rpr} rows/rank",
                )
        for (dp, tokens), target in TARGETS.items():
            ax.plot([dp], [target], "r*", ms=12)
            ax.annotate(f"target {target:.0f} ms ({tokens // MIB}M)", (dp, target), fontsize=7)
        log_dp_axes(ax, dps_all)
        ax.set_ylabel("ms per step (median)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        plain_log_ticks(ax)
        ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    for i, tokens in enumerate(sorted({g[0] for g in grid})):
        pts = sorted((g for g in grid if g[0] == tokens and g[3] == 1), key=lambda g: g[1])
        for key, style, name in (("in_bytes", "s--", "in"), ("out_bytes", "o-", "out")):
            ax.plot(
                [g[1] for g in pts],
                [g[4][key] / 1e6 for g in pts],
                style,
                color=plt.get_cmap("tab10")(i),
                label=f"{tokens // MIB}M, 1 row/rank: {name}",
            )
    log_dp_axes(ax, dps_all)
    ax.set_ylabel("MB per step (pickled)")
    ax.set_title("Metadata bytes per step", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    plain_log_ticks(ax)
    ax.legend(fontsize=7)
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


if __name__ == "__main__":
    sys.exit(main())
