"""The loop of :func:`overlord.plan.select.select_step`, compiled with numba.

Optional (``pip install 'overlord-data[fast]'``): numba is imported, and the loop
compiled (or loaded from numba's cache), on the first call of :func:`kernel`,
so this module imports with numpy alone. :func:`overlord.plan.select.select_items`
runs it where numba imports. The Selection and the ``mix`` update are those
of ``select_step`` bit for bit: the deficits are the same float64 expression
in the same order (no fused multiply-add: numba contracts none without
``fastmath``), the rows the same best fit, and the windows are peeked at the
same indices in the same order (the loop returns to Python for an item not
fetched yet).

The best fit finds the least room that takes ``t`` in a two-level bitset over
the rooms ``0..capacity`` of the used rows (32 bits a word), and the lowest
row with that room in its pairing heap (one node per row, in arrays); rows
never used are ``fresh..rows``, as in ``select_step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from overlord.plan.compiled import compiled_once

# what the kernel returns: done, an item of st[_S] not converted yet (st[_I]), outputs full
_DONE, _NEED, _FULL = 0, 1, 2
# its scalar state, in st: rows, capacity, lookahead, live sources, items out, first fresh
# row, the highest room that may have a used row, and the item needed
_ROWS, _CAP, _LOOK, _NLIVE, _NOUT, _FRESH, _HI, _S, _I = range(9)
_FIRST_CHUNK = 1024  # items of a window converted at first (doubled when more are read)


def _tz(x: int) -> int:
    """Trailing zeros of a nonzero 32-bit word."""
    n = 0
    if x & 0xFFFF == 0:
        n += 16
        x >>= 16
    if x & 0xFF == 0:
        n += 8
        x >>= 8
    if x & 0xF == 0:
        n += 4
        x >>= 4
    if x & 0x3 == 0:
        n += 2
        x >>= 2
    if x & 0x1 == 0:
        n += 1
    return n


def _least_from(bits: np.ndarray, summary: np.ndarray, f: int) -> int:
    """The least room ``>= f`` that some used row has (-1: none)."""
    w = f >> 5
    if w >= len(bits):
        return -1
    x = bits[w] & (0xFFFFFFFF << (f & 31)) & 0xFFFFFFFF
    if x:
        return (w << 5) + _tz(x)
    w += 1
    k = w >> 5
    if k >= len(summary):
        return -1
    y = summary[k] & (0xFFFFFFFF << (w & 31)) & 0xFFFFFFFF
    while not y:
        k += 1
        if k >= len(summary):
            return -1
        y = summary[k]
    w = (k << 5) + _tz(y)
    return (w << 5) + _tz(bits[w])


def _meld(a: int, b: int, child: np.ndarray, sib: np.ndarray) -> int:
    """Two pairing heaps (roots; -1 is empty) as one: the lower root on top."""
    if a < 0:
        return b
    if b < 0:
        return a
    if b < a:
        a, b = b, a
    sib[b] = child[a]
    child[a] = b
    return a


def _pop(root: np.ndarray, f: int, child: np.ndarray, sib: np.ndarray, scratch: np.ndarray) -> int:
    """Remove and return the lowest row of room ``f`` (two-pass pairing of its children)."""
    r = root[f]
    c = child[r]
    k = 0
    while c >= 0:
        a = c
        b = sib[a]
        sib[a] = -1
        if b < 0:
            scratch[k] = a
            k += 1
            break
        c = sib[b]
        sib[b] = -1
        scratch[k] = _meld(a, b, child, sib)
        k += 1
    h = -1
    while k > 0:
        k -= 1
        h = _meld(scratch[k], h, child, sib)
    root[f] = h
    return r


def _select(
    tok: np.ndarray,  # int64 (sources, converted): the windows' tokens
    have: np.ndarray,  # items converted per source
    w: np.ndarray,
    target: np.ndarray,
    placed: np.ndarray,  # float64, updated
    live: np.ndarray,  # the live sources in order, st[_NLIVE] of them
    scan: np.ndarray,
    skips: np.ndarray,
    out: np.ndarray,  # int64 (4, capacity): source, pending index, tokens, row
    root: np.ndarray,  # per room: the root of its used rows' heap (-1: none)
    child: np.ndarray,
    sib: np.ndarray,
    scratch: np.ndarray,
    bits: np.ndarray,  # rooms with used rows, 32 a word
    summary: np.ndarray,  # words of bits that are not zero, 32 a word
    st: np.ndarray,
    step: np.ndarray,  # float64 [step tokens]
) -> int:
    """``select_step``'s loop from the state in these arrays, until done or Python is needed."""
    rows, cap, lookahead = st[_ROWS], st[_CAP], st[_LOOK]
    nlive, n_out, fresh, hi = st[_NLIVE], st[_NOUT], st[_FRESH], st[_HI]
    step_tokens = step[0]
    code, best = _DONE, -1
    while nlive > 0:
        if fresh < rows:
            room = cap
        else:  # every row used: the highest room falls as items are placed
            while root[hi] < 0:
                hi -= 1
            room = hi
        if room <= 0:
            break
        if n_out == out.shape[1]:
            code = _FULL
            break
        best, best_deficit, at = -1, -np.inf, 0
        for j in range(nlive):
            s = live[j]
            d = target[s] + w[s] * step_tokens - placed[s]
            if d > best_deficit:
                best, best_deficit, at = s, d, j
        if best < 0:
            break
        i = scan[best]
        if i >= have[best]:
            code = _NEED
            break
        t = tok[best, i]
        while t > room and skips[best] < lookahead:
            skips[best] += 1
            i += 1
            if i >= have[best]:
                break
            t = tok[best, i]
        if i >= have[best]:  # resumes here: the same source is chosen again, at scan
            scan[best] = i
            code = _NEED
            break
        if t > room:
            for j in range(at, nlive - 1):
                live[j] = live[j + 1]
            nlive -= 1
            scan[best] = i
            continue
        f = _least_from(bits, summary, t)
        if f >= 0:  # a used row (a fresh row has more room, or the same and a higher index)
            r = _pop(root, f, child, sib, scratch)
            if root[f] < 0:
                bits[f >> 5] &= ~(1 << (f & 31))
                if bits[f >> 5] == 0:
                    summary[f >> 10] &= ~(1 << ((f >> 5) & 31))
        else:
            r = fresh
            fresh += 1
            f = cap
        left = f - t
        if root[left] < 0:
            bits[left >> 5] |= 1 << (left & 31)
            summary[left >> 10] |= 1 << ((left >> 5) & 31)
        child[r] = -1
        sib[r] = -1
        root[left] = _meld(root[left], r, child, sib)
        out[0, n_out] = best
        out[1, n_out] = i
        out[2, n_out] = t
        out[3, n_out] = r
        n_out += 1
        scan[best] = i + 1
        placed[best] += t
        step_tokens += t
    st[_NLIVE], st[_NOUT], st[_FRESH], st[_HI] = nlive, n_out, fresh, hi
    st[_S] = best if code == _NEED else -1
    st[_I] = scan[best] if code == _NEED else -1
    step[0] = step_tokens
    return code


