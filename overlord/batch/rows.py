"""Packing documents into rows: the tensors a trainer consumes, built with numpy.

A rank's batch for one step is ``rows`` rows of ``seq_len`` tokens. Documents
sit back to back in a row; the rest of the row is padding. Next to the tokens:

- ``labels``: the next token of the same document, ``-100`` where there is
  none (a document's last token, padding), so that no loss crosses documents,
  and where a loss ``mask`` leaves the next token out (a chat source's tokens
  that are not the assistant's: :mod:`overlord.sources.chat`);
- ``position_ids``: restart at 0 for every document;
- ``segment_ids``: 1, 2, ... for the documents of a row, 0 for padding;
- ``cu_seqlens``: boundaries of documents (and of each row's padding, as a
  segment of its own) over the flattened ``rows * seq_len`` tokens, as varlen
  attention kernels take them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from overlord.batch import pack_fast
from overlord.blocks import KeptBlocks

IGNORE_INDEX = pack_fast.IGNORE_INDEX


def pack(
    tokens: np.ndarray,
    lengths: np.ndarray,
    row_of: np.ndarray,
    rows: int,
    seq_len: int,
    pad_id: int,
    mask: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Pack documents (``tokens`` back to back, in row order) into ``rows`` rows.

    ``row_of`` is each document's row, non-decreasing; documents keep their
    order inside a row. ``mask`` (one per token, 0 or 1), if given, says which
    tokens are learned: the label at ``t`` is the next token where that token's
    mask is 1, else ``-100``.

    >>> b = pack(np.array([1, 2, 3, 4, 5]), np.array([2, 3]), np.array([0, 1]), 2, 4, 0)
    >>> b["input_ids"].tolist(), b["labels"].tolist()
    ([[1, 2, 0, 0], [3, 4, 5, 0]], [[2, -100, -100, -100], [4, 5, -100, -100]])
    >>> b["cu_seqlens"].tolist()
    [0, 2, 4, 7, 8]
    >>> mask = np.array([0, 1, 0, 0, 1])
    >>> pack(np.array([1, 2, 3, 4, 5]), np.array([2, 3]), np.array([0, 1]), 2, 4, 0, mask)[
    ...     "labels"].tolist()
    [[2, -100, -100, -100], [-100, 5, -100, -100]]

    Where numba imports, one compiled loop writes the rows
    (:mod:`overlord.batch.pack_fast`); else numpy does. The arrays are the same.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    row_of = np.asarray(row_of, dtype=np.int64)
    if pack_fast.kernel() is not None:
        return _pack_compiled(tokens, lengths, row_of, rows, seq_len, pad_id, mask)
    return _pack_numpy(tokens, lengths, row_of, rows, seq_len, pad_id, mask)


def _pack_compiled(
    tokens: np.ndarray,
    lengths: np.ndarray,
    row_of: np.ndarray,
    rows: int,
    seq_len: int,
    pad_id: int,
    mask: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """:func:`pack` by the compiled loop: each output written once, in place."""
    fast = pack_fast.kernel()
    assert fast is not None
    out = _outputs(rows, seq_len)
    used = np.zeros(rows, dtype=np.int64)
    masked = mask is not None
    bad = fast(
        np.ascontiguousarray(tokens), lengths, row_of, int(pad_id),
        np.asarray(mask) if masked else _NO_MASK, masked,
        *(out[k] for k in _OUTPUTS), used,
    )  # fmt: skip
    if bad >= 0:
        raise ValueError(f"row {row_of[bad]} overflows its {seq_len} tokens (a planner bug)")
    cu = np.empty(len(lengths) + rows + 1, dtype=np.int32)
    bounds = pack_fast.bounds_kernel()
    k = -1 if bounds is None else bounds(lengths, row_of, used, seq_len, cu)
    return {**out, "cu_seqlens": cu[:k] if k >= 0 else _cu_seqlens(lengths, row_of, used, seq_len)}


_OUTPUTS = ("input_ids", "labels", "position_ids", "segment_ids")
_NO_MASK = np.zeros(1, dtype=np.uint8)


def _outputs(rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """The four ``(rows, seq_len)`` int32 outputs, uninitialized: views of one block.

    One allocation instead of four: the kernel maps and faults in one region (of huge
    pages from 4 MiB, where numpy asks for them) instead of four apart. At 64 rows of
    8,192 tokens, four arrays took 3.2 ms a step to allocate and fill on this project's
    machine, one block 0.39 ms. Each output is C-contiguous; one that is kept keeps
    the block. The block is one that nothing holds any more where there is one
    (:class:`~overlord.blocks.KeptBlocks`): both packs write every element of it.
    """
    shape = (len(_OUTPUTS), rows, seq_len)
    return dict(zip(_OUTPUTS, _BLOCKS.get(shape) if _SOURCE is None else _SOURCE(shape)))


def scratch(n: int) -> np.ndarray:
    """An int32 array of ``n`` elements for a step's temporaries, uninitialized.

    A step's tokens gathered from its loaders, a loader's answer to a take: written
    whole, read once, then dropped. Kept blocks of the heap are used again once
    nothing holds them (:class:`~overlord.blocks.KeptBlocks`), so that in a process
    whose allocator maps blocks of 128 KiB and more apart (a data process, a loader
    process) they do not fault in fresh pages every time: at 512K tokens a step, these
    two cost a data process's serving thread about a thousand page faults a step.
    """
    return _SCRATCH.flat(n)


def use_blocks(source: Callable[[tuple[int, ...]], np.ndarray] | None) -> None:
    """Where this process's packs take their output blocks: ``source(shape)``, an int32 block.

    None: kept blocks of the heap (:class:`~overlord.blocks.KeptBlocks`), the default. A
    data process packs straight into the shared memory that its trainers map
    (:meth:`overlord.runtime.shm_ring.SlotPool.pack_block`).
    """
    global _SOURCE
    _SOURCE = source


_BLOCKS = KeptBlocks()
_SCRATCH = KeptBlocks(keep=4)  # a step's temporaries (scratch): a gather's, a few answers'
_SOURCE: Callable[[tuple[int, ...]], np.ndarray] | None = None  # see use_blocks


def _pack_numpy(
    tokens: np.ndarray,
    lengths: np.ndarray,
    row_of: np.ndarray,
    rows: int,
    seq_len: int,
    pad_id: int,
    mask: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """:func:`pack` with numpy: per-token columns of the step, then a slice per row."""
    n = len(lengths)
    total = int(lengths.sum())
    src_start = np.zeros(n + 1, dtype=np.int64)  # and the end of the last document
    np.cumsum(lengths, out=src_start[1:])
    # each row's documents are back to back in ``tokens``: a row is one slice of them
    row_start_doc = np.searchsorted(row_of, np.arange(rows))
    first_src = src_start[row_start_doc]
    row_used = src_start[np.searchsorted(row_of, np.arange(rows), side="right")] - first_src
    in_row = src_start[:-1] - first_src[row_of]
    if n and (in_row + lengths > seq_len).any():
        bad = int(np.flatnonzero(in_row + lengths > seq_len)[0])
        raise ValueError(f"row {row_of[bad]} overflows its {seq_len} tokens (a planner bug)")

    # the per-token columns in int32, in the documents' order (no per-token int64 index)
    starts32 = src_start[:-1].astype(np.int32)
    position = np.arange(total, dtype=np.int32)
    position -= np.repeat(starts32, lengths)
    doc_in_row = np.arange(n) - row_start_doc[row_of]
    segment = np.repeat((doc_in_row + 1).astype(np.int32), lengths)
    nxt = np.empty(total, dtype=np.int32)
    nxt[:-1] = tokens[1:]
    nxt[-1:] = IGNORE_INDEX
    if mask is not None:  # a label is the next token: its mask decides
        nxt[:-1][np.asarray(mask[1:total]) == 0] = IGNORE_INDEX
    last = src_start[1:] - 1
    nxt[last[lengths > 0]] = IGNORE_INDEX

    out = _outputs(rows, seq_len)
    input_ids, labels, position_ids, segment_ids = (out[k] for k in _OUTPUTS)
    input_ids.fill(pad_id)
    labels.fill(IGNORE_INDEX)
    position_ids.fill(0)
    segment_ids.fill(0)
    for r, lo, u in zip(range(rows), first_src.tolist(), row_used.tolist()):
        if u:  # one slice per row and output: rows are few, their tokens many
            input_ids[r, :u] = tokens[lo : lo + u]
            labels[r, :u] = nxt[lo : lo + u]
            position_ids[r, :u] = position[lo : lo + u]
            segment_ids[r, :u] = segment[lo : lo + u]

    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "cu_seqlens": _cu_seqlens(lengths, row_of, row_used, seq_len),
    }


def _cu_seqlens(
    lengths: np.ndarray, row_of: np.ndarray, row_used: np.ndarray, seq_len: int
) -> np.ndarray:
    """The boundaries of the documents and of each row's padding, over the flattened rows."""
    pad = seq_len - row_used
    # segments in flattened order: each row's documents, then its padding if any
    seg_len = np.concatenate((lengths, pad[pad > 0]))
    seg_key = np.concatenate((row_of * 2, np.flatnonzero(pad > 0) * 2 + 1))
    seg_len = seg_len[np.argsort(seg_key, kind="stable")]
    cu = np.zeros(len(seg_len) + 1, dtype=np.int32)
    np.cumsum(seg_len, out=cu[1:])
    return cu
