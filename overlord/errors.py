"""Errors raised by overlord.

Every error names its cause and its place: the field path of a bad plan, the
source, file and row of a bad record, the role and step where a worker failed.
"""

from __future__ import annotations


class OverlordError(Exception):
    """Base class of every error overlord raises on purpose."""


class PlanError(OverlordError, ValueError):
    """A data plan is invalid. Holds every problem found, each with its field path."""

    def __init__(self, problems: list[tuple[str, str]], origin: str | None = None):
        self.problems = problems
        self.origin = origin
        where = f" in {origin}" if origin else ""
        lines = [f"the data plan{where} has {len(problems)} problem(s):"]
        lines += [f"  - {path or '<plan>'}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type, tuple[list[tuple[str, str]], str | None]]:
        return (PlanError, (self.problems, self.origin))


class SourceError(OverlordError):
    """A record or file of a source cannot be read or decoded."""

    def __init__(self, source: str, file: str | None, row: int | None, reason: str):
        self.source, self.file, self.row, self.reason = source, file, row, reason
        place = f"source '{source}'"
        if file is not None:
            place += f", file {file}"
        if row is not None:
            place += f", row {row}"
        super().__init__(f"{place}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str | None, int | None, str]]:
        # rebuilt from its fields when it crosses a process boundary (a Ray actor's error)
        return (SourceError, (self.source, self.file, self.row, self.reason))


class LoaderError(OverlordError):
    """A role (source loader, planner, constructor) failed; says which and where."""


class RanksApart(LoaderError):
    """A rank asked for a step further ahead of the slowest rank than the plan allows."""


class ActorDiedError(LoaderError):
    """A role's process is gone (killed, node lost): callers fail over to a replica."""


class CheckpointError(OverlordError):
    """A checkpoint cannot be read or does not fit the plan it is loaded into."""


class OutputError(OverlordError):
    """An output a run writes (its dump, its report) cannot be written; names the file."""
