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
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Window(Protocol):
    """A source's upcoming items, as the selector sees them."""

    @property
    def tokens(self) -> list[int]:
        """Tokens of the pending items fetched so far, in order (``peek`` fetches more)."""
        ...

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

    One Python pass over the step's items, so its body is written for speed:
    the best fit is inlined, and a source's tokens are read from its window's
    list, ``peek`` called only to fetch more.

    The best fit keeps the rows bucketed by free room: ``by_room[f]`` is a
    heap of the used rows with exactly ``f`` tokens free and ``rooms`` the
    sorted rooms that some row has, at most ``min(rows, capacity + 1)`` of
    them, so finding and updating the best fit moves far fewer entries than
    a sorted list of (room, row) over every row would. Rows never used yet
    are ``fresh..end``: they leave in order, without a heap, and come after
    every used row of the same room (a fresh row has a higher index).

    >>> from types import SimpleNamespace as W
    >>> a, b = W(tokens=[6, 4, 9], peek=None), W(tokens=[5, 3, 9], peek=None)
    >>> sel = select_step([a, b], np.array([0.5, 0.5]), MixState.zeros(2), 2, 10, 0)
    >>> sel.source, sel.tokens, sel.ref_row
    ([0, 1, 1, 0], [6, 5, 3, 4], [0, 1, 0, 1])
    """
    n = len(windows)
    w = [float(x) for x in weights]
    target = [float(x) for x in mix.target]
    placed = [float(x) for x in mix.placed]
    # the sources not blocked, in order (the first of equal deficits wins): (index, target,
    # weight), so that the deficit of each is computed as one expression
    live = [(s, target[s], w[s]) for s in range(n) if not w[s] <= 0.0]
    scan = [0] * n  # next pending index to look at, per source
    skips = [0] * n
    toks = [win.tokens for win in windows]
    out = Selection([], [], [], [])
    # bound methods, looked up once: this loop runs once per item of the step
    add_source, add_pending = out.source.append, out.pending_index.append
    add_tokens, add_row = out.tokens.append, out.ref_row.append
    bisect_left, insort, heappop, heappush = (
        bisect.bisect_left,
        bisect.insort,
        heapq.heappop,
        heapq.heappush,
    )
    fresh, end = 0, rows
    by_room: dict[int, list[int]] = {}
    rooms: list[int] = [capacity] if rows else []
    step_tokens = 0.0
    empty_items = False  # an item of no tokens was placed
    while live and rooms and (room := rooms[-1]) > 0:
        best, best_deficit = -1, -math.inf
        for s, goal, weight in live:
            d = goal + weight * step_tokens - placed[s]
            if d > best_deficit:
                best, best_deficit = s, d
        if best < 0:
            break
        i = scan[best]
        mine = toks[best]
        if i < len(mine):
            t = mine[i]
        else:
            t = _peek(windows[best], i, toks, best)
            mine = toks[best]
        while t > room and skips[best] < lookahead:
            skips[best] += 1
            i += 1
            t = mine[i] if i < len(mine) else _peek(windows[best], i, toks, best)
            mine = toks[best]
        if t > room:
            live = [x for x in live if x[0] != best]
            scan[best] = i
            continue
        if t == capacity and not empty_items:
            # a full-length item (most of them with short rows): the next fresh row, which
            # it fills (only an empty item leaves a used row with all its room)
            r = fresh
            fresh += 1
            if fresh == end:
                rooms.pop()  # capacity, the largest room
            full = by_room.get(0)
            if full:
                heappush(full, r)
            else:
                by_room[0] = [r]
                insort(rooms, 0)
        else:
            empty_items = empty_items or t == 0
            # best fit: the least room that takes t; used rows (a heap per room) before fresh
            k = bisect_left(rooms, t)
            f = rooms[k]
            here = by_room.get(f)
            if here:
                r = heappop(here)
                if not here:  # no row has room f left, unless fresh rows do
                    del by_room[f]
                    if f != capacity or fresh == end:
                        del rooms[k]
            else:
                r = fresh
                fresh += 1
                if f != capacity or fresh == end:
                    del rooms[k]
            left = f - t
            there = by_room.get(left)
            if there:
                heappush(there, r)
            else:
                by_room[left] = [r]
                if left != capacity or fresh == end:
                    insort(rooms, left)
        add_source(best)
        add_pending(i)
        add_tokens(t)
        add_row(r)
        scan[best] = i + 1
        placed[best] += t
        step_tokens += t
    mix.target += np.asarray(w) * step_tokens
    mix.placed[:] = placed
    return out


def select_step_fast(
    windows: Sequence[Window],
    weights: np.ndarray,
    mix: MixState,
    rows: int,
    capacity: int,
    lookahead: int,
) -> Selection:
    """:func:`select_step` with its loop compiled (:mod:`overlord.plan.select_fast`; numba).

    The same Selection and ``mix`` update, bit for bit, and the same peeks.

    >>> from types import SimpleNamespace as W
    >>> a, b = W(tokens=[6, 4, 9], peek=None), W(tokens=[5, 3, 9], peek=None)
    >>> sel = select_step_fast([a, b], np.array([0.5, 0.5]), MixState.zeros(2), 2, 10, 0)
    >>> sel.source, sel.tokens, sel.ref_row
    ([0, 1, 1, 0], [6, 5, 3, 4], [0, 1, 0, 1])
    """
    from overlord.plan import select_fast

    got = select_fast.run(windows, weights, mix.target, mix.placed, rows, capacity, lookahead)
    return Selection(*got)


def select_items(
    windows: Sequence[Window],
    weights: np.ndarray,
    mix: MixState,
    rows: int,
    capacity: int,
    lookahead: int,
    how: str | None = None,
) -> Selection:
    """:func:`select_step` as the planner runs it: compiled where numba imports.

    ``how`` (by default the environment variable ``OVERLORD_SELECT``, read at
    each call; the planner reads it once, when it starts: :func:`select_how`)
    chooses: ``auto`` (:func:`select_step_fast` where numba imports, else
    :func:`select_step`), ``python`` or ``numba`` (an error without numba).
    Both give the same Selection.
    """
    how = select_how() if how is None else how
    if how != "python":
        from overlord.plan import select_fast

        if select_fast.kernel() is not None:
            return select_step_fast(windows, weights, mix, rows, capacity, lookahead)
        if how == "numba":
            raise ImportError(
                "OVERLORD_SELECT=numba but numba does not import: "
                "pip install 'overlord-data[fast]', or unset OVERLORD_SELECT to use the Python loop"
            )
    return select_step(windows, weights, mix, rows, capacity, lookahead)


def select_how() -> str:
    """How :func:`select_items` selects, from ``OVERLORD_SELECT`` (unset: ``auto``), checked."""
    how = os.environ.get("OVERLORD_SELECT") or "auto"
    if how not in ("auto", "python", "numba"):
        raise ValueError(
            f"OVERLORD_SELECT is {how!r}; expected 'auto', 'python' or 'numba' (how the "
            "planner selects a step's items: compiled with numba, or its Python loop)"
        )
    return how


def _peek(window: Window, i: int, toks: list[list[int]], s: int) -> int:
    """Fetch window ``s``'s item ``i`` (and more); its tokens list, refreshed in ``toks``."""
    t = window.peek(i)
    toks[s] = window.tokens
    return t
