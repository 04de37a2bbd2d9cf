"""Running a plan as a trainer with every DP rank would: the loop, its dump and its summary.

Library functions that the CLI, the demo, the tests and the benchmarks share. The
``overlord`` command (:mod:`overlord.ops.cli`) prints what :func:`run_plan` returns.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from overlord.batch import Batch
from overlord.errors import OutputError, OverlordError
from overlord.loader import Loader
from overlord.plan.spec import Plan
from overlord.roles import planner as planner_module
from overlord.state import checkpoint


def _progress(total: int | None, initial: int, desc: str) -> Any:
    from tqdm import tqdm

    # on a terminal only: a bar in CI logs is noise
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=None, leave=False)


def dump_line(batch: Any) -> str:
    """One JSON line of ``--dump``: a rank's samples of a step."""
    line = {
        "step": batch.step,
        "rank": batch.rank,
        "samples": [{"source": s.source, "id": s.id, "tokens": s.tokens} for s in batch.samples],
        "tokens": batch.num_tokens,
        "cost": batch.cost,
    }
    if batch.cost_llm is not None:  # a plan with images: the cost's two terms
        line.update(cost_llm=batch.cost_llm, cost_encoder=batch.cost_encoder)
    return json.dumps(line, separators=(",", ":"))


def open_dump(path: str) -> TextIO:
    """Open ``--dump``'s file; :class:`OutputError` naming it if it cannot be."""
    try:
        return open(path, "w")  # noqa: SIM115 (closed by close_dump)
    except OSError as e:
        raise OutputError(f"cannot write the dump {path}: {e.strerror or e}") from None


def close_dump(dump: TextIO) -> None:
    """Close a dump; its last buffered lines failing (a full disk) is an :class:`OutputError`."""
    try:
        dump.close()
    except OSError as e:
        raise _dump_error(dump, e) from None


def _dump_error(dump: TextIO, e: OSError) -> OutputError:
    name = getattr(dump, "name", None) or "(the dump stream)"
    return OutputError(f"cannot write the dump {name}: {e.strerror or e}")


