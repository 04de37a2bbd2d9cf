"""Per-record transforms: run on the SourceLoader, a failing one is a bad record with its place."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_corpus
from overlord import Loader, PlanError, SourceError, load_plan
from overlord.sources.transforms import clean_text, pack_zlib_json, zlib_json


def test_zlib_json_unpacks_what_pack_zlib_json_packed():
    text = "document ünïcode " * 40
    packed = pack_zlib_json(text)
    assert isinstance(packed, str) and packed != text
    assert zlib_json(packed) == text
    with pytest.raises(ValueError):
        zlib_json("not packed")


def test_clean_text_is_idempotent_and_changes_messy_text():
    messy = "a  b\r\n\n\n\nc\t "
    once = clean_text(messy)
    assert once != messy and clean_text(once) == once


@pytest.mark.integration
def test_a_transform_runs_on_every_record_and_a_failing_one_names_its_place(tmp_path):
    records = [{"text": pack_zlib_json(f"document {i} " * (i + 1))} for i in range(12)]
    plain = make_corpus(
        tmp_path / "plain",
        {
            "web": {
                "files": {
                    "data/web/a.jsonl": [{"text": f"document {i} " * (i + 1)} for i in range(12)]
                }
            }
        },
    )
    packed = make_corpus(
        tmp_path / "packed",
        {
            "web": {
                "files": {"data/web/a.jsonl": records},
                "transform": "overlord.sources.transforms:zlib_json",
            }
        },
    )

    def texts(path: Path) -> tuple[list[str], list[int]]:
        with Loader(load_plan(path)) as loader:
            batch = next(loader.client(0))
        return [s.id for s in batch.samples], batch.input_ids.ravel().tolist()

    ids, tokens = texts(packed)
    assert (ids, tokens) == texts(plain)  # the same documents' tokens, in the same order
    assert bytes(t for t in tokens if t < 256).decode().startswith("document")

    broken = make_corpus(
        tmp_path / "broken",
        {
            "web": {
                "files": {"data/web/a.jsonl": [*records[:3], {"text": "not packed"}, *records[4:]]},
                "transform": "overlord.sources.transforms:zlib_json",
            }
        },
    )
    with pytest.raises(SourceError, match=r"file data/web/a\.jsonl, row 3: transform"):
        texts(broken)


def test_a_transform_that_cannot_be_loaded_is_a_plan_error(tmp_path):
    path = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": 3}, "transform": "nope:f"}})
    with pytest.raises(PlanError, match=r"sources\[0\]\.transform: cannot import module 'nope'"):
        load_plan(path)
