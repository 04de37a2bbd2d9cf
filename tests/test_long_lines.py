"""A long JSONL line under truncate is streamed: its text's prefix kept, its rest checked."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import yaml

import overlord
from overlord.errors import SourceError
from overlord.plan.spec import Plan
from overlord.sources import jsonl, long_lines, shard
from overlord.sources.files import resolve_files
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import make_tokenizer

ALPHABET = ["a", " ", '"', "\\", "\n", "é", "😀", "\u2028", "\t", "x", "/"]


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of a few bytes, so that every cut (in an escape, a character) is met."""
    monkeypatch.setattr(long_lines, "READ", 97)
    monkeypatch.setattr(long_lines, "_CHECK", 50)


def scan(line: bytes, keep: int) -> long_lines.Scanned | None:
    return long_lines.scan_line(io.BytesIO(line).read, len(line), "text", keep)


def test_the_text_is_the_records_or_its_prefix(small_pieces: None) -> None:
    rng = random.Random(0)
    cut = 0
    for _ in range(2000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(400)))
        other = "z" * rng.randrange(300)
        record = {"id": 3, "text": text, "other": other}
        if rng.random() < 0.5:  # the text before or after a long field, and nested values
            record = {"other": other, "n": [1, {"k": "v\\"}], "text": text}
        line = json.dumps(record, ensure_ascii=rng.random() < 0.5).encode()
        keep = rng.randrange(40, 200)
        got = scan(line, keep)
        if got is None:  # a blank prefix: the line is read whole
            assert not text[: keep // 6].strip()
        elif got.cut:
            cut += 1
            assert text.startswith(got.text) and len(got.text) < len(text)
            assert len(got.text.encode()) >= (keep - 4 * long_lines._BACK) // 6
        else:
            assert got.text == text
    assert cut > 100  # the prefixes were met, not only short texts


def test_a_whole_text_is_the_records(small_pieces: None) -> None:
    rng = random.Random(1)
    for _ in range(1000):  # ensure_ascii escapes an emoji as a pair of surrogates
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(400)))
        record = {"other": "z" * rng.randrange(300), "text": text, "n": [1, {"k": "v"}]}
        line = json.dumps(record, ensure_ascii=rng.random() < 0.5).encode()
        got = long_lines.scan_line(io.BytesIO(line).read, len(line), "text", 64, whole=True)
        assert got is not None and not got.cut
        got_text = got.text if isinstance(got.text, str) else bytes(got.text).decode()
        assert got_text == text
        assert long_lines.text_array(got.text).to_pylist() == [text]


@pytest.mark.parametrize(
    "line, why",
    [
        (b'{"text": "' + b"y" * 300, "not terminated"),
        (b'{"text": "' + b"y" * 300 + b'\\x"}', "Invalid \\escape"),
        (b'{"text": "' + b"y" * 150 + b"\x01" + b"y" * 150 + b'"}', "Invalid control character"),
        (b'{"text": "' + b"y" * 150 + b"\xff" + b"y" * 150 + b'"}', "can't decode byte 0xff"),
        (b'{"text": "' + b"y" * 300 + b'"', "Expecting ',' delimiter"),
        (b'{"text": "' + b"y" * 300 + b'"}}', "Extra data"),
        (b'{"text": "' + b"y" * 300 + b'"} \\ ', "Extra data"),
        (b'["' + b"y" * 300 + b'"]', "expected a JSON object, found list"),
        (b'{"t": "' + b"y" * 300 + b'"}', "no field 'text'"),
        (b'{"text": 5, "a": "' + b"y" * 300 + b'"}', "field 'text' is int"),
    ],
)
def test_a_malformed_long_line_is_a_bad_record(small_pieces: None, line: bytes, why: str) -> None:
    with pytest.raises(long_lines.BadLine, match=why.replace("\\", "\\\\")):
        scan(line, 64)


