"""A job's data, fixed when it starts: each source's files, by epoch.

A source's files are listed once, when the job starts, with their sizes; every
role of the job (the planner, every SourceLoader, also one started later by a
failover or a re-partition, and every DataConstructor) reads that list and
never lists the files again. The list is part of the job's state, so a
checkpoint records it:

- Resuming keeps the recorded list until the source's current epoch ends
  (and any later epoch the state already reaches into).
- Files **added** since join the source at its next epoch: that epoch's order
  is drawn over the new list. So shards can be appended between runs.
- A recorded file that is **missing**, or whose **size changed**, is an error
  naming it: its positions would mean other samples.

>>> files = SourceFiles("web", [(0, (File("a.jsonl", "/d/a.jsonl", 10),))])
>>> later = files.joined([File("a.jsonl", "/d/a.jsonl", 10), File("b.jsonl", "/d/b.jsonl", 5)], 3)
>>> [len(later.at(e)) for e in (0, 3, 4)]
[1, 1, 2]
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlord.errors import CheckpointError, SourceError
from overlord.plan.partition import owner
from overlord.sources.files import find_shards
from overlord.sources.remote import endpoint_problems, file_size


@dataclass(frozen=True)
class File:
    """One file of a source. ``name`` is how ids and errors refer to it."""

    name: str  # path relative to the plan's folder (local), else the URL
    url: str = field(compare=False)  # what to open: a local path or an fsspec URL
    size: int  # bytes, when the job started


class SourceFiles:
    """The files each epoch of one source reads: lists that start at given epochs."""

    def __init__(self, source: str, lists: Iterable[tuple[int, tuple[File, ...]]]):
        self.source = source
        self.lists = sorted((int(e), tuple(fs)) for e, fs in lists)
        if not self.lists or self.lists[0][0] != 0:
            # epochs before the first recorded one are never read again; the first list
            # stands for them, so that every epoch has one
            self.lists = [(0, self.lists[0][1] if self.lists else ()), *self.lists[1:]]

    def at(self, epoch: int) -> tuple[File, ...]:
        """The files epoch ``epoch`` reads, in name order (its shard order permutes them)."""
        out = self.lists[0][1]
        for first, files in self.lists:
            if first > epoch:
                break
            out = files
        return out

    def owned(self, start: tuple[int, int], index: int, count: int) -> Iterator[tuple[int, int]]:
        """The shards ``(epoch, pos)`` from ``start`` that loader ``index`` of ``count`` reads.

        Those whose :func:`~overlord.plan.partition.owner` in a partition of
        ``count`` loaders is ``index``; it ends if no later epoch has one.
        """
        alone = [((0, 0), 0, count)]  # the loader's partition, as the only one
        epoch, pos = start
        while True:
            n = len(self.at(epoch))
            for p in range(pos, n):
                if owner((epoch, p), alone) == index:
                    yield epoch, p
            if epoch >= self.lists[-1][0] and index >= n:
                return  # more loaders than shards: this one owns none from here on
            epoch, pos = epoch + 1, 0

    def joined(self, files: list[File], epoch: int) -> SourceFiles:
        """These lists up to ``epoch``, and ``files`` from the next epoch on (if they differ)."""
        kept = [(e, fs) for e, fs in self.lists if e <= epoch]
        current = tuple(sorted(files, key=lambda f: f.name))
        if current != self.at(epoch):
            kept.append((epoch + 1, current))
        return SourceFiles(self.source, kept)

    def record(self) -> list[list[Any]]:
        """As JSON: ``[[first epoch, [[name, size], ...]], ...]``."""
        return [[e, [[f.name, f.size] for f in fs]] for e, fs in self.lists]

    @classmethod
    def of_record(cls, source: str, record: list[list[Any]], base_dir: str) -> SourceFiles:
        """From :meth:`record`; local names are resolved against ``base_dir``."""
        return cls(
            source,
            [
                (int(e), tuple(File(n, _url(n, base_dir), int(size)) for n, size in fs))
                for e, fs in record
            ],
        )

    def check(self, present: Mapping[str, File], first_epoch: int) -> list[str]:
        """Problems of the files epochs from ``first_epoch`` on will read, against ``present``."""
        problems = []
        seen: set[str] = set()
        start = max(e for e, _ in self.lists if e <= first_epoch)
        for e, files in self.lists:
            if e < start:
                continue
            for f in files:
                if f.name in seen:
                    continue
                seen.add(f.name)
                now = present.get(f.name)
                if now is None:
                    problems.append(
                        f"source '{self.source}': file {f.name} of the current epoch is missing"
                    )
                elif now.size != f.size:
                    problems.append(
                        f"source '{self.source}': file {f.name} changed size since the "
                        f"checkpoint: {f.size} bytes then, {now.size} now"
                    )
        return problems

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SourceFiles) and (self.source, self.lists) == (
            other.source,
            other.lists,
        )

    def __repr__(self) -> str:
        return f"SourceFiles({self.source!r}, {[(e, len(fs)) for e, fs in self.lists]})"


def _url(name: str, base_dir: str) -> str:
    return name if "://" in name else os.path.normpath(os.path.join(base_dir, name))


def list_files(
    source: str,
    patterns: list[str],
    base_dir: str,
    storage_options: Mapping[str, Any] | None = None,
) -> list[File]:
    """The files of a source now, with their sizes (globs relative to ``base_dir``, or URLs).

    ``storage_options`` are fsspec's for the URLs (not part of a file's record).
    """
    shards = find_shards(source, patterns, Path(base_dir), storage_options)
    sizes = {}
    for s in shards:
        if "://" not in s.url:
            sizes[s.name] = os.path.getsize(s.url)
        else:
            with s.open(source) as f:
                sizes[s.name] = file_size(f, s.url)
    return [File(s.name, s.url, sizes[s.name]) for s in shards]


def job_files(
    sources: Iterable[tuple[str, list[str]]],
    base_dir: str,
    state: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Mapping[str, Any]] | None = None,
    timeout_s: float = 300.0,
) -> dict[str, SourceFiles]:
    """Each source's files for a job starting now, from ``state`` (a checkpoint) if given.

    ``sources`` are ``(name, path patterns)``; ``storage_options`` fsspec's
    options of a source's URLs, by source name. A source the state records keeps
    its recorded lists up to the furthest epoch the state reaches; files
    listed now join it from the next epoch. Raises :class:`CheckpointError`
    naming every recorded file that is missing or changed size, and :class:`SourceError`
    naming every endpoint that cannot be reached within ``timeout_s`` (``loading.timeout_s``)
    with every source that uses it, before any source is listed.
    """
    sources = list(sources)
    options = storage_options or {}
    down = endpoint_problems(((n, list(p), options.get(n)) for n, p in sources), timeout_s)
    if down:
        names = sorted({n for _, users in down for n in users})
        raise SourceError(", ".join(names), None, None, "; ".join(m for m, _ in down))
    saved = (state or {}).get("sources", {})
    out: dict[str, SourceFiles] = {}
    problems: list[str] = []
    for name, patterns in sources:
        now = list_files(name, patterns, base_dir, (storage_options or {}).get(name))
        record = saved.get(name, {}).get("files")
        if record is None:
            out[name] = SourceFiles(name, [(0, tuple(now))])
            continue
        recorded = SourceFiles.of_record(name, record, base_dir)
        cursor = saved[name].get("cursor", {})
        epoch = max([int(cursor.get("epoch", 0))] + [int(r[0]) for r in cursor.get("skip", [])])
        problems += recorded.check({f.name: f for f in now}, int(cursor.get("epoch", 0)))
        out[name] = recorded.joined(now, epoch)
    if problems:
        raise CheckpointError(
            "the checkpoint's files changed under it, so its positions would mean other "
            "samples (append new files instead: they join at the next epoch):\n  "
            + "\n  ".join(problems)
        )
    return out
