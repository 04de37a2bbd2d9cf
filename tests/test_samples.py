"""A batch's sample records as columns: made when read, handed to other processes unmade."""

from __future__ import annotations

import json
import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.batch import (
    Batch,
    Sample,
    SampleColumns,
    Samples,
    samples_of_wire,
    samples_wire,
)
from overlord.roles.constructor import _groups


def _columns(keys: list[str | None] | None = None) -> SampleColumns:
    return SampleColumns(
        ("web", "code"), ("w/a.jsonl", "c/b.parquet"),
        np.array([0, 1, 0, 1]), np.array([0, 1, 0, 1]), np.array([3, 0, 8, 5]),
        np.array([-1, -1, 2, 0]), np.array([10, 20, 30, 40]), np.array([0, 0, 1, 1]), keys,
    )  # fmt: skip


def _batch(samples: Samples | list[Sample]) -> Batch:
    z = np.zeros((1, 4), np.int32)
    return Batch(0, 0, z, z, z, z, np.zeros(2, np.int32), samples, 1.0)


def test_records_are_the_columns_item_by_item():
    assert _columns().records(0, 4) == [
        Sample("web", "w/a.jsonl:3", 10, 0),
        Sample("code", "c/b.parquet:0", 20, 0),
        Sample("web", "w/a.jsonl:8#2", 30, 1),
        Sample("code", "c/b.parquet:5#0", 40, 1),
    ]
    # a sample named by key (a tar's) is named by it, not by its row
    named = _columns(["k0", None, "k2", None]).records(0, 3)
    assert [s.id for s in named] == ["w/a.jsonl:k0", "c/b.parquet:0", "w/a.jsonl:k2#2"]


def test_a_part_sent_to_another_process_is_the_same_records_and_only_they():
    columns = _columns(["k0", "k1", "k2", "k3"])
    part = Samples(lambda: columns, columns.tokens).part(1, 3)
    names, array = samples_wire(_batch(part))
    assert array is not None and array.shape == (6, 2) and array.dtype == np.int64
    names = json.loads(json.dumps(names))  # another process: the names as JSON ...
    got = samples_of_wire(names, array.copy())  # ... and the array's bytes
    assert isinstance(got, Samples) and len(got) == 2 and got.tokens == 50
    assert got.records() == columns.records(1, 3)
    assert _batch(got).samples == columns.records(1, 3)


def test_records_already_made_go_as_records():
    records = _columns().records(0, 2)
    names, array = samples_wire(_batch(records))
    assert array is None
    assert samples_of_wire(names, None) == records


def test_a_pickle_holds_the_columns_and_reads_back_the_same_records():
    columns = _columns()
    made: list[int] = []

    def once() -> SampleColumns:
        made.append(1)
        return columns

    batch = _batch(Samples(once, columns.tokens).part(2, 4))
    assert made == []  # a batch holds its records unmade
    kept = pickle.loads(pickle.dumps(batch))
    assert type(kept.__dict__["_samples"]) is Samples
    assert kept.samples == columns.records(2, 4) == batch.samples


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 5)), max_size=40))
def test_groups_are_the_items_equal_values(items):
    cols = [np.array([t[k] for t in items], dtype=np.int64) for k in range(3)]
    group, firsts = _groups(*cols)
    assert len(firsts) == len(set(items))
    for i, t in enumerate(items):
        assert items[firsts[group[i]]] == t  # a group's item has the same values
    assert sorted(set(group.tolist())) == list(range(len(firsts)))
