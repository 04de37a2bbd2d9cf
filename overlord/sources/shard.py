"""A source's deterministic order, and one shard turned into planner items.

The order of a source in epoch ``e``: its shards in a permutation drawn from
``(seed, source, e)``, and inside each shard its records in a permutation drawn
from ``(seed, source, e, shard)``. Reading one shard at a time keeps I/O
sequential; the order does not depend on how many loaders share the source,
because a shard's items are the same whoever reads it.

An *item* is what the planner places in a row: a whole document, or one chunk
of a document longer than ``max_seq_len`` (``long_docs: split``). Its identity
is its position ``(epoch, shard_pos, index)``: the shard's place in the epoch's
order and the item's place in that shard's order.

A record whose text is empty, or only white space (Unicode's, as ``str.strip``
sees it), after the source's transform, is not a sample: it would be a
document of its end-of-document token alone. It is counted as *empty*, as is a
text the tokenizer turns into no token at all. Items are numbered after empty
records are taken out.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from overlord.errors import SourceError
from overlord.plan.spec import LongDocs, OnError, Plan, SourceSpec
from overlord.sources.catalog import File
from overlord.sources.files import Shard
from overlord.sources.formats import ShardTexts, read_shard
from overlord.sources.tokenizers import Tokenizer
from overlord.sources.transforms import load_transform


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([k & 0xFFFFFFFF for k in keys]))


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def shard_order(seed: int, source: str, epoch: int, n_shards: int) -> np.ndarray:
    """File indexes of a source's shards in the order epoch ``epoch`` reads them.

    >>> shard_order(0, "web", 0, 4).tolist() == shard_order(0, "web", 0, 4).tolist()
    True
    """
    return _rng(seed, _name_key(source), epoch, 0x5A).permutation(n_shards)


def record_order(seed: int, source: str, epoch: int, file_index: int, n: int) -> np.ndarray:
    """Permutation of a shard's records for one epoch."""
    return _rng(seed, _name_key(source), epoch, file_index + 1).permutation(n)


@dataclass
class ShardItems:
    """Items of one shard in epoch order, with their tokens (payloads)."""

    epoch: int
    shard_pos: int
    file_index: int
    tokens: np.ndarray  # int32: the shard's documents back to back
    start: np.ndarray  # int64 per item: first token in ``tokens``
    length: np.ndarray  # int32 per item: tokens
    row: np.ndarray  # int64 per item: row of the record in its file
    chunk: np.ndarray  # int32 per item: k for the k-th chunk of a split document, else -1
    patches: np.ndarray  # int32 per item: image patches for the encoder's cost (0 for text)
    skipped: list[SourceError] = field(default_factory=list)
    dropped: int = 0  # documents dropped as too long (long_docs: drop)
    records: int = 0  # records the file holds: good, empty and bad (a truncated file's cut: 1)
    empty: int = 0  # records whose text is blank, or gives no token: not samples

    def __len__(self) -> int:
        return len(self.length)


def _transform(spec: SourceSpec, shard: File, texts: ShardTexts, skip: bool) -> ShardTexts:
    """The source's transform on every record; one that fails is a bad record."""
    assert spec.transform is not None
    fn = load_transform(spec.transform)
    rows, out, skipped = [], [], list(texts.skipped)
    for row, text in zip(texts.rows.tolist(), texts.texts.to_pylist()):
        try:
            new = fn(text)
            if not isinstance(new, str):
                raise TypeError(f"returned {type(new).__name__}, not str")
        except Exception as e:
            err = SourceError(spec.name, shard.name, row, f"transform {spec.transform}: {e!r}")
            if not skip:
                raise err from e
            skipped.append(err)
            continue
        rows.append(row)
        out.append(new)
    return ShardTexts(np.asarray(rows, dtype=np.int64), pa.array(out, pa.large_string()), skipped)


def load_shard_items(
    plan: Plan,
    spec: SourceSpec,
    files: Sequence[File],
    tokenizer: Tokenizer,
    epoch: int,
    shard_pos: int,
) -> ShardItems:
    """Read, tokenize, order and cut one shard into items; ``files`` are the epoch's files."""
    file_index = int(shard_order(plan.seed, spec.name, epoch, len(files))[shard_pos])
    shard = files[file_index]
    skip = plan.on_error is OnError.SKIP
    texts = read_shard(spec.name, Shard(shard.url, shard.name), spec.format, spec.text_field, skip)
    records = len(texts.rows) + len(texts.skipped)
    if spec.transform is not None:
        texts = _transform(spec, shard, texts, skip)
    texts, empty = _without_blank(texts)
    tokens, offsets = tokenizer.encode(texts.texts)
    perm = record_order(plan.seed, spec.name, epoch, file_index, len(texts.rows))
    doc_start = offsets[:-1][perm]
    doc_len = np.diff(offsets)[perm]
    rows = texts.rows[perm]

    cap = plan.batch.max_seq_len
    keep = doc_len > 0
    empty += int(len(keep) - keep.sum())  # texts the tokenizer makes nothing of
    policy = plan.batch.long_docs
    dropped = 0
    if policy is LongDocs.DROP:
        dropped = int((keep & (doc_len > cap)).sum())
        keep &= doc_len <= cap
    elif policy is LongDocs.TRUNCATE:
        doc_len = np.minimum(doc_len, cap)
    doc_start, doc_len, rows = doc_start[keep], doc_len[keep], rows[keep]

    n_chunks = (
        np.maximum(1, -(-doc_len // cap)) if policy is LongDocs.SPLIT else np.ones_like(doc_len)
    )
    doc_of = np.repeat(np.arange(len(doc_len)), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks  # index of each document's first item
    k = np.arange(len(doc_of)) - np.repeat(first, n_chunks)
    start = doc_start[doc_of] + k * cap
    length = np.minimum(cap, doc_len[doc_of] - k * cap).astype(np.int32)
    chunk = np.where(n_chunks[doc_of] > 1, k, -1).astype(np.int32)
    return ShardItems(
        epoch=epoch,
        shard_pos=shard_pos,
        file_index=file_index,
        tokens=tokens,
        start=start.astype(np.int64),
        length=length,
        row=rows[doc_of].astype(np.int64),
        chunk=chunk,
        patches=np.zeros(len(length), dtype=np.int32),
        skipped=texts.skipped,
        dropped=dropped,
        records=records,
        empty=empty,
    )


def _without_blank(texts: ShardTexts) -> tuple[ShardTexts, int]:
    """The records whose text is not blank, and how many were."""
    blank = pc.equal(pc.binary_length(pc.utf8_trim_whitespace(texts.texts)), 0)
    n = int(pc.sum(blank).as_py() or 0)
    if n == 0:
        return texts, 0
    keep = pc.invert(blank)
    rows = texts.rows[np.asarray(keep, dtype=bool)]
    return ShardTexts(rows, texts.texts.filter(keep), texts.skipped), n
