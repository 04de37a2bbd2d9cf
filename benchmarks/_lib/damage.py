"""Damaged checkpoints and journals for ``benchmarks/faults.py``: each must be refused.

A real checkpoint (a run's state after some steps, saved by
:func:`overlord.checkpoint.save`) and a real planner journal are copied and
damaged: cut short, one byte flipped, one field edited (its digest left as it
was, as a hand edit or a stray write leaves it), or numbers no run writes
(the digest recomputed, so that the range checks answer, not the digest). A
checkpoint is given to :func:`overlord.checkpoint.load` and then to a
:class:`~overlord.Loader` of the plan; a journal to the resume of a restarted
planner (:func:`overlord.state.journal.resume`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overlord import Loader
from overlord.errors import OverlordError
from overlord.plan.schedule import Schedule
from overlord.plan.spec import Plan, validate_plan
from overlord.state import checkpoint, journal

Edit = Callable[[bytes], bytes]


def _json_edit(change: Callable[[dict[str, Any]], None], redigest: bool) -> Edit:
    def edit(data: bytes) -> bytes:
        doc = json.loads(data)
        change(doc)
        if redigest:
            doc[checkpoint.DIGEST_KEY] = checkpoint.digest(doc)
        return json.dumps(doc, separators=(",", ":")).encode()

    return edit


def _flip(seed: int) -> Edit:
    def edit(data: bytes) -> bytes:
        out = bytearray(data)
        out[random.Random(seed).randrange(len(out))] ^= 0x01
        return bytes(out)

    return edit


def _first(doc: dict[str, Any]) -> dict[str, Any]:
    """The first source's saved state."""
    return next(iter(doc["sources"].values()))


def _set_nan(doc: dict[str, Any]) -> None:
    _first(doc)["placed"] = float("nan")


def checkpoint_edits(seed: int) -> dict[str, Edit]:
    """Damaged copies of a checkpoint's bytes, by the name the table gives them."""

    def index_plus_one(doc: dict[str, Any]) -> None:
        _first(doc)["cursor"]["index"] += 1

    def step_ahead(doc: dict[str, Any]) -> None:
        doc["step"] += 10

    def skip_huge(doc: dict[str, Any]) -> None:
        _first(doc)["cursor"]["skip"] = [[0, 0, 0, 10**9]]

    def index_negative(doc: dict[str, Any]) -> None:
        _first(doc)["cursor"]["index"] = -1

    def shard_far(doc: dict[str, Any]) -> None:
        _first(doc)["cursor"]["shard_pos"] = 999

    return {
        "truncated (half)": lambda d: d[: len(d) // 2],
        "truncated (last byte)": lambda d: d[:-1],
        "empty": lambda d: b"",
        "one byte flipped": _flip(seed),
        "one byte flipped (another)": _flip(seed + 1),
        "field edited: cursor index +1": _json_edit(index_plus_one, redigest=False),
        "field edited: step +10": _json_edit(step_ahead, redigest=False),
        "out of range: skip 10**9 items": _json_edit(skip_huge, redigest=True),
        "out of range: cursor index -1": _json_edit(index_negative, redigest=True),
        "out of range: shard_pos 999": _json_edit(shard_far, redigest=True),
        "out of range: placed NaN": _json_edit(_set_nan, redigest=False),
    }


def _lines(edit: Callable[[list[bytes]], list[bytes]]) -> Edit:
    return lambda d: b"".join(edit(d.splitlines(keepends=True)))


def _edit_line(lines: list[bytes]) -> list[bytes]:
    digest, _, text = lines[2].partition(b" ")
    return [*lines[:2], digest + b" " + text.replace(b'"s":', b'"s": ', 1), *lines[3:]]


def journal_edits(seed: int) -> dict[str, Edit]:
    """Damaged copies of a journal segment's bytes (its third line on is a step's record)."""
    return {
        "one byte flipped": _flip(seed),
        "field edited (digest kept)": _lines(_edit_line),
        "a record deleted": _lines(lambda ls: [*ls[:2], *ls[3:]]),
        "two records swapped": _lines(lambda ls: [*ls[:2], ls[3], ls[2], *ls[4:]]),
        "torn last record (a kill)": lambda d: d[:-5],
    }


def try_checkpoint(path: Path, plan: Plan) -> tuple[bool, str]:
    """(refused, the message or what ran) for a checkpoint file given to a resume."""
    try:
        state = checkpoint.load(path)
        with Loader(plan, runtime="inline", state=state) as loader:
            got = next(loader.client(0))
    except (OverlordError, ValueError) as e:
        return True, _flat(f"{type(e).__name__}: {e}", path.parent)
    return False, f"resumed: served step {got.step}"


def try_journal(directory: Path, plan: Plan) -> tuple[bool, str]:
    """(refused, the message or where it resumes) for a journal given to a restarted planner."""
    try:
        found = journal.resume(directory, Schedule(plan).named)
    except OverlordError as e:
        return True, _flat(f"{type(e).__name__}: {e}", directory)
    if found is None:
        return False, "empty"
    skipped = f"; skipped: {_flat(found.problems[0], directory)}" if found.problems else ""
    return False, f"resumed at step {found.step}{skipped}"


def _flat(text: str, folder: Path) -> str:
    """A message on one line, its folder shown as ``DIR`` (the table names the file in it)."""
    return " ".join(text.replace(str(folder), "DIR").split())


def real_journal(plan: Plan, root: Path, steps: int) -> Path:
    """The journal a job of ``plan`` left after ``steps`` steps (kept: not removed)."""
    data = plan.model_dump(mode="json")
    data["recovery"].update(journal_dir=str(root), snapshot_every=steps + 10)
    with_journal = validate_plan(data, base_dir=plan.base_dir)
    loader = Loader(with_journal, runtime="inline")
    clients = [loader.client(r) for r in range(with_journal.world.dp)]
    for _ in range(steps):
        for c in clients:
            next(c)
    path = Path(loader.journal or "")
    loader.journal = None  # keep it when closing
    loader.close()
    return path


def damage_table(plan: Plan, root: Path, seed: int, steps: int = 8) -> list[dict[str, Any]]:
    """Every damaged checkpoint and journal, and what a resume made of it."""
    rows: list[dict[str, Any]] = []
    with Loader(plan, runtime="inline") as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(steps):
            for c in clients:
                next(c)
        good = checkpoint.save(root / "good", loader.state_dict())
    refused, _ = try_checkpoint(good, plan)
    rows.append({"what": "checkpoint", "case": "intact (control)", "refused": refused,
                 "expected": False, "message": "resumed" if not refused else _})  # fmt: skip
    for name, edit in checkpoint_edits(seed).items():
        bad = root / "bad" / name.replace(" ", "_").replace(":", "") / good.name
        bad.parent.mkdir(parents=True, exist_ok=True)
        bad.write_bytes(edit(good.read_bytes()))
        refused, text = try_checkpoint(bad, plan)
        rows.append({"what": "checkpoint", "case": name, "refused": refused,
                     "expected": True, "message": text})  # fmt: skip
    directory = real_journal(plan, root / "journal", steps)
    (seg,) = journal.segments(directory)
    intact = seg.read_bytes()
    for name, edit in {"intact (control)": lambda d: d, **journal_edits(seed)}.items():
        seg.write_bytes(edit(intact))
        refused, text = try_journal(directory, plan)
        # a torn last record is what a killed writer leaves: resumed before it, by design
        expected = name not in ("intact (control)", "torn last record (a kill)")
        rows.append({"what": "journal", "case": name, "refused": refused,
                     "expected": expected, "message": text})  # fmt: skip
    return rows
