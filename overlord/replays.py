"""Replay a step: the batches every rank received at step ``S``, rebuilt exactly.

Two parts. :func:`find_point` finds the state before step ``S`` and the plan in
force there: from a run's kept journal (:mod:`overlord.state.runs`: a snapshot
and the deltas after it give the state before any step planned), else from the
newest checkpoint at or before ``S``, planned forward to it without building
batches, or from a live job's planner (its kept states, else its journal).
:func:`build` then runs the step with the code every run uses: a
:class:`~overlord.Loader` on the inline runtime started from that state (each
loader seeks to its cursor; nothing is read from a source's start), and takes
one batch of every rank. The state is used whole, whatever keys it holds, so
what a run puts in its state replays as the run planned it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlord.batch import Batch
from overlord.errors import LoaderError
from overlord.loader import Loader
from overlord.plan.schedule import Schedule
from overlord.plan.spec import Plan
from overlord.plans import validate_plan
from overlord.roles.api import OpsRole, PlannerRole
from overlord.state import checkpoint, journal, runs
from overlord.state import format as statefmt


class ReplayError(LoaderError):
    """A step cannot be replayed from what was given: says what holds which steps."""


@dataclass
class Point:
    """The state before ``step`` (a whole state document) and the plan in force there."""

    plan: Plan
    state: dict[str, Any]
    step: int
    origin: str  # where the state came from, for messages: a journal, a checkpoint, a job


def replay(
    where: str | Path,
    step: int,
    plan: Plan | None = None,
    address: str | None = None,
    connect_timeout: float | None = None,
) -> list[Batch]:
    """The batches of step ``step`` as the trainers received them, per rank.

    ``where``: a checkpoint folder of ``overlord run --checkpoint-dir`` (its kept
    journal, else its checkpoints), or the name of a live job (``overlord serve
    --name``) on the Ray cluster at ``address``. Index ``r`` of the list is DP rank
    ``r``'s batch; in a mesh (``cp``, ``tp`` or ``pp`` above 1) it is global rank
    ``r``'s, as :meth:`overlord.Loader.rank_client` gives it. ``plan`` is needed
    only for a folder of checkpoints without a kept journal.
    """
    return build(find_point(where, step, plan, address, connect_timeout))


def find_point(
    where: str | Path,
    step: int,
    plan: Plan | None = None,
    address: str | None = None,
    connect_timeout: float | None = None,
) -> Point:
    """The state before ``step`` and its plan, from a folder or a live job (see :func:`replay`)."""
    if step < 0:
        raise ReplayError(f"step {step}: steps count from 0")
    folder = Path(where)
    if folder.is_dir():
        return _from_folder(folder, step, plan)
    if folder.exists():
        raise ReplayError(f"{where} is a file: give a checkpoint folder or a live job's name")
    if os.sep in str(where) or str(where).startswith("."):
        raise ReplayError(f"no folder {where}: give a checkpoint folder or a live job's name")
    return _from_job(str(where), step, address, connect_timeout)


def build(point: Point) -> list[Batch]:
    """Run step ``point.step`` from ``point.state``, inline; every rank's batch.

    The plan's monitoring port and journal folder are left out (a replay serves
    no metrics and keeps no journal) and it builds one step ahead only; none of
    these decides a sample (they are outside the stream's fingerprint).
    """
    data = point.plan.model_dump(mode="json")
    data["batch"]["prefetch_steps"] = 1
    data["monitoring"]["port"] = None
    data["recovery"]["journal_dir"] = None
    plan = validate_plan(data, base_dir=point.plan.base_dir)
    world, stop = plan.world, point.step + 1
    with Loader(plan, runtime="inline", state=point.state) as loader:
        if world.peers == 1:
            clients = [loader.client(r, stop_step=stop) for r in range(world.dp)]
        else:
            clients = [loader.rank_client(g, stop_step=stop) for g in range(world.size)]
        batches = [next(c) for c in clients]
    for b in batches:  # a plain invariant: the stream resumed where the state says
        assert b.step == point.step, (b.step, point.step)
    return batches


def whole(state: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """A journal's state (the ledger's) as a checkpoint holds it: with version and fingerprint."""
    return {
        "version": statefmt.STATE_VERSION,
        "fingerprint": plan.stream_fingerprint(),
        **state,
    }


def _from_folder(folder: Path, step: int, plan: Plan | None) -> Point:
    held: list[str] = []  # what the folder holds, for the message if the step is not there
    run_plans: list[Plan] = []
    for run in reversed(runs.runs(folder / "journal")):  # the newest run wins: it is the run's
        doc = runs.read_plan(run)
        run_plan = validate_plan(doc["plan"], base_dir=doc["base_dir"])
        run_plans.append(run_plan)
        point = _journal_point(run, run_plan, step, held)
        if point is not None:
            return point
    points = _checkpoints(folder)
    if points:
        held.append("checkpoints at steps " + ", ".join(str(s) for s, _ in points))
    if not held:
        raise ReplayError(
            f"{folder} holds no checkpoint (step-*.json) and no kept journal (journal/run-*): "
            "give the folder of `overlord run --checkpoint-dir`"
        )
    # steps before the newest checkpoint were consumed: one of them replays from an earlier one
    earlier = [(s, p) for s, p in points if s <= step]
    if not earlier or step >= points[-1][0]:
        raise ReplayError(f"step {step} is not in {folder}'s range: " + "; ".join(held))
    start, path = earlier[-1]
    state = checkpoint.load(path)
    chosen = plan or next(
        (p for p in run_plans if p.stream_fingerprint() == state.get("fingerprint")), None
    )
    if chosen is None:
        raise ReplayError(
            f"step {step} replays from the checkpoint {path}, and {folder} keeps no plan of "
            "its run: give the plan it ran (--plan)"
        )
    return Point(chosen, _planned_forward(chosen, state, step), step, f"checkpoint {path}")


def _journal_point(run: Path, plan: Plan, step: int, held: list[str]) -> Point | None:
    """The state before ``step`` from one run's kept journal, or None (said in ``held``).

    Reads two segments at most: the newest that starts at or before ``step``,
    and the last (where the run's last consumed step is recorded).
    """
    segs = journal.segments(run)
    if not segs:
        return None
    at = [p for p in segs if journal.start_of(p) <= step][-1:]
    read = journal.recover(run, at + [segs[-1]] if at and at[0] != segs[-1] else [segs[-1]])
    # the steps every rank consumed: those planned ahead and never trained are not the run's
    tail = read[-1]
    last = min(tail.snapshot["step"] + len(tail.deltas) - 1, max(r.consumed for r in read))
    if last >= journal.start_of(segs[0]):
        held.append(f"{run.name}: steps {journal.start_of(segs[0])}..{last}")
    if not at or step > last:
        return None
    first = read[0]
    states, deltas = statefmt.replay([(first.snapshot, first.deltas)], Schedule(plan).named)
    if step not in deltas:  # a segment torn before the step: every segment of the run
        states, deltas = statefmt.replay(
            [(r.snapshot, r.deltas) for r in journal.recover(run)], Schedule(plan).named
        )
    if step not in deltas:
        return None
    return Point(plan, whole(states[step], plan), step, f"journal {run}")


def _checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints of a folder, by step."""
    found = []
    for p in folder.glob("step-*.json"):
        digits = p.name[5:-5]
        if digits.isdigit():
            found.append((int(digits), p))
    return sorted(found)


def _planned_forward(plan: Plan, state: dict[str, Any], step: int) -> dict[str, Any]:
    """The state before ``step``, planned from ``state`` (an earlier one) without batches."""
    start = int(state["step"])
    if start == step:
        return state
    data = plan.model_dump(mode="json")
    data["monitoring"]["port"] = None
    data["recovery"]["journal_dir"] = None
    lean = validate_plan(data, base_dir=plan.base_dir)
    with Loader(lean, runtime="inline", state=state, build_batches=False) as loader:
        loader.dry_run(step - start)
        found: dict[str, Any] = loader.planner.call(PlannerRole.state_dict, step).result()
    return found


def _from_job(job: str, step: int, address: str | None, timeout: float | None) -> Point:
    """The state before ``step`` from the live job ``job``'s planner, or its journal."""
    from overlord.runtime.ray_runtime import init_ray, lookup
    from overlord.serve import job_address

    address = address or os.environ.get("RAY_ADDRESS") or job_address(job)
    if address is None:
        raise ReplayError(
            f"no folder {job}, and no job named {job!r} served on this machine (overlord "
            "serve --name); for a job on another cluster give its address (--address)"
        )
    init_ray(address, timeout)
    planner = lookup(job, "planner")  # a LoaderError naming the job if it is not there
    got: dict[str, Any] = planner.call(OpsRole.replay_point, step).result()
    plan = validate_plan(got["plan"], base_dir=got["base_dir"])
    if step >= got["next_step"]:
        raise ReplayError(
            f"step {step} of job {job!r} is not planned yet: its planner has planned steps "
            f"{got['first']}..{got['next_step'] - 1}"
        )
    if got["state"] is not None:
        return Point(plan, got["state"], step, f"job {job}")
    if got["journal"] is not None and Path(got["journal"]).is_dir():
        segments = journal.recover(got["journal"])
        pairs = [(r.snapshot, r.deltas) for r in segments]
        states, deltas = statefmt.replay(pairs, Schedule(plan).named)
        if step in deltas:
            return Point(plan, whole(states[step], plan), step, f"journal {got['journal']}")
    raise ReplayError(
        f"step {step} of job {job!r} is no longer kept: its planner keeps the steps not yet "
        "consumed and its journal the newest snapshot's on; replay it from a checkpoint folder"
    )


__all__ = ["Point", "ReplayError", "build", "find_point", "replay"]
