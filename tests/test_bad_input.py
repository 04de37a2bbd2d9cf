"""Bad input: every error names its cause and its place, and nothing hangs (issue 2, point 6).

Plan problems are checked without starting anything. Record and file problems
are checked through a running Loader, where a trainer meets them: they must be
raised by ``next(client)``. Plans here use ``loading.timeout_s: 5`` (conftest),
so that a loader that cannot deliver fails the test instead of blocking it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import doc_text, make_corpus, overlord_cli

from overlord import Loader, LoaderError, PlanError, SourceError, load_plan
from overlord.plan.spec import validate_plan
from overlord.sources.files import resolve_files
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import BytesTokenizer

integration = pytest.mark.integration


def good(tag: str, n: int) -> list[dict[str, Any]]:
    return [{"text": doc_text(tag, i)} for i in range(n)]


def run(plan: Path | Any, steps: int) -> tuple[list[Any], dict[str, Any]]:
    """Every rank's batches of ``steps`` steps, and the loader's stats at the end."""
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(loader.plan.world.dp)]
        batches = [next(c) for _ in range(steps) for c in clients]
        return batches, loader.stats()


def ids(batches: list[Any]) -> set[str]:
    return {s.id for b in batches for s in b.samples}


def sample_tokens(batch: Any) -> dict[str, list[int]]:
    """Each sample's tokens, cut out of the packed rows (samples sit in row order)."""
    seq = batch.input_ids.shape[1]
    flat = batch.input_ids.reshape(-1)
    used: dict[int, int] = defaultdict(int)
    out = {}
    for s in batch.samples:
        start = s.row * seq + used[s.row]
        out[s.id] = flat[start : start + s.tokens].tolist()
        used[s.row] += s.tokens
    return out


def byte_tokens(text: str | bytes) -> list[int]:
    data = text.encode() if isinstance(text, str) else text
    return list(data) + [BytesTokenizer.eod_id]


# ---- bad records in a JSONL shard ------------------------------------------------------------

BAD_LINES = {
    "malformed": ('{"text": "cut short', "malformed JSON"),
    "missing-field": ('{"body": "no text here"}', "no field 'text'"),
    "not-a-string": ('{"text": 42}', "field 'text' is int, expected a string"),
    "null": ('{"text": null}', "field 'text' is NoneType, expected a string"),
    "not-an-object": ('["text", "in a list"]', "expected a JSON object, found list"),
    "bare-string": ('"just a string"', "expected a JSON object, found str"),
}


@integration
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


@integration
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


@integration
def test_invalid_utf8_in_a_jsonl_record_names_its_row(tmp_path: Path) -> None:
    data = b'{"text": "fine"}\n{"text": "\xff\xfe broken"}\n{"text": "also fine"}\n'
    plan = make_corpus(tmp_path, {"web": {"files": {"data/web/part-0.jsonl": data}}})
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert (e.value.source, e.value.file, e.value.row) == ("web", "data/web/part-0.jsonl", 1)


@integration
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


@integration
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


@integration
def test_parquet_without_the_text_column(tmp_path: Path) -> None:
    rows = [{"body": doc_text("code", i)} for i in range(5)]
    sources = {"code": {"files": {"data/code/a.parquet": rows}, "text_field": "content"}}
    plan = make_corpus(tmp_path, sources)
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert (e.value.source, e.value.file, e.value.row) == ("code", "data/code/a.parquet", None)
    assert "no column 'content'" in e.value.reason and "body" in e.value.reason


@integration
def test_parquet_text_column_of_another_type(tmp_path: Path) -> None:
    table = pa.table({"text": pa.array(range(5), pa.int64())})
    plan = make_corpus(tmp_path, {"code": {"files": {"data/code/a.parquet": table}}})
    with pytest.raises(SourceError) as e:
        run(plan, 2)
    assert e.value.file == "data/code/a.parquet"
    assert "column 'text' is int64, expected strings" in e.value.reason


@integration
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


@integration
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


# ---- empty sources -----------------------------------------------------------------------------

EMPTY = {
    "empty file": (b"", "fail"),
    "blank lines only": (b"\n  \n\n", "fail"),
    "every record bad (skip)": (b'{"body": 1}\n[1, 2]\n{"text": "cut\n', "skip"),
}


