"""Shards stream: blocks, windows and their order (the README's rule), ids, bounded memory.

The rule is checked against blocks computed here from the file's bytes (the
lines that start in each ``block_bytes`` of it), not from the reader's code.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_corpus
from overlord import CheckpointError, Loader, Plan, load_plan
from overlord.roles import read_ahead as read_ahead_module
from overlord.roles.read_ahead import ReadView
from overlord.roles.source_loader import SourceLoader
from overlord.sources import shard as shard_module
from overlord.sources.catalog import job_files
from overlord.sources.jsonl import line_index
from overlord.sources.shard import (
    block_order,
    cut_items,
    load_shard_items,
    shard_windows,
    window_order,
)
from overlord.sources.tokenizers import BytesTokenizer
from overlord.sources.window import Packed

HANG_GUARD_S = 30.0  # only a hang takes this long


def lines_by_block(data: bytes, block_bytes: int) -> list[list[int]]:
    """Rows of the lines that start in each block of ``data`` (blank lines included)."""
    n = -(-len(data) // block_bytes)
    out: list[list[int]] = [[] for _ in range(n)]
    start = 0
    for row, line in enumerate(data.split(b"\n")):
        if start < len(data):
            out[start // block_bytes].append(row)
        start += len(line) + 1
    return out


def expected_rows(
    data: bytes, block_bytes: int, window: int, seed: int, source: str, seekable: bool
) -> list[int]:
    """The README's order of one shard (file index 0, epoch 0) as rows, blank lines out."""
    lines = data.split(b"\n")
    blocks = lines_by_block(data, block_bytes)
    order = block_order(seed, source, 0, 0, len(blocks)) if seekable else range(len(blocks))
    order = list(order)
    rows: list[int] = []
    for w, i in enumerate(range(0, len(order), window)):
        records = [r for k in order[i : i + window] for r in blocks[k] if lines[r].strip()]
        perm = window_order(seed, source, 0, 0, w, len(records))
        rows += [records[j] for j in perm]
    return rows


