"""Finding a source's shards: globs relative to the plan's folder, or fsspec URLs."""

from __future__ import annotations

import glob as _glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import fsspec

from overlord.errors import PlanError


class SourcePaths(Protocol):
    """What finding a source's files needs of it: its name and its path pattern(s).

    :class:`overlord.plan.spec.SourceSpec` is one; this module does not import the plan's
    module, which imports this one to check a plan's globs.
    """

    @property
    def name(self) -> str:
        """The source's name, for error messages."""

    @property
    def path(self) -> str | list[str]:
        """One glob or URL, or a list of them."""


@dataclass(frozen=True)
class Shard:
    """One file of a source. ``name`` is how ids and errors refer to it."""

    url: str  # what to open: a local path or an fsspec URL
    name: str  # path relative to the plan's folder (local), else the URL


def resolve_files(spec: SourcePaths, base_dir: Path) -> list[Shard]:
    """Every shard of a source, sorted by name, so that the order is the same everywhere.

    Raises :class:`PlanError` naming each pattern that matches nothing.
    """
    patterns = [spec.path] if isinstance(spec.path, str) else list(spec.path)
    return find_shards(spec.name, patterns, base_dir)


def find_shards(source: str, patterns: list[str], base_dir: Path) -> list[Shard]:
    """The files matching ``patterns`` (globs relative to ``base_dir``, or URLs), sorted."""
    shards: dict[str, Shard] = {}
    problems: list[tuple[str, str]] = []
    for pattern in patterns:
        if "://" in pattern:
            fs, _, paths = fsspec.get_fs_token_paths(pattern)
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            found = [p if "://" in p else f"{protocol}://{p}" for p in paths]
            names = found
        else:
            full = pattern if os.path.isabs(pattern) else str(base_dir / pattern)
            found = [p for p in _glob.glob(full, recursive=True) if os.path.isfile(p)]
            names = [os.path.relpath(p, base_dir) for p in found]
        if not found:
            problems.append(
                (
                    "path",
                    f"source '{source}': '{pattern}' matches no file (looked in {base_dir})",
                )
            )
        for url, name in zip(found, names):
            shards[name] = Shard(url=url, name=name)
    if problems:
        raise PlanError(problems)
    return [shards[k] for k in sorted(shards)]
