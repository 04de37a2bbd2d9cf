"""The rows of :func:`overlord.batch.rows.pack`, written by one compiled loop (numba).

Optional (``pip install 'overlord-data[fast]'``), as :mod:`overlord.plan.select_fast`:
numba is imported, and the loop compiled (or loaded from numba's cache), on the
first call of :func:`kernel`; without numba ``pack`` builds the same arrays with
numpy. The loop writes each output once, in place: a document's ids, labels,
positions and segment, then each row's padding; numpy's way makes and copies a
whole-step array per output besides (positions, segments, next tokens), which
is most of a step's packing for the short documents of a pre-tokenized corpus.
"""

from __future__ import annotations

import numpy as np

from overlord.plan.compiled import compiled_once

IGNORE_INDEX = -100  # as overlord.batch.rows (which imports this module, not the reverse)


def _rows(
    tokens: np.ndarray,
    lengths: np.ndarray,
    row_of: np.ndarray,
    pad_id: int,
    mask: np.ndarray,
    masked: bool,
    ids: np.ndarray,  # the four outputs, (rows, seq_len) int32, written whole
    labels: np.ndarray,
    positions: np.ndarray,
    segments: np.ndarray,
    used: np.ndarray,  # int64 (rows,): the tokens of each row, written here
) -> int:
    """Write the rows; -1, or the first document that overflows its row (nothing then holds)."""
    rows, seq_len = ids.shape
    doc_in_row = np.zeros(rows, dtype=np.int64)
    src = 0
    for d in range(len(lengths)):
        r = row_of[d]
        n = lengths[d]
        at = used[r]
        if at + n > seq_len:
            return d
        doc_in_row[r] += 1
        # by slices, which compile to straight copies and fills: no branch per token
        ids[r, at : at + n] = tokens[src : src + n]
        if n:  # a label is the next token of the same document, where its mask keeps it
            labels[r, at : at + n - 1] = tokens[src + 1 : src + n]
            labels[r, at + n - 1] = IGNORE_INDEX
            if masked:
                for t in range(n - 1):
                    if mask[src + t + 1] == 0:
                        labels[r, at + t] = IGNORE_INDEX
        for t in range(n):
            positions[r, at + t] = t
        segments[r, at : at + n] = doc_in_row[r]
        used[r] = at + n
        src += n
    for r in range(rows):
        u = used[r]
        ids[r, u:] = pad_id
        labels[r, u:] = IGNORE_INDEX
        positions[r, u:] = 0
        segments[r, u:] = 0
    return -1


def _bounds(
    lengths: np.ndarray, row_of: np.ndarray, used: np.ndarray, seq_len: int, cu: np.ndarray
) -> int:
    """Write ``cu_seqlens`` into ``cu``: each row's documents, then its padding if any.

    ``row_of`` must not decrease (as :func:`_rows` packs). Returns how many bounds were
    written, or -1 where ``row_of`` decreases (nothing then holds).
    """
    cu[0] = 0
    k, at, d = 1, 0, 0
    for r in range(len(used)):
        while d < len(lengths) and row_of[d] == r:
            at += lengths[d]
            cu[k] = at
            k += 1
            d += 1
        if used[r] < seq_len:
            at += seq_len - used[r]
            cu[k] = at
            k += 1
    return k if d == len(lengths) else -1


# the compiled loops (None where numba does not import), compiled at the first call
kernel = compiled_once(_rows)
bounds_kernel = compiled_once(_bounds)