def corpus(root: Path, long: list[int], on_error: str = "fail") -> Path:
    """A JSONL source of 40 records; those at ``long`` are 300 KB texts, one written badly."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2)
    with open(root / "a.jsonl", "w") as f:
        for i in range(40):
            n = 300_000 if i in long else rng.randrange(10, 2000)
            text = "".join(rng.choice(ALPHABET) for _ in range(n))
            if i == long[0]:
                text = "   " + text  # leading white space: the prefix must keep it
            f.write(json.dumps({"n": i, "text": text}, ensure_ascii=i % 2 == 0) + "\n")
    plan = {
        "seed": 4,
        "sources": [{"name": "web", "path": "a.jsonl", "format": "jsonl"}],
        "batch": {"tokens_per_step": 4096, "max_seq_len": 512, "long_docs": "truncate"},
        "world": {"dp": 1},
        "shuffle": {"block_bytes": 65536, "window_blocks": 2},
        "on_error": on_error,
    }
    (root / "plan.yaml").write_text(yaml.safe_dump(plan))
    return root / "plan.yaml"


def shard_items(plan: Plan) -> list[tuple[int, list[int]]]:
    files = resolve_files(plan.sources[0], plan.base_dir)
    items = load_shard_items(plan, plan.sources[0], files, make_tokenizer(plan.tokenizer), 0, 0)
    return [
        (int(r), items.tokens[s : s + n].tolist())
        for r, s, n in zip(items.row, items.start, items.length)
    ]


def test_a_streamed_line_gives_the_tokens_of_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = overlord.load_plan(corpus(tmp_path, [5, 17, 30]))
    whole = shard_items(plan)
    seen: list[int] = []
    scan_line = long_lines.scan_line

    def spy(read, size, text_field, keep, whole=False):  # type: ignore[no-untyped-def]
        assert not whole  # the prefix only
        seen.append(size)
        return scan_line(read, size, text_field, keep, whole)

    monkeypatch.setattr(jsonl, "STREAM_LINE", 100_000)  # the 300 KB lines are streamed
    monkeypatch.setattr(jsonl, "scan_line", spy)
    streamed = shard_items(plan)
    assert len(seen) == 3 and min(seen) > 300_000
    assert streamed == whole and len(whole) == 40
    assert max(len(t) for _, t in whole) == 512


@pytest.mark.parametrize("policy", ["split", "drop"])
def test_a_line_streamed_whole_gives_the_same_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    path = corpus(tmp_path, [0, 17, 30])
    raw = yaml.safe_load(path.read_text())
    raw["batch"]["long_docs"] = policy
    raw["loading"] = {"max_record_bytes": 1 << 20}
    path.write_text(yaml.safe_dump(raw))
    plan = overlord.load_plan(path)
    whole = shard_items(plan)
    seen: list[bool] = []
    scan_line = long_lines.scan_line

    def spy(read, size, text_field, keep, whole=False):  # type: ignore[no-untyped-def]
        seen.append(whole)
        return scan_line(read, size, text_field, keep, whole)

    monkeypatch.setattr(jsonl, "STREAM_LINE", 100_000)
    monkeypatch.setattr(jsonl, "scan_line", spy)
    assert shard_items(plan) == whole and seen == [True] * 3
    rows = {r for r, _ in whole}
    assert len(whole) > 40 if policy == "split" else (rows.isdisjoint({0, 17, 30}) and rows)


def test_without_truncate_or_with_a_transform_the_line_is_read_whole() -> None:
    base = overlord.validate_plan(
        {
            "sources": [{"name": "a", "path": "/x/a.jsonl", "format": "jsonl"}],
            "batch": {"tokens_per_step": 4096, "max_seq_len": 512, "long_docs": "truncate"},
            "world": {"dp": 1},
        }
    )
    assert shard._text_prefix(base, base.sources[0]) == 256 * 1024 + 1
    split = base.model_copy(update={"batch": base.batch.model_copy(update={"long_docs": "split"})})
    assert shard._text_prefix(split, split.sources[0]) is None
    spec = base.sources[0].model_copy(update={"transform": "str.lower"})
    assert shard._text_prefix(base, spec) is None


def test_a_bad_long_line_names_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = corpus(tmp_path, [5, 17, 30], on_error="skip")
    lines = (tmp_path / "a.jsonl").read_bytes().split(b"\n")
    lines[17] = lines[17][:-2] + b'\\q"}'  # an invalid escape at the end of a 300 KB text
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines))
    monkeypatch.setattr(jsonl, "STREAM_LINE", 100_000)
    plan = overlord.load_plan(path)
    rows = {r for r, _ in shard_items(plan)}
    assert 17 not in rows and {5, 16, 18, 30} <= rows
    failing = overlord.validate_plan({**plan.model_dump(mode="json"), "on_error": "fail"},
                                     base_dir=plan.base_dir)  # fmt: skip
    with pytest.raises(SourceError, match="row 17.*Invalid \\\\escape"):
        shard_items(failing)
    assert np.all(np.diff(sorted(rows)) > 0)
