"""Plain implementations of planner rules that overlord runs faster: tests compare the two.

- ``select_step_reference``: selection as it was, one method call per item
  for the window and for the best fit (``overlord.plan.select`` inlines both);
- ``rows_balanced_reference``: whole rows to ranks through a heap, row by row
  (``overlord.plan.balance._rows_balanced`` runs plain rounds with numpy).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from overlord.plan.select import MixState, Selection


def select_step_reference(
    windows: Sequence[Any],
    weights: np.ndarray,
    mix: MixState,
    rows: int,
    capacity: int,
    lookahead: int,
) -> Selection:
    """``select_step`` as it was before its loop was inlined for speed: the reference."""
    n = len(windows)
    w = [float(x) for x in weights]
    target = [float(x) for x in mix.target]
    placed = [float(x) for x in mix.placed]
    blocked = [wi <= 0.0 for wi in w]
    scan = [0] * n  # next pending index to look at, per source
    skips = [0] * n
    free = _FreeRows(rows, capacity)
    out = Selection([], [], [], [])
    step_tokens = 0.0
    while (room := free.most()) > 0:
        best, best_deficit = -1, -np.inf
        for s in range(n):
            if not blocked[s]:
                d = target[s] + w[s] * step_tokens - placed[s]
                if d > best_deficit:
                    best, best_deficit = s, d
        if best < 0:
            break
        win, i = windows[best], scan[best]
        t = win.peek(i)
        while t > room and skips[best] < lookahead:
            skips[best] += 1
            i += 1
            t = win.peek(i)
        if t > room:
            blocked[best] = True
            scan[best] = i
            continue
        out.source.append(best)
        out.pending_index.append(i)
        out.tokens.append(t)
        out.ref_row.append(free.fit(t))
        scan[best] = i + 1
        placed[best] += t
        step_tokens += t
    mix.target += np.asarray(w) * step_tokens
    mix.placed[:] = placed
    return out


class _FreeRows:
    """The free room of a step's rows, bucketed by room, for best fit.

    ``_rows[f]`` is a heap of the rows with exactly ``f`` tokens free and
    ``_rooms`` the sorted rooms that some row has: at most ``min(rows,
    capacity + 1)`` of them, so finding and updating the best fit moves far
    fewer entries than a sorted list of (room, row) over every row would.

    >>> free = _FreeRows(2, 10)
    >>> [free.fit(6), free.fit(5), free.fit(4), free.most()]
    [0, 1, 0, 5]
    """

    def __init__(self, rows: int, capacity: int):
        # rows never used yet are those from _fresh on: they leave in order, without a heap
        self._capacity, self._fresh, self._end = capacity, 0, rows
        self._rows: dict[int, list[int]] = {}
        self._rooms: list[int] = [capacity] if rows else []

    def most(self) -> int:
        """The largest room of any row (-1 with no rows)."""
        return self._rooms[-1] if self._rooms else -1

    def fit(self, t: int) -> int:
        """Put ``t`` tokens in the row with the least room that takes them; that row."""
        rooms = self._rooms
        k = bisect.bisect_left(rooms, t)
        f = rooms[k]
        here = self._rows.get(f)
        if here:  # rows used before come first: a fresh row has a higher index than any
            r = heapq.heappop(here)
            if not here:
                del self._rows[f]
        else:
            r = self._fresh
            self._fresh += 1
        if f not in self._rows and (f != self._capacity or self._fresh == self._end):
            del rooms[k]
        left = f - t
        there = self._rows.get(left)
        if there:
            heapq.heappush(there, r)
        else:
            self._rows[left] = [r]
            if left != self._capacity or self._fresh == self._end:
                bisect.insort(rooms, left)
        return r


def rows_balanced_reference(row_cost: np.ndarray, dp: int, rpr: int) -> np.ndarray:
    """Whole rows to ranks, ``rpr`` each, costliest first to the least loaded rank (a heap)."""
    order = np.lexsort((np.arange(len(row_cost)), -row_cost))
    target = np.empty(len(row_cost), dtype=np.int64)
    heap = [(0.0, r) for r in range(dp)]
    count = [0] * dp
    for j in order.tolist():
        load, r = heapq.heappop(heap)
        target[j] = r * rpr + count[r]
        count[r] += 1
        if count[r] < rpr:
            heapq.heappush(heap, (load + float(row_cost[j]), r))
    return target