def run_plan(
    plan: Plan,
    steps: int,
    runtime: str = "inline",
    dump: TextIO | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    state: dict[str, Any] | None = None,
    progress: bool = True,
    report: str | None = None,
    train: Callable[[Batch], float] | None = None,
) -> dict[str, Any]:
    """Consume ``plan`` as a trainer with every DP rank would, up to global step ``steps``.

    With ``checkpoint_dir``, the planner's journal is kept in its ``journal/``
    folder, so that ``overlord replay`` rebuilds any step of the run.
    Returns a summary: steps, tokens, seconds, balance, mixture, loader counters.
    With ``report`` (a folder), also writes a Markdown report with plots there
    (:mod:`overlord.ops.run_report`); a report that cannot be written (a full disk,
    no matplotlib) does not lose the run: the summary says why under ``report_error``.
    ``train``, a stand-in for the trainer: called with each rank's batch, it returns
    the seconds the step took on that rank, which the rank reports to the planner
    (``client.report``); the report then plots predicted against measured time.
    """
    from overlord.ops.run_report import RunTrace, write_run_report

    trace = RunTrace() if report else None
    sample_every = max(1, (steps - int((state or {}).get("step", 0))) // 100)
    t0 = time.perf_counter()
    ckpt_bytes = 0
    # a run that checkpoints keeps its planner's journal beside them: any step replays
    journal = str(Path(checkpoint_dir) / "journal") if checkpoint_dir else None
    with Loader(plan, runtime=runtime, state=state, journal_dir=journal) as loader:
        first = loader.start_step
        # one reader per DP rank (in a mesh, its first process: CP rank 0, TP 0, stage 0)
        first_of = [plan.world.global_rank(dp=r) for r in range(plan.world.dp)]
        clients = [loader.rank_client(g, stop_step=steps) for g in first_of]
        tokens = 0
        history: dict[int, dict[str, Any]] = {}  # the planner keeps only recent steps'
        pull = max(1, planner_module.HISTORY_STEPS // 4)
        bar = _progress(steps, first, "overlord run") if progress else None
        for step in range(first, steps):
            costs, waits, batches = [], [], []
            for c in clients:
                t = time.perf_counter()
                batch = next(c)
                waits.append(time.perf_counter() - t)
                batches.append(batch)
                costs.append(batch.cost)
                tokens += batch.num_tokens
                if dump is not None:
                    try:
                        dump.write(dump_line(batch) + "\n")
                    except OSError as e:  # a full disk: the run stops, naming its output
                        raise _dump_error(dump, e) from None
            if train is not None:
                for c, b in zip(clients, batches):
                    c.report(b.step, seconds=train(b))
            if trace is not None:
                trace.step(step, costs, waits)
                if (step - first) % sample_every == 0 or step + 1 == steps:
                    trace.loaders.append((step, loader.monitor()))
            done = step + 1
            if (done - first) % pull == 0:
                gather_history(loader.stats(), history)
                if train is not None and trace is not None:
                    _gather_reported(loader, trace, done - pull, done - 1)
            if checkpoint_dir and checkpoint_every and done % checkpoint_every == 0:
                ckpt_bytes = checkpoint.save(checkpoint_dir, loader.state_dict()).stat().st_size
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - t0
        if checkpoint_dir:
            ckpt_bytes = checkpoint.save(checkpoint_dir, loader.state_dict()).stat().st_size
        stats = gather_history(loader.stats(), history)
        if train is not None and trace is not None:
            for c in clients:  # every report reaches the planner before it is read back
                flush = getattr(c, "flush", None)
                if flush is not None:
                    flush()
            _gather_reported(loader, trace, max(first, steps - pull), steps)
    if dump is not None:
        try:  # its last lines reach the disk before the summary says the run is done
            dump.flush()
        except OSError as e:
            raise _dump_error(dump, e) from None
    summary = summarize(plan, stats, first, steps, tokens, seconds, ckpt_bytes)
    if trace is not None and report:
        try:
            written = write_run_report(report, plan, summary, stats["history"], trace)
            summary["report"] = str(written)
        except OutputError as e:  # names the file
            summary["report_error"] = str(e)
        except (OSError, OverlordError) as e:
            summary["report_error"] = f"cannot write the report to {report}: {e}"
    return summary


def _gather_reported(loader: Loader, trace: Any, first: int, last: int) -> None:
    """The planner's feedback on steps ``first..last-1`` into ``trace`` (those it still keeps).

    Reports are one-way: the latest steps' may not have arrived yet; the run's end
    reads them again after a flush.
    """
    for step in range(max(first - 1, 0), last):
        got = loader.feedback(step)
        if got:
            trace.reported[step] = {int(r): dict(v) for r, v in got.items()}


def gather_history(stats: dict[str, Any], history: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``stats`` with its history joined to what was gathered before (kept in ``history``).

    The planner keeps only recent steps' statistics (``HISTORY_STEPS``); a tool that reports
    on a whole run asks for them every ``HISTORY_STEPS // 4`` steps and keeps them itself.
    """
    for h in stats["history"]:
        history.setdefault(h["step"], h)
    return {**stats, "history": [history[s] for s in sorted(history)]}


def summarize(
    plan: Plan,
    stats: dict[str, Any],
    first: int,
    last: int,
    tokens: int,
    seconds: float,
    ckpt_bytes: int,
) -> dict[str, Any]:
    """Figures of a run: throughput, balance against the per-rank baseline, mixture."""
    # steps planned ahead (prefetch) but never consumed are not part of the run
    hist = [h for h in stats["history"] if first <= h["step"] < last]
    names = stats["sources"]
    ratio = [h["max_cost"] / h["lower_bound"] for h in hist if h["lower_bound"] > 0]
    base = [h["baseline_max_cost"] / h["lower_bound"] for h in hist if h["lower_bound"] > 0]
    docs = [h["equal_docs_max_cost"] / h["lower_bound"] for h in hist if h["lower_bound"] > 0]
    tok = np.array([h["tokens"] for h in hist]) if hist else np.zeros((0, len(names)))
    want = np.array([h["weights"] for h in hist]) if hist else np.zeros((0, len(names)))
    steps_tokens = tok.sum(axis=1, keepdims=True)
    realized = tok.sum(axis=0) / max(tok.sum(), 1)
    target = (want * steps_tokens).sum(axis=0) / max(steps_tokens.sum(), 1)
    skipped = sum(s["skipped"] for s in stats["loaders"])
    return {
        "steps": [first, last],
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "balance_method": stats["method"],
        "balance_mean": float(np.mean(ratio)) if ratio else 1.0,
        "balance_p95": float(np.percentile(ratio, 95)) if ratio else 1.0,
        "baseline_balance_mean": float(np.mean(base)) if base else 1.0,
        # a loader that gives every rank the same number of the step's items, unpacked
        "equal_docs_balance_mean": float(np.mean(docs)) if docs else 1.0,
        "fill_mean": float(np.mean([h["fill"] for h in hist])) if hist else 0.0,
        "mixture": {
            n: {"realized": float(realized[i]), "target": float(target[i])}
            for i, n in enumerate(names)
        },
        "skipped_records": skipped,
        "skipped_examples": [e for s in stats["loaders"] for e in s["skipped_examples"]][:5],
        "dropped_docs": sum(s["dropped"] for s in stats["loaders"]),
        "read_retries": sum(s.get("read_retries", 0) for s in stats["loaders"]),
        "records": _records(names, stats["loaders"]),
        "checkpoint_bytes": ckpt_bytes,
        "scaling": _scaling(stats.get("scaling", [])),
        "faults": [e for e in stats.get("events", []) if e["event"] != "repartition"],
        **_rank_costs(hist),
        **_quarantine(stats),
    }


def _quarantine(stats: dict[str, Any]) -> dict[str, Any]:
    """A quarantined run's additions and the samples they skipped in consumed steps, per source."""
    q = stats.get("quarantine")
    if not q:
        return {}
    return {"quarantined_samples": dict(q["samples"]), "quarantine": list(q["entries"])}


def _rank_costs(hist: list[dict[str, Any]]) -> dict[str, Any]:
    """A vision plan's mean cost per rank over the steps: LLM and encoder terms, and the sum."""
    if not hist or "rank_cost_llm" not in hist[0]:
        return {}
    llm = np.mean([h["rank_cost_llm"] for h in hist], axis=0)
    enc = np.mean([h["rank_cost_encoder"] for h in hist], axis=0)
    return {
        "rank_cost": {
            "cost": (llm + enc).tolist(),
            "cost_llm": llm.tolist(),
            "cost_encoder": enc.tolist(),
        }
    }


def _records(names: list[str], loaders: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per source, its loaders' record counts together: read, empty, skipped, dropped, epochs.

    Each loader counts a file once, the first time it reads it (see
    ``SourceLoader.stats``); the counts of a source's loaders are summed, so a
    file that two loaders read (in different epochs) counts twice. ``epochs``
    is the most any of its loaders has begun.
    """
    out = {n: {"read": 0, "empty": 0, "skipped": 0, "dropped": 0, "epochs": 0} for n in names}
    for s in loaders:
        r = out[s["source"]]
        r["read"] += s["records"]
        r["empty"] += s["empty"]
        r["skipped"] += s["skipped"]
        r["dropped"] += s["dropped"]
        r["epochs"] = max(r["epochs"], s["epochs"])
    return out


def _scaling(decisions: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per source, the autoscaler's decisions that changed its size, with supply and demand."""
    out: dict[str, list[dict[str, Any]]] = {}
    for d in decisions:
        for name, src in d["sources"].items():
            size = (src["loaders"], src["threads"])
            seen = out.setdefault(name, [])
            if not seen or (seen[-1]["loaders"], seen[-1]["threads"]) != size:
                seen.append({"step": d["step"], **src})
    return out
