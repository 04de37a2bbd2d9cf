"""The quarantine in force: the planner's list of additions, resolved against the job's files.

The rule: from an addition's ``from_step`` on, every sample it names is
skipped as if absent from its source. The planner's cursor of each source
(:class:`~overlord.roles.cursor.SourceCursor`) leaves them out of its pending
items, so the selector never sees them: the quarantined source's order is its
order with those samples removed, and every other source's order is as it
was. Positions still count the removed samples (an item's index is its place
in the source's order), so a cursor's state, its loaders' reads and their
releases are unchanged arithmetic. With no addition, no cursor gets a filter,
and nothing runs per block or per item.

An addition is ``{"ids": [...], "files": [...], "from_step": S}``
(:mod:`overlord.plan.quarantine`); the planner's state holds the list
(the state's optional ``quarantine`` key), in the order they were made.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from overlord.errors import CheckpointError, LoaderError, PlanError
from overlord.plan.quarantine import QuarantineSpec, check_entry, entry, parse_id
from overlord.plan.spec import Plan
from overlord.sources.catalog import SourceFiles

# what a cursor calls for a block's items of one file: which to drop (None: none)
Dropper = Callable[[int, int, np.ndarray, np.ndarray], "np.ndarray | None"]
_CHUNK = 1 << 32  # a (row, chunk) pair as one int64: row * _CHUNK + chunk + 1


def _is_tar(name: str) -> bool:
    return ".tar" in PurePosixPath(name).suffixes


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``sorted_set`` (sorted, unique): one binary search each."""
    if not len(sorted_set):
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[at] == values


@dataclass
class _FileRule:
    """What is quarantined of one file: all of it, or whole records and single chunks."""

    whole: bool = False
    rows: list[int] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)  # row * _CHUNK + chunk + 1

    def __post_init__(self) -> None:
        self._rows = self._pairs = np.zeros(0, dtype=np.int64)

    def freeze(self) -> _FileRule:
        """Sorted arrays of its rows and pairs, searched for each block (the lists as given)."""
        self._rows = np.unique(np.asarray(self.rows, dtype=np.int64))
        self._pairs = np.unique(np.asarray(self.pairs, dtype=np.int64))
        return self

    def mask(self, row: np.ndarray, chunk: np.ndarray) -> np.ndarray | None:
        if self.whole:
            return np.ones(len(row), dtype=bool)
        drop = _member(row, self._rows)
        if len(self._pairs):
            drop |= _member(row.astype(np.int64) * _CHUNK + chunk + 1, self._pairs)
        return drop if drop.any() else None


class _SourceRule:
    """The active additions' rules for one source, by file name; a file's rule found once."""

    def __init__(self, files: SourceFiles, patterns: list[str], names: dict[str, _FileRule]):
        self.files, self.patterns, self.names = files, patterns, names
        self._by_file: dict[tuple[int, int], _FileRule | None] = {}

    def drop(self, epoch: int, file_index: int, row: np.ndarray, chunk: np.ndarray) -> Any:
        key = (epoch, file_index)
        if key not in self._by_file:
            name = self.files.at(epoch)[file_index].name
            rule = self.names.get(name)
            if any(fnmatch.fnmatchcase(name, p) for p in self.patterns):
                rule = _FileRule(whole=True)
            self._by_file[key] = rule
        rule = self._by_file[key]
        return None if rule is None else rule.mask(row, chunk)


