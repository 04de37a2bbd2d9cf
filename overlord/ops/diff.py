"""``overlord diff OLD_CHECKPOINT NEW_PLAN``: what a resume with a changed plan would do.

Prints one line per change, allowed or refused and why
(:func:`overlord.state.changes.classify`), and the recorded files of each kept
source that are missing or changed size, before anything runs. Exit status 0
when the plan resumes the checkpoint, 1 when something is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from overlord.errors import CheckpointError
from overlord.plan.spec import Plan
from overlord.plan.spec import load_plan as plan_document
from overlord.plans import load_plan
from overlord.sources.catalog import job_files
from overlord.state import checkpoint, runs
from overlord.state.changes import Change, classify


def register(sub: Any) -> None:
    """The ``diff`` subcommand's parser, under ``overlord``'s subparsers ``sub``."""
    d = sub.add_parser(
        "diff",
        help="what resuming a checkpoint with a changed plan would do, change by change",
    )
    d.add_argument("checkpoint", help="a checkpoint file, or a folder (its newest)")
    d.add_argument("plan", help="the plan to resume it with")
    d.add_argument(
        "--was",
        metavar="OLD_PLAN",
        help="the plan the checkpoint was written with: names every changed field with its "
        "old and new value (the checkpoint records only fingerprints of them; default: the "
        "plan its run kept in the folder's journal, where there is one)",
    )
    d.set_defaults(func=run_diff)


def run_diff(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the classification; 1 if a change is refused, else 0."""
    out = out or sys.stdout
    path = Path(args.checkpoint)
    where = checkpoint.latest(path) if path.is_dir() else path
    if where is None:
        raise CheckpointError(f"no checkpoint (step-*.json) in {path}")
    state = checkpoint.load(where)
    plan = load_plan(args.plan)
    # the old plan as a document alone: the files of a source it had may be gone
    # (else the plan its run kept beside it, when the folder keeps one)
    before = (
        plan_document(args.was)
        if args.was
        else runs.kept_plan(where.parent, state.get("fingerprint"))
    )
    checkpoint.check_document(state, plan)
    changes = classify(state, plan, before)
    if not any(c.field == "sources" and not c.allowed for c in changes):
        changes += file_changes(state, plan)
    print(
        f"checkpoint {where} (step {state['step']}, sources {', '.join(state['sources'])}) "
        f"-> plan {args.plan}",
        file=out,
    )
    for c in changes:
        print(c.line(), file=out)
    no = sum(not c.allowed for c in changes)
    if not changes:
        print("no change: the plan resumes the checkpoint as it was written", file=out)
    else:
        print(f"{len(changes) - no} allowed, {no} refused", file=out)
    if no:
        print(
            "the plan cannot resume this checkpoint: change what is refused back, or start "
            "the plan without resuming",
            file=out,
        )
    return 1 if no else 0


def file_changes(state: dict[str, Any], plan: Plan) -> list[Change]:
    """The recorded files of kept sources that are missing or changed size (refused)."""
    saved = state["sources"]
    kept = [  # a source read another way is refused already; its old files say nothing new
        s for s in plan.sources
        if s.name in saved and saved[s.name].get("fingerprint") == plan.source_fingerprint(s.name)
    ]  # fmt: skip
    try:
        job_files(
            ((s.name, [s.path] if isinstance(s.path, str) else list(s.path)) for s in kept),
            str(plan.base_dir),
            state,
            {s.name: s.storage_options for s in kept},
            timeout_s=plan.loading.timeout_s,
        )
    except CheckpointError as e:
        lines = str(e).split("\n")[1:]
        return [
            Change(
                "files", False, "as recorded", "changed", line.strip() + ": its positions "
                "would mean other samples; put the file back (new files may be added: they "
                "join at the source's next epoch)",
            )
            for line in lines
        ]  # fmt: skip
    return []
