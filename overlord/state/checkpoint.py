"""Checkpoints: the planner's state as a small, versioned JSON document.

A checkpoint describes what the trainer consumed, never what loaders had read
ahead. It holds, per source (keyed by name), where its order resumes, its
mixture account, its files (:mod:`overlord.sources.catalog` checks them on
resume) and a fingerprint of what decides that source's items, so that
loading it into a plan that reads the source differently fails loudly. The
format is :mod:`overlord.state.format`.
The world and balance settings are not in it: resume with another DP size
continues the same global stream (elastic resume).

A checkpoint file carries a digest of its content, its format version included:
``"digest": "sha256:..."`` over the document's canonical JSON (keys sorted, no
spaces) without the digest itself. A file whose digest does not match (a flipped
byte, an edited number) is refused by :func:`load`, naming the file; it is never
resumed. A file without a digest was written before digests existed and loads
as it did, so checkpoints of earlier releases of this format still resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from overlord.errors import CheckpointError
from overlord.plan.spec import Plan
from overlord.state.changes import DROPPED, classify, refused
from overlord.state.format import STATE_VERSION

_NAME = re.compile(r"^step-(\d{8,})\.json$")


_OLD_VERSIONS = {
    1: " (version 1 predates recording each source's files in the state; resume it "
    "with the overlord release that wrote it)",
    2: " (version 2 read every shard whole and ordered its records by one permutation; "
    "shards now stream in blocks, in another order, so its positions name other "
    "records: resume it with the overlord release that wrote it)",
}


def check_state(state: dict[str, Any], plan: Plan, before: Plan | None = None) -> None:
    """Raise :class:`CheckpointError` if ``state`` cannot resume ``plan``.

    ``plan`` may differ from the checkpoint's: a change that decides a kept
    source's items is refused, naming it; any other is allowed
    (:func:`overlord.state.changes.classify`). ``before``, the plan the
    checkpoint was written with where it is known, names each refused field
    with its old and new value.
    """
    check_document(state, plan)
    problems = refused(classify(state, plan, before))
    if problems:
        raise CheckpointError(
            "the checkpoint cannot resume this plan: these changes would make its positions "
            "mean other samples ('overlord diff CHECKPOINT PLAN' shows every change, allowed "
            "and refused):\n  " + "\n  ".join(c.line() for c in problems)
        )


def check_document(state: dict[str, Any], plan: Plan) -> None:
    """Raise :class:`CheckpointError` if ``state`` is not a state a run of ``plan`` writes.

    Its format version, its keys, and every number in the range a run writes
    (:func:`range_problems`); what the plan changed is :func:`check_state`'s.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"a checkpoint is a JSON object, found {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise CheckpointError(
            f"checkpoint format version {version!r} is not supported: expected {STATE_VERSION}"
            + (_OLD_VERSIONS.get(version, "") if isinstance(version, int) else "")
        )
    for key in ("step", "sources"):
        if key not in state:
            raise CheckpointError(f"checkpoint has no '{key}': it is not an overlord checkpoint")
    numbers = range_problems(state, plan)
    if numbers:  # before anything is built from them: a count of 10**9 would be held
        raise CheckpointError(
            "the checkpoint holds numbers no run of this plan writes (edited, or not this "
            "plan's), so it cannot be resumed:\n  " + "\n  ".join(numbers)
        )


