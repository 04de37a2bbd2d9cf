"""A pre-tokenized shard's window, its pieces placed from the blocks' ids by compiled copies.

A text window (:func:`overlord.sources.shard.shard_windows`) joins its blocks' records
into one Arrow array, then takes each piece's records out of it. A token file's records
are ranges of ids already read (:class:`~overlord.sources.token_files.BlockIds`): here the
window's blocks are put end to end in the file's dtype, and the window's int32 ids are
placed from them, in the window's order, by one compiled copy that widens them as it
goes, into one block that the pieces are views of. After the read, an id is copied twice
(once in the file's dtype, once into the window's block) instead of three times as int32
(widened into its block's records, joined, taken). The window is the same, piece for
piece and byte for byte, as the text way makes of the same blocks' records.

The block goes when the window's last piece does (its items released): it is then used
again for a later window (:class:`~overlord.blocks.KeptBlocks`), so that a process whose
allocator hands large blocks back (a data process, a loader process) does not fault in
fresh pages for every window.

Where numba does not import (the ``fast`` extra), or a file's ids are not in the
machine's byte order, the window is made the text way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from overlord.blocks import KeptBlocks
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
    # document is one range of them
    sizes = [n for b in blocks for n in (len(b.data), len(b.rest))]
    at = np.cumsum([0, *sizes])[0:-1:2]  # where each block's ids start
    parts = [a for b in blocks for a in (b.data, b.rest)]
    dtype = blocks[0].data.dtype
    ids = _WINDOW_IDS.flat_bytes(sum(len(a) for a in parts) * dtype.itemsize).view(dtype)
    np.concatenate(parts, out=ids)  # (a kept block: it goes back once the window is placed)
    starts = joined([b.starts + a for b, a in zip(blocks, at.tolist())], np.int64)
    if len(starts) and int(np.maximum.reduce(starts + lengths)) > len(ids):  # compiled: unchecked
        raise ValueError(f"a document of window {number} of {name} lies past its blocks' ids")
    kept = np.flatnonzero(lengths > 0)
    order = kept[permute(len(kept))]
    offsets = np.zeros(len(order) + 1, np.int64)
    np.cumsum(lengths[order] * ID_BYTES, out=offsets[1:])
    cut = piece_bounds(offsets, PIECE_BYTES)
    # every piece's ids placed by one compiled copy, in the window's order, into one block
    # (see the module's docstring)
    place = offsets // ID_BYTES
    out = _WINDOW_IDS.flat(int(place[-1]))
    copy = copy_kernel()
    assert copy is not None  # see gathers()
    copy(out, place[:-1], ids, starts[order], lengths[order])
    pieces: list[Piece | Packed | None] = [_piece(out, place[lo : hi + 1]) for lo, hi in cut]
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


def _piece(out: np.ndarray, at: np.ndarray) -> Piece:
    """The piece of the documents ``out[at[i] : at[i + 1]]``, in order, as int32 records.

    Its data is a view of ``out``, which it holds: no copy.
    """
    base = int(at[0])
    data = pa.py_buffer(out[base : int(at[-1])])
    texts = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(at) - 1, [None, pa.py_buffer((at - base) * ID_BYTES), data]
    )
    return Piece(texts)


# the windows' ids: a few windows of each source are alive at once (the one being
# taken, the one read ahead); more are made and freed as before
_WINDOW_IDS = KeptBlocks(keep=4)
