"""A pre-tokenized shard's window, gathered from its blocks' ids in one copy.

A text window (:func:`overlord.sources.shard.shard_windows`) joins its blocks' records
into one Arrow array, then takes each piece's records out of it. A token file's records
are ranges of ids already read (:class:`~overlord.sources.token_files.BlockIds`): here
each piece's int32 ids are placed straight from the ids as read, in the file's dtype,
widened as they are placed. An id is copied once on its way from the file to its piece,
not three times (widened into its block's records, joined, taken), and a window being
built holds its blocks' ids once, in the file's dtype. The window is the same, piece for
piece and byte for byte, as the text path makes of the same blocks' records.

Where numba does not import (the ``fast`` extra), or a file's ids are not in the
machine's byte order, the window is made the text way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from overlord.plan.compiled import copy_kernel
from overlord.sources.token_files import BlockIds
from overlord.sources.window import PIECE_BYTES, Packed, Piece, Window, piece_bounds

ID_BYTES = 4  # a record's ids are int32 bytes


def gathers(dtype: np.dtype) -> bool:
    """Whether windows of a file of ``dtype`` ids are gathered here (else the text way)."""
    return dtype.isnative and copy_kernel() is not None


def token_window(
    blocks: list[BlockIds],
    permute: Callable[[int], np.ndarray],
    epoch: int,
    shard_pos: int,
    file_index: int,
    number: int,
    source: str,
    name: str,
) -> Window:
    """Window ``number`` of a shard: ``blocks``' documents that hold ids, in ``permute``'s order.

    ``permute(n)``: the window's order of its ``n`` documents that hold ids (a document
    that is its eos alone holds none: it is counted as empty, not a sample).
    """
    rows = _joined([b.rows for b in blocks], np.int64)
    lengths = _joined([b.ends - b.starts for b in blocks], np.int64)
    first = np.cumsum([0] + [len(b.rows) for b in blocks])  # each block's first document
    kept = np.flatnonzero(lengths > 0)
    order = kept[permute(len(kept))]
    offsets = np.zeros(len(order) + 1, np.int64)
    np.cumsum(lengths[order] * ID_BYTES, out=offsets[1:])
    cut = piece_bounds(offsets, PIECE_BYTES)
    pieces: list[Piece | Packed | None] = [
        _piece(blocks, first, order[lo:hi], lengths[order[lo:hi]]) for lo, hi in cut
    ]
    return Window(
        *(epoch, shard_pos, file_index, number),
        rows=rows[order],
        offsets=offsets,
        cut=cut,
        pieces=pieces,
        records=len(rows),
        empty=len(rows) - len(kept),
        source=source,
        name=name,
    )


def _piece(blocks: list[BlockIds], first: np.ndarray, docs: np.ndarray, n: np.ndarray) -> Piece:
    """The piece of documents ``docs`` (indexes over the blocks' documents), of ``n`` ids each.

    One compiled copy per block the documents come from; a block's last document, where
    it runs on past the block's ids (into ``rest``), is placed by two slices.
    """
    copy = copy_kernel()
    assert copy is not None  # see gathers()
    at = np.zeros(len(docs) + 1, np.int64)
    np.cumsum(n, out=at[1:])
    ids = np.empty(int(at[-1]), np.int32)
    block_of = first.searchsorted(docs, side="right") - 1
    for b in np.flatnonzero(np.bincount(block_of, minlength=len(blocks))).tolist():
        mine = np.flatnonzero(block_of == b)
        block = blocks[b]
        local = docs[mine] - first[b]
        start, end = block.starts[local], block.ends[local]
        inside = end <= len(block.data)
        if not inside.all():  # the block's last document, past its ids
            (j,) = np.flatnonzero(~inside)
            a, s, split = int(at[mine[j]]), int(start[j]), len(block.data) - int(start[j])
            ids[a : a + split] = block.data[s:]
            ids[a + split : a + int(n[mine[j]])] = block.rest[: int(end[j]) - len(block.data)]
            mine, start = mine[inside], start[inside]
        copy(ids, at[mine], block.data, start, n[mine])
    texts = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(docs), [None, pa.py_buffer(at * ID_BYTES), pa.py_buffer(ids)]
    )
    return Piece(texts)


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
