"""Who reads which shard (overlord.plan.partition): pure, numbers in and out."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlord.plan.partition import FEW_ITEMS, Partition, by_slot, owner, partitions
from overlord.sources.catalog import File, SourceFiles


def test_a_partition_records_as_json_and_back() -> None:
    for part in (Partition(1, 3, (0, 5), None), Partition(0, 2, (1, 0), (2, 4))):
        assert Partition.of(json.loads(json.dumps(part.record()))) == part


def test_a_re_partition_adds_a_partition_of_new_slots_at_its_boundary() -> None:
    old = [Partition(k, 2, (0, 0), (0, 4)) for k in range(2)]
    new = [Partition(k, 3, (0, 4), None) for k in range(3)]
    assert partitions(old + new) == [((0, 0), 0, 2), ((0, 4), 2, 3)]


@given(
    n=st.integers(1, 6),
    m=st.integers(1, 6),
    boundary=st.tuples(st.integers(0, 2), st.integers(0, 9)),
    at=st.tuples(st.integers(0, 3), st.integers(0, 12)),
)
def test_a_shard_belongs_to_loader_pos_mod_n_of_its_partition(
    n: int, m: int, boundary: tuple[int, int], at: tuple[int, int]
) -> None:
    spans = [((0, 0), 0, n), (boundary, n, m)]
    if at >= boundary:
        assert owner(at, spans) == n + at[1] % m
    else:
        assert owner(at, spans) == at[1] % n
    assert 0 <= owner(at, spans) < n + m


def test_a_shard_before_the_first_partition_has_no_owner() -> None:
    with pytest.raises(ValueError, match=r"starts at \(0, 4\)"):
        owner((0, 2), [((0, 4), 0, 2)])


def test_the_loaders_of_a_partition_own_every_shard_once() -> None:
    """What each loader reads (SourceFiles.owned, from the rule) covers the source exactly."""
    files = SourceFiles(
        "web",
        [
            (0, tuple(File(f"{i}.jsonl", f"/d/{i}.jsonl", 1) for i in range(7))),
            (2, tuple(File(f"{i}.jsonl", f"/d/{i}.jsonl", 1) for i in range(9))),
        ],
    )
    count, start = 3, (0, 2)
    owned = {}
    for index in range(count):
        got = files.owned(start, index, count)
        owned[index] = [next(got) for _ in range(8)]
        assert all(owner(at, [((0, 0), 0, count)]) == index for at in owned[index])
    shards = sorted(at for ats in owned.values() for at in ats)
    assert len(set(shards)) == len(shards)
    epoch0 = [at for at in shards if at[0] == 0]
    assert epoch0 == [(0, p) for p in range(2, 7)]  # from the start on, each once


def test_items_group_by_slot_in_slot_order() -> None:
    source, loader = np.array([1, 0, 1, 0, 1]), np.array([2, 0, 0, 0, 2])
    got = [(s, k, i.tolist()) for s, k, i in by_slot(source, loader)]
    assert got == [(0, 0, [1, 3]), (1, 0, [2]), (1, 2, [0, 4])]
    assert by_slot(np.zeros(0, np.int64), np.zeros(0, np.int64)) == []


def test_many_items_group_as_a_few_do() -> None:
    # past FEW_ITEMS the grouping runs on arrays: the same slots, the same order
    rng = np.random.default_rng(3)
    source, loader = rng.integers(0, 4, 200), rng.integers(0, 3, 200)
    got = [(s, k, i.tolist()) for s, k, i in by_slot(source, loader)]
    want: dict[tuple[int, int], list[int]] = {}
    for i, slot in enumerate(zip(source.tolist(), loader.tolist())):
        want.setdefault(slot, []).append(i)
    assert got == [(s, k, i) for (s, k), i in sorted(want.items())]
    assert len(source) > FEW_ITEMS