class Quarantine:
    """Every addition made to the job's quarantine, and the rules of those in force at a step.

    ``names``: the sources, in plan order; ``files``: each one's files (the job's list).
    """

    def __init__(self, names: list[str], files: dict[str, SourceFiles]):
        self.names, self.files = names, files
        self.entries: list[dict[str, Any]] = []
        self._sources_of: dict[str, list[int]] = {}  # a file's name -> the sources reading it
        for s, n in enumerate(names):
            for name in {f.name for _, fs in files[n].lists for f in fs}:
                self._sources_of.setdefault(name, []).append(s)
        self._rules: list[_SourceRule | None] = [None] * len(names)
        self._active = 0  # entries in force at the step armed last
        self._step: int | None = None

    def problems(self, entry: dict[str, Any]) -> list[str]:
        """What the job's files say is wrong with ``entry``: every problem, each named."""
        out = []
        for text in entry["ids"]:
            sid = parse_id(text)
            if sid.file not in self._sources_of:
                out.append(
                    f"sample id {text!r}: no source of the job reads a file {sid.file!r} (a "
                    "file is named relative to the plan's folder, as in Sample.id)"
                )
            elif _is_tar(sid.file):
                out.append(
                    f"sample id {text!r}: a tar's samples are named by their key, which the "
                    "planner does not see: quarantine the tar by its file (files:) instead"
                )
        for pattern in entry["files"]:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in self._sources_of):
                out.append(
                    f"files pattern {pattern!r} matches no file of the job (patterns match "
                    "names relative to the plan's folder, as in Sample.id)"
                )
        return out

    def addition(
        self, ids: list[str], files: list[str], from_step: int | None, first: int, plan: Plan
    ) -> dict[str, Any]:
        """An addition to a live job, checked (:class:`LoaderError` naming every problem).

        ``first``: the first step not planned yet, and the default ``from_step``; an
        earlier step is refused (planning runs ``batch.prefetch_steps`` ahead).
        """
        step = first if from_step is None else int(from_step)
        if step < 0:
            raise LoaderError(f"quarantine from step {step}: a step is 0 or more")
        if step < first:
            raise LoaderError(
                f"quarantine from step {step}: step {step} is planned already (planning runs "
                f"batch.prefetch_steps={plan.batch.prefetch_steps} steps ahead of the "
                f"trainers); the earliest step it can take effect is {first}"
            )
        try:
            added = entry(QuarantineSpec(ids=ids, files=files, from_step=step))
        except ValueError as e:
            raise LoaderError(f"quarantine refused: {e}") from None
        if not added["ids"] and not added["files"]:
            raise LoaderError("quarantine refused: it names no sample id and no files pattern")
        problems = self.problems(added)
        if problems:
            raise LoaderError("quarantine refused: " + "; ".join(problems))
        return added

    def add(self, entry: dict[str, Any]) -> bool:
        """Add ``entry`` (checked: see :meth:`problems`); False if an equal one is in force."""
        if any(e["ids"] == entry["ids"] and e["files"] == entry["files"] for e in self.entries):
            return False
        self.entries.append(entry)
        self._step = None  # the rules are built again at the next arm
        return True

    def merge(self, entries: Iterable[Any], where: str, start: int = 0) -> None:
        """Add the additions a state or the plan holds (``where`` names it in an error).

        An addition from before ``start`` (the step planning starts at) applies from it.
        Raises :class:`CheckpointError` naming the addition and every problem.
        """
        for i, data in enumerate(entries):
            try:
                e = check_entry(data)
            except ValueError as err:
                raise CheckpointError(f"{where}[{i}]: {err}") from None
            problems = self.problems(e)
            if problems:
                raise CheckpointError(f"{where}[{i}]: " + "; ".join(problems))
            self.add({**e, "from_step": max(e["from_step"], start)})

    def record(self) -> list[dict[str, Any]]:
        """The additions as a state holds them (a new list: states handed out keep theirs)."""
        return [dict(e, ids=list(e["ids"]), files=list(e["files"])) for e in self.entries]

    def due(self, step: int) -> bool:
        """Whether planning ``step`` brings an addition into force (or the rules are not built)."""
        if not self.entries:
            return False
        active = sum(e["from_step"] <= step for e in self.entries)
        return self._step is None or active != self._active

    def arm(self, step: int) -> list[int]:
        """Build the rules in force at ``step``; the sources whose rules changed."""
        active = [e for e in self.entries if e["from_step"] <= step]
        names: list[dict[str, _FileRule]] = [{} for _ in self.names]
        patterns: list[list[str]] = [[] for _ in self.names]
        for e in active:
            for text in e["ids"]:
                sid = parse_id(text)
                for s in self._sources_of.get(sid.file, []):
                    rule = names[s].setdefault(sid.file, _FileRule())
                    if sid.chunk is None:
                        rule.rows.append(sid.row)
                    else:
                        rule.pairs.append(sid.row * _CHUNK + sid.chunk + 1)
            for pattern in e["files"]:
                for s in {s for n, ss in self._sources_of.items() for s in ss
                          if fnmatch.fnmatchcase(n, pattern)}:  # fmt: skip
                    patterns[s].append(pattern)
        changed = []
        for s, n in enumerate(self.names):
            old = self._rules[s]
            if not names[s] and not patterns[s]:
                new = None
            elif old is not None and old.names == names[s] and old.patterns == patterns[s]:
                new = old
            else:
                frozen = {name: rule.freeze() for name, rule in names[s].items()}
                new = _SourceRule(self.files[n], patterns[s], frozen)
            if new is not old:
                changed.append(s)
            self._rules[s] = new
        self._active, self._step = len(active), step
        return changed

    def dropper(self, s: int) -> Dropper | None:
        """What source ``s``'s cursor calls for each block (None: nothing of it is quarantined)."""
        rule = self._rules[s]
        return None if rule is None else rule.drop


def collect_dropped(cursors: list[Any]) -> dict[str, np.ndarray] | None:
    """What the cursors' filters took out since the last call (None: nothing), as columns.

    ``source`` (the cursor's index), ``loader`` and ``key``, as a step's plan has
    them: the planner releases them with the step.
    """
    found = [(s, k, key) for s, c in enumerate(cursors) for k, key in c.dropped]
    for c in cursors:
        c.dropped = []
    if not found:
        return None
    return {
        "source": np.concatenate([np.full(len(k), s, dtype=np.int64) for s, k, _ in found]),
        "loader": np.concatenate([k for _, k, _ in found]),
        "key": np.concatenate([key for _, _, key in found]),
    }


def check_job(plan: Plan, files: dict[str, SourceFiles], state: dict[str, Any] | None) -> None:
    """Refuse a plan's or a state's quarantine that the job's files contradict, before any role.

    (A planner whose constructor fails is restarted by Ray, forever: it is checked here.)
    :class:`PlanError` for the plan's, :class:`CheckpointError` for the state's.
    """
    q = Quarantine(plan.source_names, files)
    if plan.quarantine is not None:
        problems = q.problems(entry(plan.quarantine))
        if problems:
            raise PlanError([("quarantine", p) for p in problems])
    q.merge((state or {}).get("quarantine", []), "the checkpoint's quarantine")
