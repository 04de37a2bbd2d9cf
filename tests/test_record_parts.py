"""Under split a long record's chunks are made and published a part at a time, the same stream."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import overlord
from overlord.roles import read_ahead
from overlord.sources import record_parts
from overlord.sources.files import resolve_files
from overlord.sources.shard import cut_items, shard_windows
from overlord.sources.tokenizers import BytesTokenizer

SIZES = {3: 700_000, 11: 300_000, 20: 1_000_001}  # rows of long records: their bytes


def corpus(root: Path) -> Path:
    """A JSONL source of 30 records, three of them long, under split."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(8)
    with open(root / "a.jsonl", "w") as f:
        for i in range(30):
            n = SIZES.get(i, rng.randrange(10, 3000))
            text = "".join(rng.choice("abcdé ") for _ in range(n // 2))
            f.write(json.dumps({"text": text[: n // 2] + "x" * (n - len(text.encode()))}) + "\n")
    plan = {
        "seed": 6,
        "sources": [{"name": "web", "path": "a.jsonl", "format": "jsonl"}],
        "batch": {"tokens_per_step": 16384, "max_seq_len": 1024, "long_docs": "split"},
        "world": {"dp": 1},
        "shuffle": {"block_bytes": 1 << 20, "window_blocks": 1},
    }
    (root / "plan.yaml").write_text(yaml.safe_dump(plan))
    return root / "plan.yaml"


def items(got: Any) -> list[tuple[int, int, list[int]]]:
    return [
        (int(r), int(c), got.tokens[s : s + n].tolist())
        for r, c, s, n in zip(got.row, got.chunk, got.start, got.length)
    ]


def test_the_parts_make_the_pieces_items(tmp_path: Path) -> None:
    plan = overlord.load_plan(corpus(tmp_path))
    files = resolve_files(plan.sources[0], plan.base_dir)
    tok = BytesTokenizer()
    long = 0
    for window in shard_windows(plan, plan.sources[0], files, 0, 0):
        for lo, hi in window.cut:
            parts = record_parts.record_parts(plan, tok, window, lo, hi)
            whole = items(cut_items(plan, tok, window, lo, hi))
            if not parts:
                continue
            long += 1
            made = []
            for plo, phi, chunks in parts:
                if chunks is None:  # the records before the long one: at once
                    made += items(cut_items(plan, tok, window, plo, phi))
                else:
                    made += items(record_parts.cut_part(plan, tok, window, plo, chunks))
            assert made == whole
            assert parts[-1][:2] == (hi - 1, hi) and len(parts) > 2
            runs = [c for _, _, c in parts if c is not None]
            assert runs[0][0] == 0 and all(b - a == 256 for a, b in runs[:-1])  # PART_TOKENS
    assert long == 3


def stream(plan_path: Path, steps: int) -> list[tuple[list[str], list[int]]]:
    """Each batch's sample ids and tokens."""
    with overlord.Loader(overlord.load_plan(plan_path)) as loader:
        client = loader.client(0)
        batches = [next(client) for _ in range(steps)]
        return [([s.id for s in b.samples], b.input_ids.reshape(-1).tolist()) for b in batches]


def test_the_stream_is_the_same_made_in_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = corpus(tmp_path)
    made: list[tuple[int, int]] = []
    cut_part = record_parts.cut_part

    def spy(plan: Any, tok: Any, window: Any, lo: int, chunks: tuple[int, int]) -> Any:
        made.append(chunks)
        return cut_part(plan, tok, window, lo, chunks)

    monkeypatch.setattr(read_ahead, "cut_part", spy)
    steps = 160  # past the first epoch's 2M tokens
    parts = stream(path, steps)
    assert len(made) > 8  # the long records were made in parts
    monkeypatch.setattr(read_ahead, "record_parts", lambda *a: [])
    whole = stream(path, steps)
    assert parts == whole
    ids = [i for b, _ in whole for i in b]
    assert any(i.endswith("#0") for i in ids) and len(set(ids)) < len(ids)  # chunks, 2 epochs
    assert np.unique([i.split("#")[0] for i in ids]).size == 30
