"""A step's columns sorted by rank: a stable order by small integers, each rank's sums.

Items are grouped by row, by group or by length many times a step. numpy
sorts 16-bit keys by radix and wider ones by merging (several times slower),
so :func:`stable_order` sorts small non-negative integers in 16-bit passes:
the same order as ``np.argsort(keys, kind="stable")``, which is unique.

A rank's plan carries the sum of its items' costs. Summing every rank's slice
one call at a time costs a numpy call per rank; ``np.add.reduceat`` adds in
another order than a slice's ``sum`` (numpy sums a contiguous slice pairwise,
in eight lanes), so its last bits differ. :func:`rank_sums` computes every
rank's sum at once with numpy, in the order ``sum`` adds, so a rank's plan
holds the same number either way (tests compare the two).
"""

from __future__ import annotations

import numpy as np

_DIGIT = 16  # bits of one radix pass
_SORT_FEW = 1024  # up to this many keys, numpy's stable argsort costs less than the passes
_LANES = 8  # numpy's pairwise sum adds in eight lanes ...
_BLOCK = 128  # ... over blocks of at most this many items; longer ones are split in halves
# up to this many slices, a slice's own sum (a numpy call each) costs less than the lanes'
# dozens of calls over every slice at once (a step of a few ranks: dp 1 has one)
_FEW = 16


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for non-negative integers, in 16-bit radix passes.

    >>> stable_order(np.array([70000, 3, 70000, 0, 3])).tolist()
    [3, 1, 4, 0, 2]
    """
    keys = np.asarray(keys)
    if len(keys) <= _SORT_FEW or keys.dtype.kind not in "iu" or keys.min() < 0:
        return np.argsort(keys, kind="stable")  # (a few keys: one call costs less than passes)
    order = np.arange(len(keys))
    top, shift = int(keys.max()), 0
    while True:  # least significant digit first: each pass keeps the order of equal digits
        digit = ((keys[order] >> shift) & 0xFFFF).astype(np.uint16)
        order = order[np.argsort(digit, kind="stable")]
        shift += _DIGIT
        if top >> shift == 0:
            return order


def rank_sums(x: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``x[bounds[r]:bounds[r + 1]].sum()`` for every ``r``, equal to the last bit.

    ``x`` is float64; ``bounds`` non-decreasing offsets into it. Slices of more
    than ``_BLOCK`` items (rare: a rank's items of one step) are summed by numpy.

    >>> x = np.array([0.1] * 20)
    >>> rank_sums(x, np.array([0, 3, 3, 20])).tolist() == [x[:3].sum(), 0.0, x[3:].sum()]
    True
    """
    if len(bounds) == 2:  # one rank (dp 1): its slice, summed as below
        return np.array([x[int(bounds[0]) : int(bounds[1])].sum()], dtype=np.float64)
    lo = np.asarray(bounds[:-1], dtype=np.int64)
    n = np.asarray(bounds[1:], dtype=np.int64) - lo
    if len(lo) <= _FEW:
        sums = [x[a : a + m].sum() for a, m in zip(lo.tolist(), n.tolist())]
        return np.array(sums, dtype=np.float64)
    out = np.zeros(len(lo))
    short = np.flatnonzero(n < _LANES)  # one after the other, from 0.0
    for j in range(_LANES - 1):
        at = short[n[short] > j]
        out[at] += x[lo[at] + j]
    mid = np.flatnonzero((n >= _LANES) & (n <= _BLOCK))
    if len(mid):
        out[mid] = _lanes(x, lo[mid], n[mid])
    for r in np.flatnonzero(n > _BLOCK).tolist():
        out[r] = x[lo[r] : lo[r] + n[r]].sum()
    return out


def _lanes(x: np.ndarray, lo: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Sums of ``_LANES`` to ``_BLOCK`` items: eight lanes, their tree, then the rest in turn."""
    lane = [x[lo + j] for j in range(_LANES)]
    whole = n - n % _LANES
    for i in range(_LANES, _BLOCK, _LANES):
        at = np.flatnonzero(i < whole)
        if not len(at):
            break
        for j in range(_LANES):
            lane[j][at] += x[lo[at] + i + j]
    res = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))
    for j in range(_LANES - 1):
        at = np.flatnonzero(whole + j < n)
        res[at] += x[lo[at] + whole[at] + j]
    return res
