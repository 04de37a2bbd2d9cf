"""A pre-tokenized shard's window, its pieces placed from the blocks' ids by compiled copies.

A text window (:func:`overlord.sources.shard.shard_windows`) joins its blocks' records
into one Arrow array, then takes each piece's records out of it. A token file's records
are ranges of ids already read (:class:`~overlord.sources.token_files.BlockIds`): here the
window's blocks are put end to end in the file's dtype, and each piece's int32 ids are
placed from them by one compiled copy that widens them as it goes. After the read, an id
is copied twice (once in the file's dtype, once into its piece) instead of three times
as int32 (widened into its block's records, joined, taken). The window is the same,
piece for piece and byte for byte, as the text way makes of the same blocks' records.

Where numba does not import (the ``fast`` extra), or a file's ids are not in the
machine's byte order, the window is made the text way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from overlord.plan.compiled import copy_kernel
from overlord.sources.token_files import BlockIds, joined
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
    rows = joined([b.rows for b in blocks], np.int64)
    lengths = joined([b.ends - b.starts for b in blocks], np.int64)
    # the blocks' ids end to end, in the file's dtype (each block's, then its rest): every
    # document is one range of them, and a piece is placed by one compiled copy
    sizes = [n for b in blocks for n in (len(b.data), len(b.rest))]
    at = np.cumsum([0, *sizes])[0:-1:2]  # where each block's ids start
    ids = joined([a for b in blocks for a in (b.data, b.rest)], blocks[0].data.dtype)
    starts = joined([b.starts + a for b, a in zip(blocks, at.tolist())], np.int64)
    if len(starts) and int(np.maximum.reduce(starts + lengths)) > len(ids):  # compiled: unchecked
        raise ValueError(f"a document of window {number} of {name} lies past its blocks' ids")
    kept = np.flatnonzero(lengths > 0)
    order = kept[permute(len(kept))]
    offsets = np.zeros(len(order) + 1, np.int64)
    np.cumsum(lengths[order] * ID_BYTES, out=offsets[1:])
    cut = piece_bounds(offsets, PIECE_BYTES)
    pieces: list[Piece | Packed | None] = [
        _piece(ids, starts[order[lo:hi]], lengths[order[lo:hi]]) for lo, hi in cut
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


def _piece(ids: np.ndarray, start: np.ndarray, n: np.ndarray) -> Piece:
    """The piece of documents ``ids[start[i] : start[i] + n[i]]``, in order, as int32 records."""
    copy = copy_kernel()
    assert copy is not None  # see gathers()
    at = np.zeros(len(start) + 1, np.int64)
    np.cumsum(n, out=at[1:])
    # from Arrow's pool, as a taken piece's were: its memory is kept for the next ones
    data = pa.allocate_buffer(int(at[-1]) * ID_BYTES)
    copy(np.frombuffer(data, np.int32), at[:-1], ids, start, n)
    texts = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(start), [None, pa.py_buffer(at * ID_BYTES), data]
    )
    return Piece(texts)
