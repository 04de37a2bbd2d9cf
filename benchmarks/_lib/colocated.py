"""The colocated loader of ``benchmarks/memory.py``: its per-source state, corpus and dataset.

A *state* is what one colocated DataLoader worker holds for each source, beside the
source's open file and its line index (``parse_state``):

- ``index``: nothing more. A document is found by its line offset and read with a seek
  (Megatron-style indexed reading; no shuffle buffer).
- ``shuffle:<N>MB``: a shuffle buffer of N MiB of the source's records (raw JSONL lines).
  A document is taken from a random slot, decoded and tokenized, and the slot refilled
  from the file (HuggingFace's ``shuffle(buffer_size)`` and webdataset's ``shuffle``,
  sized in bytes). overlord holds the same shuffle state once per source: its window is
  ``block_bytes x window_blocks`` = N MiB of the same records (``overlord_shuffle``).

Pure helpers (``parse_state``, ``overlord_shuffle``, ``linear``) are unit-tested in
``tests/test_bench_memory.py``.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 2**20
BASES = ["stdlib", "tests", "docs", "licenses"]  # demo sources; source k clones BASES[k % 4]
BASE_WEIGHT = {"stdlib": 4.0, "tests": 3.0, "docs": 2.0, "licenses": 1.0}
EOS = "<|endoftext|>"  # the BPE tokenizer's end-of-document token
INDEX_BLOCK = 64 * 1024  # overlord's window at ``index`` state: one block of 64 KiB


@dataclass(frozen=True)
class State:
    """Per-source state of a colocated worker: ``kind`` and, for ``shuffle``, its bytes."""

    kind: str  # "index" | "shuffle"
    bytes: int = 0

    @property
    def label(self) -> str:
        return self.kind if self.kind == "index" else f"shuffle:{self.bytes // MiB}MB"


def parse_state(text: str) -> State:
    """``index`` or ``shuffle:<N>MB`` (N a positive whole number of MiB) as a ``State``."""
    t = text.strip().lower()
    if t == "index":
        return State("index")
    m = re.fullmatch(r"shuffle:(\d+)\s*mi?b", t)
    if m is None or int(m.group(1)) == 0:
        raise ValueError(
            f"--state {text!r}: expected 'index' or 'shuffle:<N>MB' with N a positive "
            "whole number of MiB (e.g. shuffle:16MB)"
        )
    return State("shuffle", int(m.group(1)) * MiB)


def overlord_shuffle(state: State) -> dict[str, int]:
    """overlord's ``shuffle`` section holding ``state`` once per source.

    ``shuffle``: a window of the same bytes (1 MiB blocks); ``index``: one block of
    64 KiB (overlord has no index-only mode: this is its smallest sensible window).
    """
    if state.kind == "index":
        return {"block_bytes": INDEX_BLOCK, "window_blocks": 1}
    return {"block_bytes": MiB, "window_blocks": max(1, state.bytes // MiB)}


def linear(points: list[tuple[float, float]], x: float) -> float:
    """The least-squares line through ``points`` at ``x``; one point: that point's y.

    Used to carry a measured memory figure from the number of sources that fits on this
    machine to the one of the target (memory grows by a fixed amount per source).
    """
    if not points:
        raise ValueError("no points to extrapolate from")
    xs = {p[0] for p in points}
    if len(xs) == 1:
        if x not in xs:
            raise ValueError(f"one measured x ({next(iter(xs))}) cannot give a line to x={x}")
        return sum(p[1] for p in points) / len(points)
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sum((p[0] - mx) ** 2 for p in points)
    return my + slope * (x - mx)


# ---- corpus ---------------------------------------------------------------------------------


def _demo_texts(folder: Path) -> list[str]:
    import pyarrow.parquet as pq

    texts: list[str] = []
    for f in sorted(folder.iterdir()):
        if f.suffix == ".parquet":
            texts += [t for t in pq.read_table(f, columns=["content"]).column(0).to_pylist() if t]
            continue
        raw = f.read_bytes()
        raw = gzip.decompress(raw) if f.name.endswith(".gz") else raw
        texts += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    return texts


def make_corpus(root: Path, max_sources: int, file_bytes: int) -> list[dict[str, Any]]:
    """S sources over 4 JSONL files of at least ``file_bytes`` each, and their line indexes.

    Base file k holds the records of demo source k (Python's own files), repeated in a
    seeded order until it is ``file_bytes`` long; source k is a folder holding a symlink
    to base file ``k % 4`` (shards large enough for two windows of the largest state).
    """
    import numpy as np

    from overlord.demo import build_corpus

    build_corpus(root / "demo")
    (root / "base").mkdir(parents=True, exist_ok=True)
    train = open(root / "train.jsonl", "w")  # noqa: SIM115 (closed below)
    for k, base in enumerate(BASES):
        texts = _demo_texts(root / "demo" / base)
        for t in texts[::2]:  # what the BPE tokenizer is trained on (every 8th of these)
            train.write(json.dumps({"text": t}) + "\n")
        rng, size = random.Random(k), 0
        path = root / "base" / f"{base}.jsonl"
        with open(path, "wb") as out:
            while size < file_bytes:
                rng.shuffle(texts)
                for t in texts:
                    line = (json.dumps({"text": t}) + "\n").encode()
                    out.write(line)
                    size += len(line)
        raw = np.fromfile(path, dtype=np.uint8)
        offsets = np.concatenate(([0], np.flatnonzero(raw == 10) + 1)).astype(np.int64)
        np.save(root / "base" / f"{base}.npy", offsets)
    train.close()
    sources = []
    for k in range(max_sources):
        base = BASES[k % len(BASES)]
        folder = root / "sources" / f"s{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "part-0.jsonl"
        if not link.exists():
            link.symlink_to(root / "base" / f"{base}.jsonl")
        sources.append(
            {
                "name": f"s{k:03d}",
                "file": str(link),
                "index": str(root / "base" / f"{base}.npy"),
                "weight": BASE_WEIGHT[base],
            }
        )
    return sources


# ---- the colocated worker's dataset ---------------------------------------------------------


class Encoder:
    """A worker's tokenizer: UTF-8 bytes (end 256), or a ``tokenizers`` file (end ``EOS``)."""

    def __init__(self, path: str | None):
        import numpy as np

        self.np = np
        self.tok: Any = None
        if path:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(path)  # one per worker process, as people write it
            self.eos = self.tok.token_to_id(EOS)

    def __call__(self, text: str) -> Any:
        np = self.np
        if self.tok is None:
            return np.append(np.frombuffer(text.encode(), np.uint8).astype(np.int32), 256)
        return np.array([*self.tok.encode(text, add_special_tokens=False).ids, self.eos], np.int32)


class SourceReader:
    """One source as a colocated worker holds it: its file, line index and ``State``."""

    def __init__(self, spec: dict[str, Any], state: State, seed: list[int]):
        import numpy as np

        self.fh = open(spec["file"], "rb")  # noqa: SIM115 (held open)
        self.index = np.load(spec["index"])
        self.rng = np.random.default_rng(seed)
        self.state = state
        self.rows = len(self.index) - 1
        if state.kind == "index":
            self.order, self.next = self.rng.permutation(self.rows), 0
            return
        self.buffer: list[bytes] = []
        self.row = int(self.rng.integers(self.rows))  # where its sequential read starts
        self.fh.seek(int(self.index[self.row]))
        held = 0
        while held < state.bytes:  # filled before the first document, as HF's buffer is
            line = self._line()
            self.buffer.append(line)
            held += len(line)

    def close(self) -> None:
        self.fh.close()

    def _line(self) -> bytes:
        if self.row == self.rows:
            self.row = 0
            self.fh.seek(0)
        self.row += 1
        return self.fh.readline()

    def next_text(self) -> str:
        if self.state.kind == "index":
            if self.next == self.rows:
                self.order, self.next = self.rng.permutation(self.rows), 0
            row = int(self.order[self.next])
            self.next += 1
            self.fh.seek(int(self.index[row]))
            line = self.fh.read(int(self.index[row + 1] - self.index[row]))
        else:
            slot = int(self.rng.integers(len(self.buffer)))
            line, self.buffer[slot] = self.buffer[slot], self._line()
        text: str = json.loads(line)["text"]
        return text


def baseline_batches(
    sources: list[dict[str, Any]],
    state: State,
    tokenizer: str | None,
    rows: int,
    seq: int,
    rank: int,
    seed: int,
) -> Iterator[Any]:
    """What each DataLoader worker runs: open every source, mix by weight, pack rows."""
    import numpy as np
    import torch
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    wid = info.id if info is not None else 0
    encode = Encoder(tokenizer)
    readers = [SourceReader(s, state, [seed, rank, wid, k]) for k, s in enumerate(sources)]
    weights = np.array([s["weight"] for s in sources], dtype=np.float64)
    p = weights / weights.sum()
    rng = np.random.default_rng([seed, rank, wid])
    need = rows * seq
    carry = np.zeros(0, dtype=np.int32)
    while True:
        parts, have = [carry], len(carry)
        while have < need:  # concatenate documents and cut rows: GPT-style packing
            doc = encode(readers[int(rng.choice(len(readers), p=p))].next_text())
            parts.append(doc)
            have += len(doc)
        flat = np.concatenate(parts)
        carry = flat[need:].copy()
        ids = torch.from_numpy(flat[:need].astype(np.int64)).view(rows, seq)
        labels = torch.roll(ids, -1, dims=1)
        positions = torch.arange(seq, dtype=torch.int32).expand(rows, seq).contiguous()
        yield {"input_ids": ids, "labels": labels, "position_ids": positions, "tokens": need}
