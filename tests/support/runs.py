"""Helpers of the tests that read sources through a Loader: run, and what the trainer got."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from conftest import doc_text
from overlord import Loader
from overlord.sources.tokenizers import BytesTokenizer


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
