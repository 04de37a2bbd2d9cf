"""The read-ahead rule (ReadAhead), pure: when a piece may start, when a window may be read.

No thread and no sleep: the rule is a function of plain numbers, and the
window being cut (a :class:`~overlord.roles.read_ahead.Cutting`) gives the
bytes it has left.
"""

from __future__ import annotations

import numpy as np

from overlord.roles.read_ahead import RAMP, Cutting, ReadAhead
from overlord.sources.window import Window


def window_of(sizes: list[int]) -> Window:
    """A window of one record per piece, of ``sizes`` bytes each (no arrays: only its bytes)."""
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    cut = [(k, k + 1) for k in range(len(sizes))]
    return Window(0, 0, 0, 0, np.arange(len(sizes)), offsets, cut, [None] * len(cut))


def reads_next(rule: ReadAhead, cutting: Cutting | None, waiting: int, primary: bool) -> bool:
    return rule.may_read_window(
        waiting=waiting,
        left_bytes=0 if cutting is None else cutting.left_bytes(),
        window_bytes=0 if cutting is None else int(cutting.window.offsets[-1]),
        primary=primary,
    )


def started(cutting: Cutting) -> list[bool]:
    """Whether the rule lets the next window be read, after each piece of ``cutting`` starts."""
    rule = ReadAhead(budget=1000, threads=4)
    out = [reads_next(rule, cutting, 0, primary=True)]
    while cutting.left:
        cutting.left.pop(0)
        out.append(reads_next(rule, cutting, 0, primary=True))
    return out


def test_the_next_window_is_read_once_half_the_one_being_cut_has_started() -> None:
    """Until then a loader holds one window (the one being cut); then one more, never three."""
    window = window_of([10, 20, 30, 40])  # 100 bytes: the last half starts with the 4th piece
    rule = ReadAhead(budget=1000, threads=4)
    assert reads_next(rule, None, 0, primary=True)  # nothing being cut: read
    assert not reads_next(rule, None, 1, primary=True)  # one read ahead already: never two
    cutting = Cutting(window, list(window.cut))
    assert cutting.left_bytes() == 100
    assert started(Cutting(window, list(window.cut))) == [False, False, False, True, True]
    # with half of it left exactly, the next one is read; with one byte more, not
    assert rule.may_read_window(waiting=0, left_bytes=50, window_bytes=100, primary=True)
    assert not rule.may_read_window(waiting=0, left_bytes=51, window_bytes=100, primary=True)
    cutting.left = cutting.left[3:]
    assert reads_next(rule, cutting, 0, primary=True)
    assert not reads_next(rule, cutting, 1, primary=True)  # a window waits to be cut


def test_a_shadow_reads_its_next_window_once_all_of_the_one_being_cut_has_started() -> None:
    """A standby serves nothing: it holds about half a window, not one (until promoted)."""
    window = window_of([10, 20, 30, 40])
    rule = ReadAhead(budget=1000, threads=4)
    cutting = Cutting(window, list(window.cut))
    shadow = []
    while True:
        shadow.append(reads_next(rule, cutting, 0, primary=False))
        if not cutting.left:
            break
        cutting.left.pop(0)
    assert shadow == [False, False, False, False, True]
    cutting = Cutting(window, window.cut[3:])  # its last piece not started
    assert not reads_next(rule, cutting, 0, primary=False)
    assert reads_next(rule, cutting, 0, primary=True)  # promoted, it reads ahead as a primary


def test_a_new_loader_reads_ahead_a_32nd_of_its_budget_or_twice_what_the_planner_took() -> None:
    rule = ReadAhead(budget=32_000, threads=2)
    assert rule.allowance(served=0) == 32_000 // RAMP == 1000
    assert rule.allowance(served=600) == 1200
    assert rule.allowance(served=20_000) == 32_000  # never past the budget
    at = {"in_flight": 0, "asked": 0, "pieces": 0}
    assert rule.may_start(held=900, estimate=100, served=0, **at)
    assert rule.holds_back(held=901, estimate=100, served=0, **at) == "budget"
    assert rule.may_start(held=901, estimate=100, served=600, **at)


def test_pieces_in_flight_count_against_the_budget() -> None:
    rule = ReadAhead(budget=32_000, threads=4)
    assert rule.may_start(held=400, in_flight=500, estimate=100, served=0, asked=0, pieces=1)
    assert not rule.may_start(held=400, in_flight=501, estimate=100, served=0, asked=0, pieces=1)


def test_a_caller_waiting_for_an_item_lets_one_piece_at_a_time_past_the_budget() -> None:
    """Else the planner could wait forever on a loader full of items it holds."""
    rule = ReadAhead(budget=1000, threads=4)
    full = {"held": 1000, "estimate": 50, "served": 10_000}
    assert rule.holds_back(in_flight=0, asked=0, pieces=0, **full) == "budget"
    assert rule.may_start(in_flight=0, asked=1, pieces=0, **full)
    # one at a time: not while a piece is being tokenized
    assert rule.holds_back(in_flight=50, asked=1, pieces=1, **full) == "budget"


def test_a_loader_that_holds_nothing_starts_a_piece_larger_than_its_budget() -> None:
    rule = ReadAhead(budget=1000, threads=1)
    assert rule.may_start(held=0, in_flight=0, estimate=10_000, served=0, asked=0, pieces=0)
    assert not rule.may_start(held=1, in_flight=0, estimate=10_000, served=0, asked=0, pieces=0)


def test_no_more_pieces_than_threads_are_tokenized_at_once() -> None:
    """The threads come first: a loader at its threads does not wait on its budget."""
    rule = ReadAhead(budget=10**9, threads=2)
    assert rule.may_start(held=0, in_flight=2, estimate=1, served=0, asked=1, pieces=1)
    assert rule.holds_back(held=0, in_flight=2, estimate=1, served=0, asked=1, pieces=2) == (
        "threads"
    )
    assert rule.holds_back(held=10**9, in_flight=2, estimate=1, served=0, asked=0, pieces=2) == (
        "threads"
    )


def test_the_window_being_cut_has_left_the_bytes_of_its_pieces_not_started() -> None:
    window = window_of([10, 20, 30, 40])
    assert Cutting(window, window.cut[1:]).left_bytes() == 90
    assert Cutting(window, window.cut[3:]).left_bytes() == 40
    assert Cutting(window, []).left_bytes() == 0
