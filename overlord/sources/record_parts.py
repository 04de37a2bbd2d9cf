"""A long record's chunks made a part at a time (``long_docs: split``, the bytes tokenizer).

A piece of a window (:mod:`overlord.sources.window`) is tokenized, cut into items and
published at once, so a piece of one record of ``S`` bytes made all of its ``S + 1``
tokens (4 bytes each) at once and its loader held them together. Under ``split`` with
the bytes tokenizer token ``i`` of a document is its byte ``i`` (and the last its
end-of-document id), so chunk ``k`` is bytes ``[k * L, (k + 1) * L)`` of the text,
``L`` being ``max_seq_len``, and a run of chunks can be made from those bytes alone:
:func:`record_parts` cuts such a piece into runs of about :data:`PART_TOKENS` tokens and
:func:`cut_part` makes one run's items, the same items (tokens, rows, chunk numbers, in
the same order) that :func:`overlord.sources.shard.cut_items` makes of the whole
piece. The reader (:mod:`overlord.roles.read_ahead`) tokenizes and publishes the
parts in order, each under its budget, so the tokens a loader holds of a long record
are what its budget lets it hold ahead, not the record's. The record's text is still
held (once) until its last part is published.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from overlord.plan.spec import LongDocs, Plan
from overlord.sources.shard import ShardItems
from overlord.sources.tokenizers import BytesTokenizer, Tokenizer
from overlord.sources.window import PIECE_BYTES, Packed, Window

PART_TOKENS = PIECE_BYTES  # tokens of one part: as many as a piece of text has bytes


Part = tuple[int, int, "tuple[int, int] | None"]  # records [lo, hi), and chunks [c0, c1) of one


def record_parts(plan: Plan, tokenizer: Tokenizer, window: Window, lo: int, hi: int) -> list[Part]:
    """The parts of piece ``[lo, hi)`` of a window, if it ends with a long record.

    A record of more than :data:`PIECE_BYTES` ends its piece (:func:`piece_bounds`
    cuts within it). Its parts: the records before it, at once (no chunks), then runs
    ``[c0, c1)`` of its chunks. Empty (the piece is made at once) unless that record has
    more than :data:`PART_TOKENS` tokens under ``split`` with the bytes tokenizer.
    """
    if (
        plan.batch.long_docs is not LongDocs.SPLIT
        or hi <= lo
        or window.has_images
        or not isinstance(tokenizer, BytesTokenizer)
    ):
        return []
    tokens = window.text_bytes(hi - 1, hi) + 1  # its bytes, then its end-of-document id
    cap = plan.batch.max_seq_len
    chunks = -(-tokens // cap)
    if tokens <= PART_TOKENS or chunks <= 1:
        return []
    if isinstance(window.pieces[window.cut.index((lo, hi))], Packed):
        return []  # a standby's piece would be unpacked for every part
    per = max(1, PART_TOKENS // cap)
    before: list[Part] = [(lo, hi - 1, None)] if hi - 1 > lo else []
    return before + [(hi - 1, hi, (c, min(c + per, chunks))) for c in range(0, chunks, per)]


def part_tokens(plan: Plan, chunks: tuple[int, int]) -> int:
    """Tokens of chunks ``[c0, c1)`` at most (the last chunk may be shorter)."""
    return (chunks[1] - chunks[0]) * plan.batch.max_seq_len


def cut_part(
    plan: Plan, tokenizer: Tokenizer, window: Window, lo: int, chunks: tuple[int, int]
) -> ShardItems:
    """The items of chunks ``[c0, c1)`` of record ``lo`` of ``window`` (its ``record_parts``)."""
    texts = window.arrays(lo, lo + 1).texts.cast(pa.large_string())
    _, off_buf, data_buf = texts.buffers()
    a, b = np.frombuffer(off_buf, np.int64)[texts.offset : texts.offset + 2].tolist()
    size = b - a  # the record's bytes
    total = size + 1  # its tokens
    cap = plan.batch.max_seq_len
    first, last = chunks[0] * cap, min(chunks[1] * cap, total)  # its tokens [first, last)
    data = np.frombuffer(data_buf, np.uint8)[a + first : a + min(last, size)]
    tokens = np.empty(last - first, np.int32)
    tokens[: len(data)] = data
    if last == total:
        tokens[-1] = BytesTokenizer.eod_id
    k = np.arange(chunks[0], chunks[1], dtype=np.int64)
    start = k * cap - first
    length = np.minimum(cap, total - k * cap).astype(np.int32)
    n = len(k)
    return ShardItems(
        epoch=window.epoch,
        shard_pos=window.shard_pos,
        file_index=window.file_index,
        tokens=tokens,
        start=start,
        length=length,
        row=np.full(n, window.rows[lo], np.int64),
        chunk=k.astype(np.int32),
        patches=np.zeros(n, np.int32),
        text_bytes=len(data),
    )