@integration
@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_source_is_a_clear_error_not_a_hang(tmp_path: Path, case: str) -> None:
    data, on_error = EMPTY[case]
    sources = {"web": 6, "empty": {"files": {"data/empty/part-0.jsonl": data}}}
    plan = make_corpus(tmp_path, sources, on_error=on_error)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as e:
        run(plan, 3)
    assert time.monotonic() - t0 < 5
    assert e.value.source == "empty"
    assert "no sample" in e.value.reason


@integration
def test_source_whose_every_document_is_dropped_is_a_clear_error(tmp_path: Path) -> None:
    records = [{"text": "x" * 100} for _ in range(3)]
    plan = make_corpus(
        tmp_path,
        {"long": {"files": {"data/long/part-0.jsonl": records}}},
        batch={"long_docs": "drop"},
    )
    with pytest.raises(SourceError) as e:
        run(plan, 1)
    assert e.value.source == "long" and "dropped" in e.value.reason


# ---- plan problems (no loader started) ---------------------------------------------------------


def test_glob_matching_nothing_names_source_and_pattern(tmp_path: Path) -> None:
    sources = {
        "web": 4,
        "code": {
            "files": {"data/code/a.jsonl": 4},
            "path": ["data/code/*.jsonl", "data/kode/*.jsonl"],
        },
    }
    plan = make_corpus(tmp_path, sources)
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert len(e.value.problems) == 1
    path, msg = e.value.problems[0]
    assert path == "sources[1].path"
    assert "'code'" in msg and "'data/kode/*.jsonl' matches no file" in msg
    assert str(plan) in str(e.value)


def test_weight_naming_an_unknown_source(tmp_path: Path) -> None:
    mixture = {
        "schedule": [
            {"step": 0, "weights": {"web": 0.5, "code": 0.5}},
            {"step": 10, "weights": {"web": 0.5, "wbe": 0.5}},
        ]
    }
    plan = make_corpus(tmp_path, mixture=mixture)
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert len(e.value.problems) == 1
    path, msg = e.value.problems[0]
    assert path == "mixture.schedule[1].weights.wbe"
    assert "unknown source 'wbe'" in msg and "code" in msg and "web" in msg
    assert "mixture.schedule[1].weights.wbe" in str(e.value)


def test_tokens_per_step_not_a_multiple_of_max_seq_len(tmp_path: Path) -> None:
    plan = make_corpus(tmp_path, batch={"tokens_per_step": 300, "max_seq_len": 64})
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert [p for p, _ in e.value.problems] == ["batch.tokens_per_step"]
    assert "300" in e.value.problems[0][1] and "64" in e.value.problems[0][1]


def test_rows_not_divisible_by_dp(tmp_path: Path) -> None:
    plan = make_corpus(tmp_path, world={"dp": 3})  # 4 rows per step
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert [p for p, _ in e.value.problems] == ["world.dp"]
    assert "4 rows" in e.value.problems[0][1] and "dp=3" in e.value.problems[0][1]
    # the same through the Python API's DP override
    with pytest.raises(PlanError) as e:
        load_plan(make_corpus(tmp_path / "ok")).with_dp(3)
    assert [p for p, _ in e.value.problems] == ["world.dp"]


