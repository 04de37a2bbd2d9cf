"""``overlord.sources.formats``: reading JSONL and Parquet shards, and naming bad records.

Bad records are checked through a running Loader, where a trainer meets them: they
must be raised by ``next(client)`` with source, file and row. Plans use
``loading.timeout_s: 5`` (conftest), so a loader that cannot deliver fails the test
instead of blocking it.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.runs import byte_tokens, good, ids, run, sample_tokens

from conftest import doc_text, make_corpus, overlord_cli
from overlord import SourceError
from overlord.plan.spec import Format
from overlord.sources.files import Shard
from overlord.sources.formats import read_shard

pytestmark = pytest.mark.integration  # every test runs a Loader


# ---- bad records in a JSONL shard ------------------------------------------------------------

BAD_LINES = {
    "malformed": ('{"text": "cut short', "malformed JSON"),
    "missing-field": ('{"body": "no text here"}', "no field 'text'"),
    "not-a-string": ('{"text": 42}', "field 'text' is int, expected a string"),
    "null": ('{"text": null}', "field 'text' is NoneType, expected a string"),
    "not-an-object": ('["text", "in a list"]', "expected a JSON object, found list"),
    "bare-string": ('"just a string"', "expected a JSON object, found str"),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_bad_jsonl_record_fails_with_source_file_and_row(tmp_path: Path, kind: str) -> None:
    line, reason = BAD_LINES[kind]
    records: list[Any] = good("web", 10)
    records.insert(7, line)
    plan = make_corpus(
        tmp_path, {"web": {"files": {"data/web/part-0.jsonl": 5, "data/web/part-1.jsonl": records}}}
    )
    with pytest.raises(SourceError) as e:
        run(plan, 10)
    err = e.value
    assert (err.source, err.file, err.row) == ("web", "data/web/part-1.jsonl", 7)
    assert reason in err.reason
    assert str(err).startswith("source 'web', file data/web/part-1.jsonl, row 7: ")


def test_row_counts_blank_lines_and_a_last_line_without_newline(tmp_path: Path) -> None:
    data = b'{"text": "a"}\n\n   \n{"text": "b"}\n{"text": "no end'
    plan = make_corpus(tmp_path, {"web": {"files": {"data/web/part-0.jsonl": data}}})
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert (e.value.file, e.value.row) == ("data/web/part-0.jsonl", 4)
    assert "malformed JSON" in e.value.reason

    # whitespace-only lines (any length) are not records, but they count as rows
    data = b'{"text": "a"}\n     \n\t \r\n  {"text": "b"}\n'
    plan = make_corpus(tmp_path / "ok", {"web": {"files": {"data/web/part-0.jsonl": data}}})
    batches, _ = run(plan, 2)
    assert ids(batches) == {"data/web/part-0.jsonl:0", "data/web/part-0.jsonl:3"}


def test_invalid_utf8_in_a_jsonl_record_names_its_row(tmp_path: Path) -> None:
    data = b'{"text": "fine"}\n{"text": "\xff\xfe broken"}\n{"text": "also fine"}\n'
    plan = make_corpus(tmp_path, {"web": {"files": {"data/web/part-0.jsonl": data}}})
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert (e.value.source, e.value.file, e.value.row) == ("web", "data/web/part-0.jsonl", 1)


def test_skip_drops_only_bad_records_counts_and_reports_them(tmp_path: Path) -> None:
    records: list[Any] = good("web", 16)
    bad_rows = {3: BAD_LINES["malformed"][0], 8: BAD_LINES["missing-field"][0]}
    bad_rows |= {11: BAD_LINES["not-an-object"][0], 17: BAD_LINES["not-a-string"][0]}
    for row in sorted(bad_rows):
        records.insert(row, bad_rows[row])
    sources = {
        "web": {"files": {"data/web/part-0.jsonl": records}},
        "code": {"files": {"data/code/part-0.parquet": 8}},
    }
    plan = make_corpus(tmp_path, sources, on_error="skip")
    batches, stats = run(plan, 12)  # a few epochs of both sources

    web_rows = set(range(len(records))) - set(bad_rows)
    expected = {f"data/web/part-0.jsonl:{r}" for r in web_rows}
    expected |= {f"data/code/part-0.parquet:{r}" for r in range(8)}
    assert ids(batches) == expected  # every good record of both sources, no bad one

    (web,) = [s for s in stats["loaders"] if s["source"] == "web"]
    (code,) = [s for s in stats["loaders"] if s["source"] == "code"]
    # each bad record counts once, however many epochs re-read its file
    assert web["shards"] > 1 and web["skipped"] == len(bad_rows)
    assert code["skipped"] == 0
    messages = set(web["skipped_examples"])
    for row in bad_rows:
        assert any(
            m.startswith(f"source 'web', file data/web/part-0.jsonl, row {row}: ") for m in messages
        ), row

    # the CLI reports them at the end of a run
    proc = overlord_cli("run", str(plan), "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "bad record(s) (on_error: skip)" in out
    assert "source 'web', file data/web/part-0.jsonl, row 3: malformed JSON" in out


# ---- Parquet -----------------------------------------------------------------------------------


def test_corrupt_parquet_file_names_source_and_file(tmp_path: Path) -> None:
    sources = {
        "code": {
            "files": {"data/code/a.parquet": 6, "data/code/b.parquet": b"PAR1 this is not parquet"},
            "text_field": "content",
        }
    }
    plan = make_corpus(tmp_path, sources)
    with pytest.raises(SourceError) as e:
        run(plan, 10)
    assert (e.value.source, e.value.file, e.value.row) == ("code", "data/code/b.parquet", None)
    assert "cannot read Parquet file" in e.value.reason


def test_parquet_without_the_text_column(tmp_path: Path) -> None:
    rows = [{"body": doc_text("code", i)} for i in range(5)]
    sources = {"code": {"files": {"data/code/a.parquet": rows}, "text_field": "content"}}
    plan = make_corpus(tmp_path, sources)
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert (e.value.source, e.value.file, e.value.row) == ("code", "data/code/a.parquet", None)
    assert "no column 'content'" in e.value.reason and "body" in e.value.reason


def test_parquet_text_column_of_another_type(tmp_path: Path) -> None:
    table = pa.table({"text": pa.array(range(5), pa.int64())})
    plan = make_corpus(tmp_path, {"code": {"files": {"data/code/a.parquet": table}}})
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert e.value.file == "data/code/a.parquet"
    assert "column 'text' is int64, expected strings" in e.value.reason


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_parquet_null_text(tmp_path: Path, on_error: str) -> None:
    texts = [None if i == 4 else doc_text("code", i) for i in range(6)]
    table = pa.table({"text": pa.array(texts, pa.string())})
    plan = make_corpus(
        tmp_path, {"code": {"files": {"data/code/a.parquet": table}}}, on_error=on_error
    )
    if on_error == "fail":
        with pytest.raises(SourceError) as e:
            run(plan, 2)
        assert (e.value.source, e.value.file, e.value.row) == ("code", "data/code/a.parquet", 4)
        assert "null" in e.value.reason
    else:
        batches, stats = run(plan, 4)
        assert ids(batches) == {f"data/code/a.parquet:{r}" for r in (0, 1, 2, 3, 5)}
        assert stats["loaders"][0]["skipped"] == 1  # once, not once per epoch
        assert "row 4: field 'text' is null" in stats["loaders"][0]["skipped_examples"][0]


# ---- compressed shards -------------------------------------------------------------------------


def test_compressed_jsonl_shards_read_like_plain_ones(tmp_path: Path) -> None:
    texts = {name: [doc_text(name, i) + " é ü" for i in range(7)] for name in ("a", "b", "c")}
    root = tmp_path / "data" / "web"
    root.mkdir(parents=True)
    lines = {
        k: "".join(json.dumps({"text": t}) + "\n" for t in v).encode() for k, v in texts.items()
    }
    with gzip.open(root / "a.jsonl.gz", "wb") as f:
        f.write(lines["a"])
    with pa.CompressedOutputStream(str(root / "b.jsonl.zst"), "zstd") as out:
        out.write(lines["b"])
    (root / "c.jsonl").write_bytes(lines["c"])
    assert (root / "b.jsonl.zst").read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # zstd magic
    plan = make_corpus(tmp_path, {"web": {"path": "data/web/*.jsonl*", "format": "jsonl"}})

    batches, _ = run(plan, 6)
    files = {"a": "data/web/a.jsonl.gz", "b": "data/web/b.jsonl.zst", "c": "data/web/c.jsonl"}
    want = {f"{files[k]}:{i}": byte_tokens(t) for k, v in texts.items() for i, t in enumerate(v)}
    got: dict[str, list[int]] = {}
    for b in batches:
        got.update(sample_tokens(b))
    assert got == want


# ---- truncated compressed shards ---------------------------------------------------------------


def lines_of(n: int, tag: str = "web/cut") -> bytes:
    return "".join(json.dumps({"text": doc_text(tag, i)}) + "\n" for i in range(n)).encode()


def complete_lines(partial: bytes) -> int:
    """How many whole lines a decompressed prefix holds (the test's own count)."""
    return partial.count(b"\n")


def write_cut_gzip(path: Path, data: bytes) -> int:
    """A gzip file of ``data`` cut in the middle of its bytes; the whole lines left in it."""
    whole = gzip.compress(data)
    cut = whole[: len(whole) // 2]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cut)
    partial = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(cut)
    return complete_lines(partial)


def test_truncated_gzip_under_skip_keeps_the_records_before_the_cut(tmp_path: Path) -> None:
    kept = write_cut_gzip(tmp_path / "data/web/cut.jsonl.gz", lines_of(40))
    assert 0 < kept < 40  # the cut is in the middle of the records
    plan = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/part-0.jsonl": 6}, "path": "data/web/*"}},
        on_error="skip",
    )
    batches, stats = run(plan, 16)
    cut_ids = {i for i in ids(batches) if i.startswith("data/web/cut.jsonl.gz:")}
    assert cut_ids == {f"data/web/cut.jsonl.gz:{r}" for r in range(kept)}
    (web,) = stats["loaders"]
    assert web["skipped"] == 1  # the cut, once (not once per epoch)
    (example,) = web["skipped_examples"]
    assert example.startswith(f"source 'web', file data/web/cut.jsonl.gz, row {kept}: ")
    assert "truncated file" in example


def test_truncated_gzip_under_fail_names_the_file(tmp_path: Path) -> None:
    kept = write_cut_gzip(tmp_path / "data/web/cut.jsonl.gz", lines_of(40))
    plan = make_corpus(tmp_path, {"web": {"files": {}, "path": "data/web/*"}})
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert (e.value.source, e.value.file, e.value.row) == ("web", "data/web/cut.jsonl.gz", kept)
    assert "truncated file" in e.value.reason


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_read_shard_of_a_truncated_file(tmp_path: Path, codec: str) -> None:
    # 2.5 MB: Arrow's zstd decoder hands out 1 MiB pieces, and keeps those before the cut
    data = lines_of(60000)
    path = tmp_path / ("cut.jsonl.gz" if codec == "gzip" else "cut.jsonl.zst")
    if codec == "gzip":
        whole = gzip.compress(data)
    else:
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write(data)
        whole = sink.getvalue().to_pybytes()
    path.write_bytes(whole[: len(whole) // 2])
    shard = Shard(str(path), path.name)
    texts = read_shard("web", shard, Format.JSONL, "text", skip=True)
    n = len(texts.rows)
    assert 0 < n < 60000
    assert texts.rows.tolist() == list(range(n))
    assert texts.texts.to_pylist() == [doc_text("web/cut", i) for i in range(n)]
    (cut,) = texts.skipped
    assert (cut.file, cut.row) == (path.name, n) and "truncated file" in cut.reason
    if codec == "gzip":  # every whole line before the cut
        partial = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(whole[: len(whole) // 2])
        assert n == complete_lines(partial)
    with pytest.raises(SourceError, match="truncated file") as e:
        read_shard("web", shard, Format.JSONL, "text", skip=False)
    assert (e.value.file, e.value.row) == (path.name, n)


def test_a_whole_multi_member_gzip_file_is_not_truncated(tmp_path: Path) -> None:
    path = tmp_path / "two.jsonl.gz"
    path.write_bytes(gzip.compress(lines_of(3)) + gzip.compress(lines_of(2, "web/two")))
    texts = read_shard("web", Shard(str(path), path.name), Format.JSONL, "text", skip=False)
    assert texts.texts.to_pylist() == [doc_text("web/cut", i) for i in range(3)] + [
        doc_text("web/two", i) for i in range(2)
    ]
    assert texts.skipped == []