def shard_plan(tmp_path: Path, name: str, block_bytes: int, window: int, **kw: object) -> Path:
    plan = {
        "seed": 7,
        "sources": [{"name": "web", "path": f"data/{name}", "format": kw.pop("fmt", "jsonl")}],
        "batch": {"tokens_per_step": 4096, "max_seq_len": 4096, "long_docs": "truncate"},
        "shuffle": {"block_bytes": block_bytes, "window_blocks": window},
        **kw,
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def shard_rows(plan_path: Path) -> list[int]:
    plan = load_plan(plan_path)
    spec = plan.sources[0]
    files = job_files([("web", [str(spec.path)])], str(plan.base_dir))["web"].at(0)
    items = load_shard_items(plan, spec, files, BytesTokenizer(), 0, 0)
    return items.row.tolist()


def jsonl_bytes(texts: list[str]) -> bytes:
    return b"".join((json.dumps({"text": t}) + "\n").encode() if t else b"\n" for t in texts)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_shard_streams_in_the_readme_order(tmp_path: Path, compressed: bool) -> None:
    rng = np.random.default_rng(0)
    texts = ["" if i % 7 == 3 else "w" * int(rng.integers(1, 300)) for i in range(400)]
    data = jsonl_bytes(texts)
    (tmp_path / "data").mkdir()
    name = "a.jsonl.gz" if compressed else "a.jsonl"
    (tmp_path / "data" / name).write_bytes(gzip.compress(data) if compressed else data)
    got = shard_rows(shard_plan(tmp_path, name, 1024, 3))
    assert got == expected_rows(data, 1024, 3, 7, "web", seekable=not compressed)
    assert sorted(got) == [i for i, t in enumerate(texts) if t]  # each record once, ids = lines


def test_a_line_longer_than_a_block_leaves_the_blocks_it_spans_empty(tmp_path: Path) -> None:
    texts = ["a" * 50, "b" * 5000, "c" * 20, "d" * 30]
    data = jsonl_bytes(texts)
    assert [len(b) for b in lines_by_block(data, 512)].count(0) >= 8
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(data)
    got = shard_rows(shard_plan(tmp_path, "a.jsonl", 512, 2))
    assert got == expected_rows(data, 512, 2, 7, "web", seekable=True)
    assert sorted(got) == [0, 1, 2, 3]


def test_parquet_blocks_are_row_groups(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    texts = [f"document {i}" for i in range(50)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "data" / "a.parquet", row_group_size=8)
    got = shard_rows(shard_plan(tmp_path, "a.parquet", 1 << 20, 2, fmt="parquet"))
    groups = [list(range(i, min(50, i + 8))) for i in range(0, 50, 8)]
    order = block_order(7, "web", 0, 0, len(groups)).tolist()
    want: list[int] = []
    for w, i in enumerate(range(0, len(order), 2)):
        records = [r for k in order[i : i + 2] for r in groups[k]]
        want += [records[j] for j in window_order(7, "web", 0, 0, w, len(records))]
    assert got == want


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=60),
    tail=st.booleans(),
    block=st.integers(1, 64),
)
def test_the_line_index_finds_every_block_start(lines: list[bytes], tail: bool, block: int) -> None:
    import io

    data = b"\n".join(lines) + (b"\n" if tail and lines else b"")
    starts, rows = line_index(io.BytesIO(data), len(data), block)
    n = -(-len(data) // block)
    assert len(starts) == n + 1 and starts[-1] == len(data)
    line_starts = [0] + [i + 1 for i, c in enumerate(data) if c == 10 and i + 1 < len(data)]
    for k in range(n):  # the first line start at or after k*B, and the lines before it
        first = next((s for s in line_starts if s >= k * block), len(data))
        assert starts[k] == first
        if first < len(data):
            assert rows[k] == data[:first].count(b"\n")


@pytest.mark.integration
def test_a_long_document_is_read_once_not_once_per_chunk(tmp_path: Path, monkeypatch) -> None:
    """long_docs: split of a 2 MB single-document file opens it once per epoch."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(json.dumps({"text": "x" * 2_000_000}) + "\n")
    plan = json.loads(shard_plan(tmp_path, "a.jsonl", 1 << 16, 2).read_text())
    plan["batch"] = {"tokens_per_step": 4096, "max_seq_len": 1024, "long_docs": "split"}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    opened: list[str] = []
    epochs: list[int] = []
    real_open, real_windows = shard_module.open_shard, read_ahead_module.shard_windows

    def counting(source, shard, *args):
        opened.append(shard.name)
        return real_open(source, shard, *args)

    def reading(plan, spec, files, epoch, *args):
        epochs.append(epoch)
        return real_windows(plan, spec, files, epoch, *args)

    monkeypatch.setattr(shard_module, "open_shard", counting)
    monkeypatch.setattr(read_ahead_module, "shard_windows", reading)
    with Loader(tmp_path / "plan.json") as loader:
        client = loader.client(0)
        ids = [s.id for _ in range(20) for s in next(client).samples]
    assert ids[:3] == ["data/a.jsonl:0#0", "data/a.jsonl:0#1", "data/a.jsonl:0#2"]
    # 80 of epoch 0's 1,954 chunks, its file opened once. Reading ahead may open it for
    # the next epochs: the document of epoch 1 being cut into pieces, and the window of
    # epoch 2 read ahead (how far depends on the threads' timing); once per epoch each.
    assert epochs == list(range(len(epochs))) and 1 <= len(epochs) <= 3
    assert opened == ["data/a.jsonl"] * len(epochs)


@pytest.mark.integration
def test_a_loader_holds_its_budget_not_a_shard_far_larger(tmp_path: Path) -> None:
    """A 12 MB shard, a budget of some 20K tokens: the loader reads a few windows, then waits."""
    (tmp_path / "data").mkdir()
    doc = "y" * 3000
    with open(tmp_path / "data" / "big.jsonl", "w") as f:
        for _ in range(4000):
            f.write(json.dumps({"text": doc}) + "\n")
    plan = load_plan(
        make_corpus(
            tmp_path / "p",
            {"web": {"files": {"data/web/a.jsonl": 1}}},
            batch={"tokens_per_step": 4096, "max_seq_len": 2048, "prefetch_steps": 1},
            shuffle={"block_bytes": 1 << 18, "window_blocks": 2},
        )
    )
    files = job_files([("web", [str(tmp_path / "data" / "big.jsonl")])], str(plan.base_dir))
    pool = pa.default_memory_pool()
    loader = SourceLoader(plan, files["web"], "web", 0, 1)
    try:
        _wait_settled(loader)  # it stays there: nothing is released
        s = loader.stats()
        budget, piece = s["budget_tokens"], 256 << 10
        assert s["held_tokens"] <= budget + piece  # the budget, or one piece past it
        assert s["tokens"] < 12_000_000 // 20  # it read a small part of the shard
        assert s["shards"] == 0 and not s["done_reading"]
        # Arrow holds the windows' text: two windows of 512 KiB, not the 12 MB shard
        assert pool.bytes_allocated() < 4 << 20
    finally:
        loader.close()


def _wait_settled(loader: SourceLoader) -> ReadView:
    """What ``loader`` holds once its budget alone holds it back (nothing moves after that).

    Its scheduler waits on the budget with no piece in flight and its window
    thread waits too: until an item is released or asked for, neither reads.
    """
    deadline = time.monotonic() + HANG_GUARD_S
    while not (view := loader.reader.view()).settled:
        assert time.monotonic() < deadline, (view, loader.stats())
        with loader.reader.lock:  # wake when the reader moves (no fixed sleep)
            loader.reader.lock.wait(0.05)
    return view


def _lines_file(tmp_path: Path, name: str) -> Path:
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / name, "w") as f:
        for i in range(4000):
            f.write(json.dumps({"text": f"{i} " + "z" * 3000}) + "\n")
    return tmp_path / "data" / name


def _one_source_plan(tmp_path: Path, tokens_per_step: int) -> Plan:
    return load_plan(
        make_corpus(
            tmp_path / "p",
            {"web": {"files": {"data/web/a.jsonl": 1}}},
            batch={"tokens_per_step": tokens_per_step, "max_seq_len": 2048, "prefetch_steps": 1},
            shuffle={"block_bytes": 1 << 20, "window_blocks": 4},
        )
    )


def test_a_packed_window_cuts_into_the_same_items(tmp_path: Path) -> None:
    """A standby holds its pieces compressed: unpacked, they are the same records and items."""
    path = _lines_file(tmp_path, "packed.jsonl")
    plan = _one_source_plan(tmp_path, 4096)
    files = job_files([("web", [str(path)])], str(plan.base_dir))["web"].at(0)
    spec, tok = plan.sources[0], BytesTokenizer()
    plain, packed = (next(shard_windows(plan, spec, files, 0, 0)) for _ in range(2))
    packed.pack()
    assert all(isinstance(p, Packed) for p in packed.pieces)
    held = sum(p.data.size for p in packed.pieces if isinstance(p, Packed))
    assert held < packed.text_bytes(0, len(packed)) // 4  # "z" * 3000 compresses well
    lo, hi = packed.cut[1][0] + 1, packed.cut[3][1] - 1  # a run across pieces
    assert packed.arrays(lo, hi).texts.equals(plain.arrays(lo, hi).texts)
    for a, b in packed.cut:
        want, got = cut_items(plan, tok, plain, a, b), cut_items(plan, tok, packed, a, b)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.row, want.row)
        packed.release(a, b)
    assert packed.released


@pytest.mark.integration
def test_a_window_lets_go_of_each_piece_once_it_is_cut(tmp_path: Path) -> None:
    """The window being cut holds its pieces not cut yet; Arrow holds no more than that.

    A window's pieces are arrays of their own, released as each is tokenized, so a
    loader holds what is left of the window being cut and the one read ahead.
    """
    path = _lines_file(tmp_path, "pieces.jsonl")
    plan = _one_source_plan(tmp_path, 1 << 21)
    files = job_files([("web", [str(path)])], str(plan.base_dir))
    pool = pa.default_memory_pool()
    loader = SourceLoader(plan, files["web"], "web", 0, 1)
    try:
        view = _wait_settled(loader)
        arrow = pool.bytes_allocated()
        window, left = view.cutting, view.left
        assert window is not None
        started = len(window.cut) - len(left)
        released = [p is None for p in window.pieces]
        held = window.text_bytes(left[0][0], len(window)) if left else 0
        assert started >= 3  # 16, 32, 64 KiB and more: the first pieces are cut ...
        assert released == [k < started for k in range(len(window.cut))]  # ... and gone
        with pytest.raises(RuntimeError, match="released"):
            window.arrays(0, 1)
        assert held < window.text_bytes(0, len(window)) - (100 << 10)
        whole = 0
        if view.ahead:  # read once the last half of the window being cut started
            (ahead,) = view.ahead
            assert 2 * held <= window.text_bytes(0, len(window))
            whole = ahead.text_bytes(0, len(ahead))
        # the uncut pieces and any window ahead, with their offsets; not the whole window
        assert arrow < held + whole + (256 << 10), (arrow, held, whole)
    finally:
        loader.close()


@pytest.mark.integration
def test_a_checkpoint_of_format_2_is_refused_naming_the_version(tmp_path: Path) -> None:
    plan_path = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": 20}}})
    with Loader(plan_path) as loader:
        next(loader.client(0))
        state = loader.state_dict()
    state["version"] = 2
    with pytest.raises(CheckpointError, match=r"version 2 .*shards now stream in blocks"):
        Loader(plan_path, state=state)


@pytest.mark.integration
def test_the_shuffle_settings_are_part_of_a_source_order(tmp_path: Path) -> None:
    """A checkpoint does not resume a plan whose blocks or windows differ (other positions)."""
    plan_path = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": 20}}})
    with Loader(plan_path) as loader:
        next(loader.client(0))
        state = loader.state_dict()
    plan = load_plan(plan_path).model_dump(mode="json")
    plan["shuffle"] = {"block_bytes": 4096, "window_blocks": 8}
    other = plan_path.parent / "other.json"
    other.write_text(json.dumps(plan))
    with pytest.raises(CheckpointError, match="web"):
        Loader(other, state=state)


def test_a_truncated_gzip_streams_what_precedes_the_cut(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    texts = [f"record {i} " + "z" * 200 for i in range(300)]
    raw = gzip.compress(jsonl_bytes(texts))
    (tmp_path / "data" / "a.jsonl.gz").write_bytes(raw[: len(raw) * 2 // 3])
    plan = load_plan(shard_plan(tmp_path, "a.jsonl.gz", 2048, 2, on_error="skip"))
    spec = plan.sources[0]
    files = job_files([("web", [str(spec.path)])], str(plan.base_dir))["web"].at(0)
    windows = list(shard_windows(plan, spec, files, 0, 0))
    cut = [e for w in windows for e in w.skipped]
    assert len(cut) == 1 and "truncated file" in str(cut[0]) and "a.jsonl.gz" in str(cut[0])
    rows = sorted(r for w in windows for r in w.rows.tolist())
    assert rows == list(range(len(rows))) and 100 < len(rows) < 300  # the lines before it


@pytest.mark.integration
def test_reads_stop_when_the_loader_closes_mid_shard(tmp_path: Path) -> None:
    """Closing a loader in the middle of a large shard ends its threads."""
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "big.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"{i} " + "q" * 1000}) + "\n")
    plan = load_plan(shard_plan(tmp_path, "big.jsonl", 1 << 14, 2))
    files = job_files([("web", [str(plan.sources[0].path)])], str(plan.base_dir))
    before = {t.name for t in threading.enumerate()}
    loader = SourceLoader(plan, files["web"], "web", 0, 1)
    loader.metadata(HANG_GUARD_S)
    loader.close()
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not [n for n in left if n.startswith(("overlord-window", "overlord-loader"))]