# the compiled loop (None where numba does not import), compiled at the first call
kernel = compiled_once(_select, helpers=("_tz", "_least_from", "_meld", "_pop"))


def run(
    windows: Sequence[Any],
    weights: np.ndarray,
    target: np.ndarray,
    placed: np.ndarray,
    rows: int,
    capacity: int,
    lookahead: int,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """``select_step`` with its loop compiled: sources, pending indices, tokens, ref rows.

    ``target`` and ``placed`` (a MixState's) are updated in place. A window
    with a ``token_array()`` (its pending tokens as an int64 array, as the
    planner's cursors have) is copied whole; a window's ``tokens`` list is
    converted a chunk at a time (doubling). An item past those fetched is
    ``peek``-ed where ``select_step`` peeks it, and what the peek fetched is
    converted whole, from the ``tokens`` list. Tokens must not be negative.
    """
    select = kernel()
    if select is None:
        raise ImportError("numba does not import: pip install 'overlord-data[fast]'")
    n = len(windows)
    w = np.array(weights, dtype=np.float64)
    now = np.array(placed, dtype=np.float64)
    step = np.zeros(1)
    got: list[list[int]] = [[], [], [], []]
    live = np.flatnonzero(~(w <= 0.0)).astype(np.int64)  # NaN weights stay, as in select_step
    if len(live) and rows > 0 and capacity > 0:
        goal = np.array(target, dtype=np.float64)
        # a window that has its pending tokens as an array (the planner's cursors) is copied
        # from it whole; a list is converted a chunk at a time
        toks: list[Any] = [_tokens_of(win) for win in windows]
        have, tok = _first_tokens(toks, live.tolist())
        st = np.zeros(9, dtype=np.int64)
        st[[_ROWS, _CAP, _LOOK, _NLIVE, _HI]] = rows, capacity, lookahead, len(live), capacity
        scan, skips = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        out = np.empty((4, min(4 * rows + 1024, rows * capacity + 1)), dtype=np.int64)
        root = np.full(capacity + 1, -1, dtype=np.int64)
        child, sib = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
        scratch = np.empty(rows, dtype=np.int64)
        bits = np.zeros((capacity >> 5) + 1, dtype=np.int64)
        summary = np.zeros((len(bits) >> 5) + 1, dtype=np.int64)
        while True:
            code = select(
                *(tok, have, w, goal, now, live, scan, skips, out),
                *(root, child, sib, scratch, bits, summary, st, step),
            )
            if code == _DONE:
                break
            if code == _FULL:
                out = np.concatenate([out, np.empty_like(out)], axis=1)
                continue
            s, i = int(st[_S]), int(st[_I])
            if i >= len(toks[s]):  # where select_step peeks: what it fetched is converted
                windows[s].peek(i)
                # from the list, which holds it past the items converted (a window's array
                # would join every pending item again at each peek)
                toks[s] = windows[s].tokens
                more = len(toks[s])
            else:  # a list not converted whole yet: its next chunk (doubling)
                more = min(len(toks[s]), max(i + 1, 2 * int(have[s])))
            have, tok = _convert(toks[s], s, more, have, tok)
        got = [out[j, : st[_NOUT]].tolist() for j in range(4)]
    target += w * float(step[0])
    placed[:] = now
    return got[0], got[1], got[2], got[3]


def _first_tokens(toks: list[Any], live: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The live windows' tokens to start from: each array whole, a list's first chunk.

    One array for them all, one copy per window, and one check of the arrays' signs.
    """
    n = len(toks)
    upto = [
        len(toks[s]) if isinstance(toks[s], np.ndarray) else min(len(toks[s]), _FIRST_CHUNK)
        for s in live
    ]
    have = np.zeros(n, dtype=np.int64)
    tok = np.zeros((n, max(upto, default=0)), dtype=np.int64)
    arrays = False
    for s, k in zip(live, upto):
        if isinstance(toks[s], np.ndarray):
            tok[s, :k] = toks[s]
            have[s] = k
            arrays = True
        else:
            have, tok = _convert(toks[s], s, k, have, tok)
    if arrays and tok.size and tok.min() < 0:
        _negative(int(tok.min()))
    return have, tok


def _negative(least: int) -> None:
    raise ValueError(
        f"a window's item has {least} tokens: an item's tokens are a count "
        "(>= 0); the compiled selection relies on it (OVERLORD_SELECT=python does not)"
    )


def _tokens_of(window: Any) -> Any:
    """A window's pending tokens: an int64 array where it has one, else its list."""
    as_array = getattr(window, "token_array", None)
    return window.tokens if as_array is None else as_array()


def _convert(
    toks: list[int] | np.ndarray, s: int, upto: int, have: np.ndarray, tok: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Source ``s``'s tokens converted up to item ``upto`` (the array grown if needed)."""
    start = int(have[s])
    if upto > tok.shape[1]:
        grown = np.zeros((tok.shape[0], max(upto, 2 * tok.shape[1])), dtype=np.int64)
        grown[:, : tok.shape[1]] = tok
        tok = grown
    if upto > start:
        part = np.asarray(toks[start:upto], dtype=np.int64)
        if part.min() < 0:
            _negative(int(part.min()))
        tok[s, start:upto] = part
        have[s] = upto
    return have, tok