# the items a source may have placed past its first pending one, in steps of tokens: an item
# skipped for want of room is placed within a step or two (each item holds a token or more)
SKIP_STEPS = 16


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def range_problems(state: dict[str, Any], plan: Plan) -> list[str]:
    """Every number of ``state`` outside what a run of ``plan`` writes, with its field path.

    >>> from overlord.plan.spec import validate_plan
    >>> plan = validate_plan({"sources": [{"name": "w", "path": "x", "format": "jsonl"}],
    ...                       "batch": {"tokens_per_step": 64, "max_seq_len": 32}})
    >>> cursor = {"epoch": 0, "shard_pos": 3, "index": -1, "skip": [[0, 0, 9, 10**9]]}
    >>> web = {"cursor": cursor, "files": [[0, [["a", 10]]]], "placed": 1.0, "target": math.nan}
    >>> for p in range_problems({"step": 2, "sources": {"w": web}}, plan):  # doctest: +ELLIPSIS
    ...     print(p)
    sources.w.cursor.index: expected a whole number >= 0, found -1
    sources.w.cursor.shard_pos: 3, past the 1 file(s) of epoch 0
    sources.w.cursor.skip: 1000000000 items placed ahead, more than 1088 (a run places ...
    sources.w.target: expected a finite number >= 0, found nan
    """
    out = []
    if not _whole(state["step"]):
        out.append(f"step: expected a whole number >= 0, found {state['step']!r}")
    dropped = state.get(DROPPED, [])
    if not isinstance(dropped, list) or not all(
        isinstance(d, dict) and isinstance(d.get("source"), str) and _whole(d.get("step"))
        for d in dropped
    ):
        out.append(f"{DROPPED}: expected [{{'source': name, 'step': step}}, ...]")
    sources = state["sources"]
    if not isinstance(sources, dict):
        return [*out, f"sources: expected a mapping by source name, found {type(sources).__name__}"]
    most = SKIP_STEPS * plan.batch.tokens_per_step + plan.batch.lookahead
    for name, saved in sources.items():
        where = f"sources.{name}"
        cursor = saved.get("cursor") if isinstance(saved, dict) else None
        if not isinstance(cursor, dict):
            out.append(f"{where}.cursor: missing")
            continue
        for key in ("epoch", "shard_pos", "index"):
            if not _whole(cursor.get(key)):
                found = cursor.get(key)
                out.append(f"{where}.cursor.{key}: expected a whole number >= 0, found {found!r}")
        lists = saved.get("files")
        epoch, pos = cursor.get("epoch"), cursor.get("shard_pos")
        if isinstance(lists, list) and lists and isinstance(epoch, int) and isinstance(pos, int):
            count = next((len(fs) for e, fs in reversed(lists) if isinstance(fs, list)
                          and isinstance(e, int) and e <= epoch), len(lists[0][1]))  # fmt: skip
            if pos > count:
                out.append(f"{where}.cursor.shard_pos: {pos}, past the {count} file(s) of "
                           f"epoch {epoch}")  # fmt: skip
        runs = cursor.get("skip", [])
        if not isinstance(runs, list) or not all(
            isinstance(r, list) and len(r) == 4 and all(_whole(x) for x in r) for r in runs
        ):
            out.append(f"{where}.cursor.skip: expected runs [epoch, shard, index, count]")
        elif sum(r[3] for r in runs) > most:
            out.append(
                f"{where}.cursor.skip: {sum(r[3] for r in runs)} items placed ahead, more than "
                f"{most} (a run places at most {SKIP_STEPS} steps of tokens ahead, plus the "
                "lookahead)"
            )
        for key in ("placed", "target"):
            value = saved.get(key)
            if not (isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):  # fmt: skip
                out.append(f"{where}.{key}: expected a finite number >= 0, found {value!r}")
    return out


DIGEST_KEY = "digest"


def digest(state: dict[str, Any]) -> str:
    """``sha256:<hex>`` of a state's canonical JSON, its own digest left out.

    >>> digest({"version": 3, "step": 0}) == digest({"step": 0, "version": 3})
    True
    >>> digest({"version": 3, "step": 0}) == digest({"version": 3, "step": 1})
    False
    """
    body = {k: v for k, v in state.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def save(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` as ``DIR/step-NNNNNNNN.json`` atomically, with its digest; the path.

    A write that fails (a full disk, a folder it cannot write) raises
    :class:`CheckpointError` naming the checkpoint, leaves no temporary file behind, and
    leaves the previous checkpoints as they were. Temporary files that saves killed midway
    left in the folder (``.tmp-*.json``, older than :data:`STALE_TMP_S`) are removed.
    """
    directory = Path(directory)
    path = directory / f"step-{int(state['step']):08d}.json"
    document = {**state, DIGEST_KEY: digest(state)}
    tmp: str | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, separators=(",", ":"), allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint is shared data
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    _remove_stale(directory)
    return path


STALE_TMP_S = 600.0  # a save takes milliseconds: a temporary file this old was left by a kill


def _remove_stale(directory: Path) -> None:
    """Temporary files of saves killed midway (a save in progress elsewhere is younger)."""
    now = time.time()
    for left in directory.glob(".tmp-*.json"):
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            if now - left.stat().st_mtime > STALE_TMP_S:
                left.unlink()


def latest(directory: str | Path) -> Path | None:
    """The checkpoint of the highest step in ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file, or the newest one of a folder, checking its digest.

    Returns the state without its digest. Raises :class:`CheckpointError` naming the file
    when it cannot be read, is not a JSON object, or its content does not match its digest.
    """
    path = Path(path)
    if path.is_dir():
        newest = latest(path)
        if newest is None:
            raise CheckpointError(f"no checkpoint (step-*.json) in {path}")
        path = newest
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a JSON object")
    recorded = state.pop(DIGEST_KEY, None)
    if recorded is not None:
        try:
            found = digest(state)
        except ValueError:  # NaN or infinity: never written by save
            found = "(none: the content holds a number JSON does not have)"
        if recorded != found:
            raise CheckpointError(
                f"checkpoint {path} does not match its digest (expected {recorded}, found "
                f"{found}): the file was changed or damaged after it was written; resume "
                "from another checkpoint"
            )
    return state
