"""``overlord.sources.probe``: what ``overlord validate`` opens, and the problems it names."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow as pa
import pytest

from conftest import make_corpus
from overlord import load_plan
from overlord.sources.probe import check_sources


def hf_tokenizer_file(path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(path))


def problems(root: Path, sources: dict, **plan: object) -> list[str]:
    return [str(p) for p in check_sources(load_plan(make_corpus(root, sources, **plan)))]


def test_a_good_plan_has_no_problem(tmp_path: Path) -> None:
    hf_tokenizer_file(tmp_path / "tok.json")
    sources = {
        "web": {"files": {"data/web/a.jsonl.gz": ["", "  ", {"text": "hi"}, "not json"]}},
        "code": {"files": {"data/code/a.parquet": 3}, "text_field": "content"},
        "zst": {"files": {"data/zst/a.jsonl.zst": 2}},
    }
    tok = {"kind": "hf", "path": "tok.json", "eos": "</s>"}
    assert problems(tmp_path, sources, tokenizer=tok) == []  # only the first record is read


def test_every_problem_is_reported_with_its_place(tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    table = pa.table({"content": pa.array([1, 2], pa.int64())})
    sources = {
        "a": {"files": {"data/a/0.jsonl": ["", '{"body": "x"}', {"text": "fine"}]}},
        "b": {"files": {"data/b/0.jsonl": ['{"text": 3}']}},
        "c": {"files": {"data/c/0.jsonl": ["[1, 2]"]}},
        "d": {"files": {"data/d/0.jsonl": ['{"text": "cut']}},
        "e": {"files": {"data/e/0.jsonl": b"\n \n"}},
        "f": {"files": {"data/f/0.parquet": table}, "text_field": "content"},
        "g": {"files": {"data/g/0.parquet": table}, "text_field": "text"},
        "h": {"files": {"data/h/0.parquet": b"PAR1 not really"}},
    }
    found = problems(tmp_path, sources, tokenizer={"kind": "hf", "path": "tok.json"})
    want = [
        "tokenizer.path tok.json: cannot load the tokenizer file",
        "source 'a', file data/a/0.jsonl, row 1: no field 'text' (the record has ['body'])",
        "source 'b', file data/b/0.jsonl, row 0: field 'text' is int, expected a string",
        "source 'c', file data/c/0.jsonl, row 0: expected a JSON object, found list",
        "source 'd', file data/d/0.jsonl, row 0: malformed JSON",
        "source 'e', file data/e/0.jsonl: no record (the file is empty or only blank lines)",
        "source 'f', file data/f/0.parquet, column 'content': is int64, expected strings",
        "source 'g', file data/g/0.parquet: no column 'text' (columns: ['content'])",
        "source 'h', file data/h/0.parquet: cannot read the file",
    ]
    assert len(found) == len(want)
    for got, expected in zip(found, want):
        assert got.startswith(expected), (got, expected)


def test_an_eos_that_the_tokenizer_lacks(tmp_path: Path) -> None:
    hf_tokenizer_file(tmp_path / "tok.json")
    tok = {"kind": "hf", "path": "tok.json", "eos": "<|end|>"}
    assert problems(tmp_path, {"web": 2}, tokenizer=tok) == [
        "tokenizer.eos '<|end|>': no such token in tok.json"
    ]


def test_a_missing_tokenizer_file(tmp_path: Path) -> None:
    (found,) = problems(tmp_path, {"web": 2}, tokenizer={"kind": "hf", "path": "nope.json"})
    assert found.startswith("tokenizer.path nope.json: cannot load the tokenizer file")


def test_a_gzip_file_cut_before_its_first_record_ends(tmp_path: Path) -> None:
    whole = gzip.compress(b'{"text": "' + b"x" * 100_000 + b'"}\n')
    path = tmp_path / "data/web/a.jsonl.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(whole[: len(whole) // 2])
    (found,) = problems(tmp_path, {"web": {"files": {}}})
    assert found.startswith("source 'web', file data/web/a.jsonl.gz: cannot read the file")
    assert "EOFError" in found
