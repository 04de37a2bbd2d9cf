"""Which items form a step: token-share mixing into a step's rows.

This decides the *global* batch of a step and knows nothing of DP ranks, so
the samples of a step are the same at any DP size (invariant 1). Balancing
(:mod:`overlord.plan.balance`) later moves them between rows and ranks, never
between steps (invariant 2).

Mixing is by deficit: every placed token raises each source's target by its
weight, and the next item comes from the source furthest below its target.
The cumulative error of every source is so bounded by about one item, however
the weights move. An item that fits in no row stays in its source's window
for a later step; a source may skip at most ``lookahead`` such items per step
before it counts as blocked. The step closes when its rows are full or every
source with weight is blocked.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Window(Protocol):
    """A source's upcoming items, as the selector sees them."""

    def peek(self, i: int) -> int:
        """Tokens of the ``i``-th pending (not yet placed) item, fetching more if needed."""
        ...


@dataclass
class MixState:
    """Cumulative tokens per source: what the schedule asked for and what was placed."""

    target: np.ndarray  # float64, per source in plan order
    placed: np.ndarray  # float64

    @classmethod
    def zeros(cls, n: int) -> MixState:
        """A fresh state for ``n`` sources."""
        return cls(np.zeros(n), np.zeros(n))


@dataclass
class Selection:
    """A step's items in the order they were chosen."""

    source: list[int]  # source index of each item
    pending_index: list[int]  # its index among its window's pending items at selection time
    tokens: list[int]
    ref_row: list[int]  # row in the DP-independent reference packing


def select_step(
    windows: Sequence[Window],
    weights: np.ndarray,
    mix: MixState,
    rows: int,
    capacity: int,
    lookahead: int,
) -> Selection:
    """Choose the items of one step and update ``mix`` in place.

    Each item goes to the row with the least free room that takes it (best
    fit; the lowest row among equals).
    """
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
