"""The plan's quarantine: samples and files taken out of the stream from a step on.

A sample is named as overlord names it in a batch (``Sample.id``): the file,
relative to the plan's folder (or its URL), a colon, the record's 0-based row
(a JSONL line, a Parquet row, a Megatron document of the ``.idx``), and
``#k`` for the ``k``-th chunk of a record split by ``long_docs: split``. An id
without ``#k`` names every chunk of its record. ``files`` are shell patterns
over those same names (``*`` also matches ``/``). This module is pure: which
file an id names is checked against the job's files by
:mod:`overlord.roles.quarantine`.

>>> parse_id("data/web/part-0.jsonl:17")
SampleId(file='data/web/part-0.jsonl', row=17, chunk=None)
>>> parse_id("s3://bucket/a.parquet:3#1")
SampleId(file='s3://bucket/a.parquet', row=3, chunk=1)
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from pydantic import Field, field_validator

from overlord.plan.settings import _Model

# FILE:ROW or FILE:ROW#CHUNK; FILE may hold colons itself (a URL), so the last one splits
_ID = re.compile(r"^(?P<file>.+):(?P<row>\d+)(?:#(?P<chunk>\d+))?$")


class SampleId(NamedTuple):
    """A sample id taken apart: its file, its record's row, its chunk (None: every chunk)."""

    file: str
    row: int
    chunk: int | None


def parse_id(text: str) -> SampleId:
    """The parts of a sample id; ValueError naming what is wrong with it."""
    found = _ID.match(text) if isinstance(text, str) else None
    if found is None:
        raise ValueError(
            f"sample id {text!r} is malformed: expected FILE:ROW or FILE:ROW#CHUNK (the "
            "file relative to the plan's folder, the record's 0-based row, the chunk), as "
            "overlord names a sample (Sample.id, the dumps of overlord run --dump)"
        )
    chunk = found["chunk"]
    return SampleId(found["file"], int(found["row"]), None if chunk is None else int(chunk))


class QuarantineSpec(_Model):
    """Samples and files skipped from a step on, as if absent from their source."""

    ids: list[str] = Field(
        [],
        description="sample ids as overlord names them: FILE:ROW (every chunk of the record) "
        "or FILE:ROW#CHUNK, FILE relative to the plan's folder; samples of a tar are "
        "quarantined by their file",
    )
    files: list[str] = Field(
        [],
        description="shell patterns over a source's file names, relative like the ids' "
        "FILE (* also matches /); every sample of a matching file is skipped",
    )
    from_step: int = Field(
        0,
        ge=0,
        description="the first step planned without them; the steps before are as they were",
    )

    @field_validator("ids")
    @classmethod
    def _ids(cls, v: list[str]) -> list[str]:
        problems = []
        for i, text in enumerate(v):
            try:
                parse_id(text)
            except ValueError as e:
                problems.append(f"[{i}] {e}")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: list[str]) -> list[str]:
        empty = [i for i, pattern in enumerate(v) if not pattern]
        if empty:
            raise ValueError(f"pattern(s) {empty} are empty: a pattern names files")
        return v


def entry(spec: QuarantineSpec) -> dict[str, Any]:
    """The quarantine as the state records one addition: its ids, patterns and first step."""
    return {"ids": list(spec.ids), "files": list(spec.files), "from_step": int(spec.from_step)}


def check_entry(data: Any) -> dict[str, Any]:
    """An addition read back from a state or a journal (plain data), checked as the plan's.

    Raises ValueError naming the field.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a quarantine entry is a mapping, found {type(data).__name__}")
    return entry(QuarantineSpec.model_validate(data))
