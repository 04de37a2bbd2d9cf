"""``overlord.sources.files``: a source's shards from globs, sorted; patterns that match nothing.

Pure: files are written, nothing is started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from overlord import PlanError
from overlord.plan.spec import SourceSpec
from overlord.sources.files import find_shards, resolve_files


def touch(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}\n")


@dataclass(frozen=True)
class Paths:
    """Not a SourceSpec: anything with a name and path patterns will do."""

    name: str
    path: str | list[str]


def test_shards_are_sorted_by_name_relative_to_the_base_and_found_once(tmp_path: Path) -> None:
    touch(tmp_path, "web/b.jsonl", "web/a.jsonl", "web/sub/c.jsonl", "web/notes.txt")
    spec = SourceSpec(name="web", path=["web/**/*.jsonl", "web/a.jsonl"], format="jsonl")
    shards = resolve_files(spec, tmp_path)
    assert [s.name for s in shards] == ["web/a.jsonl", "web/b.jsonl", "web/sub/c.jsonl"]
    assert [Path(s.url) for s in shards] == [tmp_path / s.name for s in shards]
    assert resolve_files(Paths("web", ["web/**/*.jsonl", "web/a.jsonl"]), tmp_path) == shards


def test_one_pattern_as_a_string(tmp_path: Path) -> None:
    touch(tmp_path, "code/x.parquet")
    assert [s.name for s in resolve_files(Paths("code", "code/*.parquet"), tmp_path)] == [
        "code/x.parquet"
    ]


def test_every_pattern_that_matches_nothing_is_named(tmp_path: Path) -> None:
    touch(tmp_path, "web/a.jsonl")
    with pytest.raises(PlanError) as e:
        find_shards("web", ["web/*.jsonl", "wbe/*.jsonl", "web/*.gz"], tmp_path)
    msgs = [m for _, m in e.value.problems]
    assert [p for p, _ in e.value.problems] == ["path", "path"]
    assert "source 'web': 'wbe/*.jsonl' matches no file" in msgs[0]
    assert "'web/*.gz' matches no file" in msgs[1] and str(tmp_path) in msgs[1]
