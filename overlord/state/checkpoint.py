"""Checkpoints: the planner's state as a small, versioned JSON document.

A checkpoint describes what the trainer consumed, never what loaders had read
ahead. It holds, per source (keyed by name), where its order resumes, its
mixture account, its files (:mod:`overlord.sources.catalog` checks them on
resume) and a fingerprint of what decides that source's items, so that
loading it into a plan that reads the source differently fails loudly. The
format is :mod:`overlord.state.format`.
The world and balance settings are not in it: resume with another DP size
continues the same global stream (elastic resume).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from overlord.errors import CheckpointError
from overlord.plan.spec import Plan
from overlord.state.format import STATE_VERSION

_NAME = re.compile(r"^step-(\d{8,})\.json$")


_OLD_VERSIONS = {
    1: " (version 1 predates recording each source's files in the state; resume it "
    "with the overlord release that wrote it)",
    2: " (version 2 read every shard whole and ordered its records by one permutation; "
    "shards now stream in blocks, in another order, so its positions name other "
    "records: resume it with the overlord release that wrote it)",
}


def check_state(state: dict[str, Any], plan: Plan) -> None:
    """Raise :class:`CheckpointError` if ``state`` cannot resume ``plan``."""
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
    problems = []
    for name in plan.source_names:
        saved = state["sources"].get(name)
        if saved is None:
            continue  # a source added since: it starts from its beginning
        want, found = plan.source_fingerprint(name), saved.get("fingerprint")
        if want != found:
            problems.append(f"source '{name}': expected fingerprint {want}, found {found}")
    if problems:
        raise CheckpointError(
            "the checkpoint was written for a plan that reads these sources differently "
            "(its paths, seed, format, text field, tokenizer, max_seq_len, long_docs or "
            "on_error changed), so its positions mean other samples here:\n  "
            + "\n  ".join(problems)
        )


def save(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` as ``DIR/step-NNNNNNNN.json`` atomically; returns the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{int(state['step']):08d}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint is shared data
    os.replace(tmp, path)
    return path


def latest(directory: str | Path) -> Path | None:
    """The checkpoint of the highest step in ``directory``, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file, or the newest one of a folder."""
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
    return state
