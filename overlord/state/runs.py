"""A checkpoint folder's kept journals: one folder per run, with the plan it ran.

``overlord run --checkpoint-dir D`` (a :class:`~overlord.Loader` given
``journal_dir``) keeps its planner's journal in ``D/journal/run-NNNN/``, one
folder per run (a resumed run starts the next one), beside a ``plan.json``:
the plan that run planned with, as JSON, and its base folder. A run of its
own folder: a resumed run's planner must not take the journal of the run
before for its own (that is how a restarted planner resumes), and a resume
may change the plan. ``overlord replay`` reads these back, and a resume with a
changed plan (``overlord diff``, ``run`` and ``serve --resume``) takes from them
the plan a checkpoint was written with, to name each changed field.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from overlord.errors import CheckpointError
from overlord.plan.spec import Plan, validate_plan

_RUN = re.compile(r"^run-(\d{4,})$")
PLAN_FILE = "plan.json"


def runs(root: str | Path) -> list[Path]:
    """The run folders under ``root``, oldest first (none: an empty list)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _RUN.match(p.name)]
    return sorted(found, key=lambda p: int(p.name[4:]))


def new_run(root: str | Path, plan: dict[str, Any], base_dir: str, start: int) -> Path:
    """A new run's folder under ``root``, with its ``plan.json`` written; its path.

    ``plan``: the plan as JSON (``Plan.model_dump(mode="json")``); ``start``: the
    step the run starts at.
    """
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        before = runs(root)
        n = int(before[-1].name[4:]) + 1 if before else 0
        while True:  # another process may take the same number first
            folder = root / f"run-{n:04d}"
            try:
                folder.mkdir()
                break
            except FileExistsError:
                n += 1
        doc = {"plan": plan, "base_dir": base_dir, "start": start}
        tmp = folder / f".{PLAN_FILE}.tmp"  # the folder is this run's alone: a fixed name
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, folder / PLAN_FILE)
    except OSError as e:
        raise CheckpointError(
            f"cannot keep the planner's journal in {root}: {e.strerror or e}"
        ) from None
    return folder


def read_plan(run: Path) -> dict[str, Any]:
    """The ``plan.json`` of a run folder: ``{"plan", "base_dir", "start"}``."""
    path = run / PLAN_FILE
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("plan"), dict):
        raise CheckpointError(f"{path}: field 'plan': missing, not a run's plan document")
    return doc


def kept_plan(folder: str | Path, fingerprint: object) -> Plan | None:
    """The plan of the newest run kept under ``folder/journal`` that wrote ``fingerprint``.

    ``fingerprint``: a checkpoint's ``"fingerprint"`` (its plan's stream
    fingerprint). None when the folder keeps no run of that plan, or its
    ``plan.json`` no longer validates (a source's files gone): a checkpoint
    without its plan is resumed by the fingerprints alone.
    """
    for run in reversed(runs(Path(folder) / "journal")):
        try:
            doc = read_plan(run)
            plan = validate_plan(doc["plan"], base_dir=doc.get("base_dir"))
        except (CheckpointError, ValueError):
            continue
        if plan.stream_fingerprint() == fingerprint:
            return plan
    return None
