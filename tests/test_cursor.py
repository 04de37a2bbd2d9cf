"""SourceCursor: a source's items back in source order, and its state (first pending, skips)."""

from __future__ import annotations

from typing import Any

import pytest
from support.roundtrip import Part, check_save_restore

from conftest import make_corpus
from overlord import load_plan
from overlord.roles.cursor import SourceCursor
from overlord.roles.source_loader import SourceLoader
from overlord.sources.catalog import job_files


@pytest.mark.integration
def test_a_source_cursor_resumes_from_its_state(tmp_path):
    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {f"data/web/p{i}.jsonl": 5 + i for i in range(3)}}},
            batch={"tokens_per_step": 128, "max_seq_len": 64, "lookahead": 4},
        )
    )
    files = job_files([("web", ["data/web/*"])], str(plan.base_dir))["web"]

    def make(state: dict[str, Any] | None) -> tuple[SourceCursor, SourceLoader]:
        start = None if state is None else state["cursor"]
        loader = SourceLoader(plan, files, "web", 0, 1, start)
        cursor = SourceCursor(
            "web",
            lambda epoch: len(files.at(epoch)),
            lambda k: loader.metadata(5.0),
            lambda: [((0, 0), 0, 1)],
            start,
        )
        return cursor, loader

    def advance(part: tuple[SourceCursor, SourceLoader]) -> list[Any]:
        cursor, _ = part
        cursor.peek(2)
        got = cursor.take([0, 2])  # item 1 stays pending: the state holds a skip run
        return [got["key"].tolist(), got["tokens"].tolist()]

    outputs = check_save_restore(
        Part(make, advance, lambda p: {"cursor": p[0].state()}, lambda p: p[1].close()), 12
    )
    assert {k[0] for keys, _ in outputs for k in keys} == {0, 1}  # it crossed an epoch
