"""``overlord why STEP WHERE``: why a step was slow, rank by rank, and what made it so.

For one step it prints every rank's predicted cost (the cost model the step
was balanced with) and, where the trainers reported (``client.report``), its
measured seconds; the slowest rank (by measured time where every rank
reported, else by predicted cost); and, for that rank, the sources and the
samples that made it slow: each source's share of the rank's cost, and its
costliest documents (the longest: attention costs about ``L**2``); where the
plan has image sources, the rank's images, their patches and the encoder's
share of its cost.

``WHERE`` is a checkpoint folder of ``overlord run --checkpoint-dir`` (its kept
journal: the step's samples and the reports recorded there), a run folder of
that journal (``DIR/journal/run-NNNN``, or a planner's ``recovery.journal_dir``
run with its ``plan.json``), or the name of a live job on Ray (its planner
keeps the recent steps' reports). The samples are the step's exact batches,
rebuilt by :func:`overlord.replays.build`, so the explanation is about what
the trainers received, not an estimate of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from overlord.batch import Batch
from overlord.errors import OutputError
from overlord.plan.cost import CostModel
from overlord.plan.spec import Plan, validate_plan
from overlord.replays import Point, ReplayError, build, find_point, journal_point
from overlord.roles.feedback import reports
from overlord.state import runs


@dataclass
class RankLine:
    """One rank of the step: what was predicted, what was measured, what it held."""

    rank: int
    predicted: float  # the cost the step was balanced with (the plan's units)
    seconds: float | None  # the rank's reported step time (None: not reported)
    tokens: int
    documents: int


@dataclass
class Culprit:
    """One costly document of the slowest rank."""

    source: str
    id: str
    tokens: int
    share: float  # of the rank's LLM cost


@dataclass
class Why:
    """The answer for one step: every rank, the slowest, and what made it slow."""

    step: int
    ranks: list[RankLine]
    slowest: int
    by: str  # "measured" or "predicted": what picked the slowest rank
    sources: dict[str, float] = field(default_factory=dict)  # share of its cost per source
    culprits: list[Culprit] = field(default_factory=list)
    images: int = 0  # the slowest rank's images (a plan with image sources)
    patches: int = 0  # ... and their patches, which the encoder's cost grows with
    encoder_share: float | None = None  # the encoder's part of the rank's predicted cost

    def as_dict(self) -> dict[str, Any]:
        """The answer as JSON-ready data (``--json``)."""
        return {
            "step": self.step,
            "slowest": self.slowest,
            "by": self.by,
            "ranks": [vars(r) for r in self.ranks],
            "sources": self.sources,
            "culprits": [vars(c) for c in self.culprits],
            "images": self.images,
            "patches": self.patches,
            "encoder_share": self.encoder_share,
        }


def doc_costs(model: CostModel, batch: Batch) -> np.ndarray:
    """Each sample's cost under ``model`` (its LLM term: ``alpha L + beta L**2``)."""
    lengths = np.array([s.tokens for s in batch.samples], dtype=np.float64)
    return np.asarray(model.cost(lengths), dtype=np.float64)


def model_at(point: Point) -> CostModel:
    """The cost model step ``point.step`` was balanced with: a refit's, else the plan's."""
    model = CostModel.from_spec(point.plan.balance.cost)
    fit = (point.state.get("feedback") or {}).get("cost") or {}
    if "alpha" in fit and "beta" in fit:  # refit from the trainers' reports
        model = CostModel(float(fit["alpha"]), float(fit["beta"]), model.patch_alpha,
                          model.patch_beta)  # fmt: skip
    return model


def explain(
    point: Point,
    batches: list[Batch],
    reported: dict[int, dict[str, Any]] | None,
    top: int = 5,
) -> Why:
    """The :class:`Why` of ``point.step`` from its batches and its reports (None: none)."""
    model = model_at(point)
    ranks = []
    for b in batches:
        rep = (reported or {}).get(b.rank, {})
        seconds = rep.get("seconds")
        ranks.append(
            RankLine(
                b.rank,
                float(rep.get("predicted", b.cost)),
                None if seconds is None else float(seconds),
                int(b.num_tokens),
                len(b.samples),
            )
        )
    measured = all(r.seconds is not None for r in ranks) and bool(ranks)
    key = (lambda r: r.seconds) if measured else (lambda r: r.predicted)
    slowest = max(ranks, key=key).rank
    batch = next(b for b in batches if b.rank == slowest)
    costs = doc_costs(model, batch)
    total = float(costs.sum()) or 1.0
    sources: dict[str, float] = {}
    for s, c in zip(batch.samples, costs):
        sources[s.source] = sources.get(s.source, 0.0) + float(c) / total
    order = np.argsort(-costs, kind="stable")[:top]
    culprits = [
        Culprit(
            batch.samples[i].source,
            batch.samples[i].id,
            int(batch.samples[i].tokens),
            float(costs[i]) / total,
        )
        for i in order.tolist()
    ]
    why = Why(
        point.step,
        ranks,
        slowest,
        "measured" if measured else "predicted",
        dict(sorted(sources.items(), key=lambda kv: -kv[1])),
        culprits,
    )
    if batch.image_grid is not None and len(batch.image_grid):  # the encoder's part
        grid = np.asarray(batch.image_grid, dtype=np.int64)
        why.images, why.patches = len(grid), int((grid[:, 0] * grid[:, 1]).sum())
        if batch.cost_encoder is not None and batch.cost > 0:
            why.encoder_share = float(batch.cost_encoder) / float(batch.cost)
    return why