def test_several_schema_problems_are_reported_at_once(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        seed="not a number",
        batch={"max_seq_len": -1},
        world={"dp": 0},
        extra_field=1,
        sources={"web": {"files": {"data/web/a.jsonl": 3}, "format": "csv"}},
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    paths = sorted(p for p, _ in e.value.problems)
    assert paths == sorted(
        ["seed", "sources[0].format", "batch.max_seq_len", "world.dp", "extra_field"]
    )
    assert f"has {len(paths)} problem(s)" in str(e.value)
    for p in paths:
        assert f"  - {p}: " in str(e.value)


def test_several_semantic_problems_are_reported_at_once(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        sources={"web": 4, "code": {"files": {"data/code/a.jsonl": 4}, "name": "web"}},
        batch={"tokens_per_step": 100},
        mixture={
            "schedule": [
                {"step": 0, "weights": {"web": 1.0, "wbe": 1.0}},
                {"step": 0, "weights": {"web": 1.0, "cdoe": 1.0}},
            ]
        },
        tokenizer={"kind": "hf"},
        balance={
            "cost": {
                "alpha": 1.0,
                "beta": 0.0,
                "model": {"params": 1e9, "layers": 8, "hidden": 512},
            }
        },
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    expected = [
        "sources[1].name",
        "batch.tokens_per_step",
        "mixture.schedule[1].step",
        "mixture.schedule[0].weights.wbe",
        "mixture.schedule[1].weights.cdoe",
        "tokenizer.path",
        "balance.cost",
    ]
    assert sorted(p for p, _ in e.value.problems) == sorted(expected)
    assert "has 7 problem(s)" in str(e.value)


def test_schema_and_semantic_problems_are_reported_together(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        seed="x",
        mixture={"schedule": [{"step": 0, "weights": {"web": 1.0, "wbe": 1.0}}]},
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert sorted(p for p, _ in e.value.problems) == ["mixture.schedule[0].weights.wbe", "seed"]


def test_glob_and_other_problems_are_reported_together(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        sources={"web": {"files": {"data/web/a.jsonl": 3}, "path": "data/nothing/*.jsonl"}},
        world={"dp": 3},
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert sorted(p for p, _ in e.value.problems) == ["sources[0].path", "world.dp"]


def test_unreadable_or_invalid_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read the plan file"):
        load_plan(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1, 2\nsources: {")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(PlanError, match="a plan is a mapping, found list"):
        load_plan(bad)


# ---- a loader that dies ------------------------------------------------------------------------


@integration
def test_shard_deleted_mid_run_raises_in_the_trainer_with_where(tmp_path: Path) -> None:
    files = {f"data/web/part-{i}.jsonl": 8 for i in range(4)}
    # a small read-ahead budget: the loader must come back to the files in later epochs
    plan = make_corpus(
        tmp_path, {"web": {"files": files}}, batch={"prefetch_steps": 1, "lookahead": 2}
    )
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(2)]
        for c in clients:
            next(c)
        for rel in files:
            (tmp_path / rel).unlink()
        t0 = time.monotonic()
        with pytest.raises(SourceError) as e:
            for _ in range(100):
                for c in clients:
                    next(c)
        assert time.monotonic() - t0 < 5
    assert e.value.source == "web"
    assert e.value.file in files and e.value.row is None
    assert "cannot read file" in e.value.reason
    assert f"source 'web', file {e.value.file}: " in str(e.value)


@integration
def test_shard_deleted_after_load_plan_before_any_read(tmp_path: Path) -> None:
    plan_path = make_corpus(
        tmp_path, {"web": {"files": {"data/web/a.jsonl": 5, "data/web/b.jsonl": 5}}}
    )
    plan = load_plan(plan_path)
    (tmp_path / "data/web/a.jsonl").unlink()
    (tmp_path / "data/web/b.jsonl").unlink()
    with pytest.raises(PlanError) as e:
        run(plan, 1)
    assert "'data/web/*' matches no file" in str(e.value)


@integration
def test_loader_crash_is_reraised_in_the_trainer_naming_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import overlord.roles.source_loader as sl

    def broken(*args: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(sl, "load_shard_items", broken)
    plan = make_corpus(tmp_path, {"web": 4})
    with pytest.raises(LoaderError) as e:
        run(plan, 1)
    assert "SourceLoader web[0] failed: RuntimeError: disk on fire" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)


@integration
def test_stuck_loader_times_out_naming_source_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import overlord.roles.source_loader as sl

    release = threading.Event()
    real = sl.load_shard_items

    def slow(*args: Any) -> Any:
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(sl, "load_shard_items", slow)
    plan = make_corpus(tmp_path, {"web": 4}, loading={"timeout_s": 0.3})
    with Loader(plan) as loader:
        client = loader.client(0)
        t0 = time.monotonic()
        try:
            with pytest.raises(LoaderError) as e:
                next(client)
        finally:
            release.set()
        assert time.monotonic() - t0 < 3
    msg = str(e.value)
    assert "SourceLoader web[0] produced no data" in msg
    assert "data/web/part-0.jsonl" in msg and "loading.timeout_s" in msg


@integration
def test_more_loaders_than_shards_neither_spins_nor_stalls(tmp_path: Path) -> None:
    plan = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": 6}, "loaders": 2}})
    try:
        proc = overlord_cli("run", str(plan), "--steps", "2", timeout=3)
    except subprocess.TimeoutExpired:
        pytest.fail("overlord run with loaders > shards did not finish in 3 s")
    # either refused with a clear message, or run to the end
    assert proc.returncode == 0 or "loaders" in proc.stderr


# ---- long documents ----------------------------------------------------------------------------

LONG = ["x" * 40, "short", "y" * 15, "z" * 16, "w" * 90]  # 41, 6, 16, 17, 91 tokens


def long_docs_plan(tmp_path: Path, policy: str) -> Path:
    records = [{"text": t} for t in LONG]
    return make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": records}}},
        batch={"tokens_per_step": 64, "max_seq_len": 16, "long_docs": policy},
    )


def delivered(plan: Path, steps: int) -> dict[str, list[int]]:
    batches, _ = run(plan, steps)
    out: dict[str, list[int]] = {}
    for b in batches:
        assert b.input_ids.shape[1] == 16
        assert all(s.tokens <= 16 for s in b.samples)
        out.update(sample_tokens(b))
    return out


@integration
def test_long_docs_split_into_numbered_chunks(tmp_path: Path) -> None:
    got = delivered(long_docs_plan(tmp_path, "split"), 6)
    want: dict[str, list[int]] = {}
    for row, text in enumerate(LONG):
        toks = byte_tokens(text)
        chunks = [toks[k : k + 16] for k in range(0, len(toks), 16)]
        if len(chunks) == 1:
            want[f"data/web/a.jsonl:{row}"] = chunks[0]
        else:
            want |= {f"data/web/a.jsonl:{row}#{k}": c for k, c in enumerate(chunks)}
    assert got == want
    assert [len(got[f"data/web/a.jsonl:4#{k}"]) for k in range(6)] == [16, 16, 16, 16, 16, 11]


@integration
def test_long_docs_truncate_to_max_seq_len(tmp_path: Path) -> None:
    got = delivered(long_docs_plan(tmp_path, "truncate"), 4)
    want = {f"data/web/a.jsonl:{row}": byte_tokens(t)[:16] for row, t in enumerate(LONG)}
    assert got == want
    assert len(got["data/web/a.jsonl:0"]) == 16 and "#" not in "".join(got)


@integration
def test_long_docs_drop_skips_and_counts_them(tmp_path: Path) -> None:
    plan = long_docs_plan(tmp_path, "drop")
    got = delivered(plan, 4)
    assert set(got) == {"data/web/a.jsonl:1", "data/web/a.jsonl:2"}  # 6 and 16 tokens
    _, stats = run(plan, 1)
    (web,) = stats["loaders"]
    assert web["dropped"] == 3  # rows 0, 3 and 4, counted once over every epoch
    proc = overlord_cli("run", str(plan), "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "document(s) (too long or empty)" in proc.stdout


def test_drop_count_of_one_shard(tmp_path: Path) -> None:
    plan = load_plan(long_docs_plan(tmp_path, "drop"))
    spec = plan.sources[0]
    items = load_shard_items(plan, spec, resolve_files(spec, plan.base_dir), BytesTokenizer(), 0, 0)
    assert items.dropped == 3
    assert sorted(items.row.tolist()) == [1, 2]
    assert np.all(items.chunk == -1)


# ---- ranks -------------------------------------------------------------------------------------


@integration
@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_client_rank_outside_the_world(tmp_path: Path, rank: int) -> None:
    with Loader(make_corpus(tmp_path)) as loader, pytest.raises(ValueError) as e:
        loader.client(rank)
    assert f"rank {rank} is outside the plan's world: dp=2, ranks 0..1" in str(e.value)


def test_plan_object_validation_reports_field_paths() -> None:
    data = {
        "sources": [{"name": "bad name!", "path": "x", "format": "jsonl"}],
        "batch": {"tokens_per_step": 64, "max_seq_len": 16},
    }
    with pytest.raises(PlanError) as e:
        validate_plan(data)
    assert [p for p, _ in e.value.problems] == ["sources[0].name"]
    assert "the data plan has 1 problem(s)" in str(e.value)
