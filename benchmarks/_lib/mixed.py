"""The torch DataLoader baseline: a mixed, packed token stream written as people write one.

:class:`MixedTokens` is an ``IterableDataset`` for ``DataLoader(ds, batch_size=None,
num_workers=W)``. Each worker (of each rank) reads its own share of every
source's JSONL files, line by line with ``json.loads``, a pass after a pass in a
new shuffled order; it picks the source of each next document at random with
fixed document probabilities; it tokenizes 64 documents of a source at a time
(``tokenizers``' ``encode_batch_fast`` where it exists, else ``encode_batch``;
or UTF-8 bytes), appends the end-of-document id, and packs the documents back
to back into rows (a document may continue on the next row, GPT-style). A
batch is ``{"input_ids", "labels"}``, int64 tensors of ``rows x seq_len``, the
labels shifted by one token. Workers run the tokenizer on one thread each
(``TOKENIZERS_PARALLELISM=false``), as the ``tokenizers`` docs ask of forked
processes.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

BYTES_EOD = 256  # overlord's BytesTokenizer: ids 0-255 are bytes, 256 ends a document
ENCODE_BATCH = 64  # documents per tokenizer call


def files_of(paths: list[Path], part: int, parts: int) -> list[Path]:
    """One reader's share of a source's files (every file when there are fewer files)."""
    return paths[part::parts] if len(paths) >= parts else list(paths)


class MixedTokens(IterableDataset[dict[str, torch.Tensor]]):
    """Rows of ``seq_len`` tokens from ``sources`` mixed by ``doc_weights`` (see the module).

    ``tokenizer`` is a ``tokenizer.json`` path (with ``eos``, its end-of-document
    token) or None for UTF-8 bytes. ``rank`` and ``world`` split the files
    between the ranks of a job; the workers of a rank split its share again.
    """

    def __init__(
        self,
        sources: dict[str, list[Path]],
        doc_weights: dict[str, float],
        tokenizer: str | None,
        eos: str | None,
        rows: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ):
        super().__init__()
        self.sources, self.doc_weights = sources, doc_weights
        self.tokenizer, self.eos = tokenizer, eos
        self.rows, self.seq_len, self.seed = rows, seq_len, seed
        self.rank, self.world = rank, world

    def _encoder(self) -> Any:
        if self.tokenizer is None:
            return lambda texts: [
                np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int32), BYTES_EOD)
                for t in texts
            ]
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.tokenizer)
        eos = tok.token_to_id(self.eos) if self.eos else None
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)

        def run(texts: list[str]) -> list[np.ndarray]:
            out = []
            for e in encode(texts, add_special_tokens=False):
                ids = np.asarray(e.ids, dtype=np.int32)
                out.append(ids if eos is None else np.append(ids, np.int32(eos)))
            return out

        return run

    def _docs(self, paths: list[Path], rng: random.Random, encode: Any) -> Iterator[np.ndarray]:
        """A source's documents as token arrays, pass after pass, files shuffled each pass."""
        while True:
            order = list(paths)
            rng.shuffle(order)
            for path in order:
                texts: list[str] = []
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        texts.append(json.loads(line)["text"])
                        if len(texts) == ENCODE_BATCH:
                            yield from encode(texts)
                            texts = []
                if texts:
                    yield from encode(texts)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
        part, parts = self.rank * workers + worker, self.world * workers
        rng = random.Random(self.seed * 1000 + part)
        encode = self._encoder()
        names = list(self.sources)
        streams = [self._docs(files_of(self.sources[n], part, parts), rng, encode) for n in names]
        weights = [self.doc_weights[n] for n in names]
        need = self.rows * self.seq_len + 1  # one token more: the last label
        pending: list[np.ndarray] = []
        held = 0
        while True:
            while held < need:
                doc = next(streams[rng.choices(range(len(names)), weights)[0]])
                pending.append(doc)
                held += len(doc)
            flat = np.concatenate(pending)
            x = torch.from_numpy(flat[:need].astype(np.int64))
            # the last input token of this batch is the first of the next one
            pending, held = [flat[need - 1 :]], len(flat) - need + 1
            shape = (self.rows, self.seq_len)
            yield {"input_ids": x[:-1].view(shape), "labels": x[1:].view(shape)}