def locate(where: str, step: int, plan: Plan | None, address: str | None,
           timeout: float | None) -> tuple[Point, dict[int, dict[str, Any]] | None]:  # fmt: skip
    """The state before ``step`` and the step's reports, from ``where`` (see the module)."""
    folder = Path(where)
    if folder.is_dir() and (folder / runs.PLAN_FILE).is_file():  # a run folder of a journal
        doc = runs.read_plan(folder)
        run_plan = plan or validate_plan(doc["plan"], base_dir=doc.get("base_dir"))
        held: list[str] = []
        point = journal_point(folder, run_plan, step, held)
        if point is None:
            raise ReplayError(f"step {step} is not in {folder}: " + ("; ".join(held) or "empty"))
        return point, reports(folder).get(step)
    point = find_point(where, step, plan, address, timeout)
    if folder.is_dir():
        found: dict[int, dict[str, Any]] | None = None
        for run in runs.runs(folder / "journal"):  # the newest run's reports win
            found = reports(run).get(step, found)
        return point, found
    return point, _live_reports(where, step, address, timeout)


def _live_reports(job: str, step: int, address: str | None,
                  timeout: float | None) -> dict[int, dict[str, Any]] | None:  # fmt: skip
    """A live job's reports of ``step``, from its planner (None: not kept)."""
    from overlord.roles.api import OpsRole
    from overlord.runtime.ray_runtime import lookup

    del address, timeout  # joined already, by find_point
    got = lookup(job, "planner").call(OpsRole.feedback, step).result()
    return None if got is None else {int(r): v for r, v in got.items()}


def print_why(why: Why, out: TextIO) -> None:
    """The answer as a table, then the slowest rank's sources and documents."""
    n = len(why.ranks)
    mean_p = sum(r.predicted for r in why.ranks) / n
    timed = [r.seconds for r in why.ranks if r.seconds is not None]
    mean_s = sum(timed) / len(timed) if timed else None
    print(f"step {why.step}: {n} ranks", file=out)
    print(f"{'rank':>4}  {'predicted':>11}  {'vs mean':>7}  {'measured s':>10}  "
          f"{'tokens':>8}  {'docs':>5}", file=out)  # fmt: skip
    for r in why.ranks:
        sec = "-" if r.seconds is None else f"{r.seconds:.4f}"
        mark = "  <- slowest" if r.rank == why.slowest else ""
        print(f"{r.rank:>4}  {r.predicted:>11.4g}  {r.predicted / (mean_p or 1):>6.2f}x  "
              f"{sec:>10}  {r.tokens:>8}  {r.documents:>5}{mark}", file=out)  # fmt: skip
    slow = next(r for r in why.ranks if r.rank == why.slowest)
    if why.by == "measured" and mean_s:
        assert slow.seconds is not None
        print(f"slowest: rank {why.slowest}, measured {slow.seconds:.4f} s, "
              f"{slow.seconds / mean_s:.2f}x the mean rank", file=out)  # fmt: skip
    else:
        ratio = slow.predicted / (mean_p or 1)
        print(f"slowest: rank {why.slowest} by predicted cost, {ratio:.2f}x the mean rank "
              "(no step times reported for every rank)", file=out)  # fmt: skip
    shares = ", ".join(f"{s} {100 * v:.0f}%" for s, v in why.sources.items())
    print(f"its cost by source: {shares}", file=out)
    if why.images:
        enc = "" if why.encoder_share is None else f", {100 * why.encoder_share:.0f}% of its cost"
        print(f"its images: {why.images} of {why.patches} patches in all (the encoder{enc})",
              file=out)  # fmt: skip
    print("its costliest documents (share of its LLM cost):", file=out)
    for c in why.culprits:
        print(f"  {100 * c.share:5.1f}%  {c.tokens:>7} tokens  {c.source}  {c.id}", file=out)


def add_parser(sub: Any, connect_timeout: Any) -> None:
    """The ``why`` subcommand's parser, under ``overlord``'s subparsers ``sub``."""
    w = sub.add_parser("why", help="why a step was slow: every rank's predicted and measured "
                       "time, the slowest rank and the samples that made it slow")  # fmt: skip
    w.add_argument("step", help="the step (a number)")
    w.add_argument("where", help="a checkpoint folder, a run folder of its journal, or a live "
                   "job's name")  # fmt: skip
    w.add_argument("--top", type=int, default=5, help="documents to list (default 5)")
    w.add_argument("--plan", help="the plan, for a folder of checkpoints without a kept journal")
    w.add_argument("--json", metavar="FILE", help="also write the answer as JSON to FILE")
    w.add_argument("--address", help="with a job name: the Ray cluster (default: RAY_ADDRESS)")
    w.add_argument("--connect-timeout", type=connect_timeout, metavar="SECONDS",
                   help="give up joining the Ray cluster after this long")  # fmt: skip
    w.set_defaults(func=command)


def command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``overlord why``; 0 when the step was explained."""
    from overlord.plans import load_plan

    step_text, where = args.step, args.where
    if not step_text.lstrip("-").isdigit() and where.lstrip("-").isdigit():
        step_text, where = where, step_text  # ``why DIR STEP`` reads the same
    if not step_text.lstrip("-").isdigit():
        raise ReplayError(f"step {step_text!r}: not a number")
    step = int(step_text)
    plan = load_plan(args.plan) if args.plan else None
    point, reported = locate(where, step, plan, args.address, args.connect_timeout)
    why = explain(point, build(point), reported, top=args.top)
    print_why(why, out or sys.stdout)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(why.as_dict(), indent=1))
        except OSError as e:
            raise OutputError(f"cannot write {args.json}: {e.strerror or e}") from None
    return 0
