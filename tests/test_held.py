"""``overlord.roles.held``: what a loader holds, taken and released by arrays. Pure."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.roles.held import (
    FEW,
    HeldItems,
    Located,
    _runs,
    by_shard,
    payload,
    payload_of,
    payload_of_runs,
)
from overlord.sources.shard import ShardItems


def _items(lengths: list[int]) -> ShardItems:
    n = len(lengths)
    length = np.array(lengths, dtype=np.int32)
    start = np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
    zeros = np.zeros(n, dtype=np.int32)
    return ShardItems(0, 0, 0, np.arange(int(length.sum()), dtype=np.int32), start, length,
                      np.arange(n, dtype=np.int64), zeros - 1, zeros)  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    gap=st.integers(0, 3),
    rounds=st.lists(st.lists(st.integers(-2, 40), max_size=40), max_size=4),
    read_before=st.one_of(st.none(), st.integers(0, 40)),
)
def test_release_and_pick_match_an_item_by_item_model(sizes, gap, rounds, read_before):
    # pieces of a shard with gaps between them (items a rewind skipped), released in rounds
    # with repeats, items before the first piece, past the last one and not read yet
    held = HeldItems({})
    at = (0, 3)
    held.open_shard(at)
    model: dict[int, int] = {}  # held item -> its tokens
    base = 1
    for size in sizes:
        lengths = [(base + k) % 5 + 1 for k in range(size)]
        held.add(at, base, _items(lengths), np.ones(size, dtype=bool))
        model.update({base + k: n for k, n in enumerate(lengths)})
        base += size + gap
    ahead: list[int] = []
    for index in rounds:
        held.release(at, index, read_before)
        for i in index:
            if read_before is not None and i >= read_before:
                ahead.append(i)
            else:
                model.pop(i, None)
        assert held.tokens == sum(model.values())
        # a few items (one by one) and many (by arrays) give the same answers
        for probe in (np.arange(-2, 41), np.arange(-2, 41, 7), np.array(index[:FEW])):
            pieces, piece = held.pick(at, probe)
            for i, q in zip(probe.tolist(), piece.tolist()):
                assert (q >= 0) == (i in model), i
                if q >= 0:
                    assert pieces[q].base <= i < pieces[q].base + len(pieces[q].items)
    assert sorted(set(held._released_ahead.get(at, []))) == sorted(set(ahead))
    # a piece goes once every item of it was released; its count of items left is kept
    assert all(p.remaining.any() for p in held.shards.get(at, []))
    assert all(p.left == p.remaining.sum() for p in held.shards.get(at, []))


def test_pick_of_a_shard_not_held():
    pieces, piece = HeldItems({}).pick((0, 0), np.array([0, 1]))
    assert pieces == [] and piece.tolist() == [-1, -1]


def test_by_shard_groups_rows_in_source_order():
    keys = np.array([[1, 0, 4], [0, 7, 1], [1, 0, 2], [0, 7, 0], [0, 2, 9]])
    got = [(at, rows.tolist()) for at, rows in by_shard(keys)]
    assert got == [((0, 2), [4]), ((0, 7), [1, 3]), ((1, 0), [0, 2])]
    many = np.repeat(keys, FEW, axis=0)  # grouped by arrays past FEW keys: the same groups
    got = [(at, (rows // FEW).tolist()) for at, rows in by_shard(many)]
    assert got == [(at, [r for r in rows for _ in range(FEW)]) for at, rows in
                   [((0, 2), [4]), ((0, 7), [1, 3]), ((1, 0), [0, 2])]]  # fmt: skip
    assert by_shard(np.zeros((0, 3), dtype=np.int64)) == []


@settings(max_examples=100, deadline=None)
@given(
    picks=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), max_size=20),
    gappy=st.booleans(),
)
def test_payload_by_runs_is_each_item_in_order(picks, gappy):
    # two pieces; in a gappy one an item's tokens do not follow the one before it
    pieces = [_items([3, 1, 4, 1, 5, 2]), _items([2, 7, 1, 8, 2, 8])]
    if gappy:
        pieces[1].start = pieces[1].start[::-1].copy()  # items laid out in reverse
    picked = [(pieces[p], k) for p, k in picks]
    got = payload(picked)
    want = [pieces[p].tokens[pieces[p].start[k] : pieces[p].start[k] + pieces[p].length[k]]
            for p, k in picks]  # fmt: skip
    assert got["lengths"].tolist() == [len(w) for w in want]
    assert got["tokens"].dtype == np.int32
    assert got["tokens"].tolist() == [t for w in want for t in w.tolist()]
    assert got["lengths"].dtype == np.int32 and len(got["lengths"]) == len(picks)


def test_an_answer_cannot_write_into_the_items_it_holds():
    piece = _items([3, 4, 2])
    held = piece.tokens.copy()
    for runs in ([(piece, 1, 2)], [(piece, 0, 3)], [(piece, 0, 1), (piece, 2, 3)]):
        got = payload_of_runs(runs)
        with contextlib.suppress(ValueError):  # a copy may be written; a piece's tokens not
            got["tokens"][:] = -1
        assert piece.tokens.tolist() == held.tolist()


@settings(max_examples=60, deadline=None)
@given(
    released=st.sets(st.integers(0, 29), max_size=10),
    asked=st.lists(st.integers(0, 29), min_size=1, max_size=40),
)
def test_take_few_or_many_finds_each_item_or_names_one_not_held(released, asked):
    held = HeldItems({})
    at = (1, 4)
    held.open_shard(at)
    for base in (0, 10, 20):  # three pieces of ten items
        held.add(at, base, _items([k % 3 + 1 for k in range(10)]), np.ones(10, dtype=bool))
    held.release(at, sorted(released))
    keys = np.array([[1, 4, i] for i in asked], dtype=np.int64)
    picked, missing = held.take(keys)
    if set(asked) & released:
        assert missing is not None and missing[:2] == at and missing[2] in released
        return
    assert missing is None
    assert [(items.length[k], k) for items, k in picked] == [
        (i % 10 % 3 + 1, i % 10) for i in asked
    ]


@settings(max_examples=80, deadline=None)
@given(
    released=st.sets(st.integers(0, 59), max_size=3),
    asked=st.lists(st.integers(0, 59), min_size=1, max_size=60),
    start=st.integers(0, 59),
    sorted_run=st.booleans(),
    other_shard=st.booleans(),
)
def test_take_runs_are_the_runs_of_take(released, asked, start, sorted_run, other_shard):
    """The items' runs, found by arrays for many keys of a shard, are those of ``take``."""
    held = HeldItems({})
    shards = [(1, 4), (1, 5)]
    for at in shards:
        held.open_shard(at)
        for base in (0, 10, 20, 30, 40, 50):  # six pieces of ten items
            held.add(at, base, _items([k % 3 + 1 for k in range(10)]), np.ones(10, dtype=bool))
        held.release(at, sorted(released))
    # a step's items are mostly in order: a run from ``start``, then those asked
    index = [*range(start, 60), *(sorted(set(asked)) if sorted_run else asked)]
    keys = np.array([[1, 4, i] for i in index], dtype=np.int64)
    if other_shard:
        keys[-1, 1] = 5
    runs, missing = held.take_runs(keys)
    picked, want_missing = held.take(keys)
    assert (missing is None) == (want_missing is None)
    if missing is not None:
        assert missing[:2] in shards and missing[2] in released
        return
    assert [(id(items), lo, hi) for items, lo, hi in runs] == [
        (id(items), lo, hi) for items, lo, hi in _runs(picked)
    ]
    want = payload(picked)
    assert payload_of_runs(runs)["tokens"].tolist() == want["tokens"].tolist()
    # found by arrays (many keys of a shard), the answer is built by pieces: the same
    taken, _ = held.locate(keys)
    assert isinstance(taken, Located) == (len(keys) > FEW and not other_shard)
    got = payload_of(taken)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tolist() == want[k].tolist(), k
