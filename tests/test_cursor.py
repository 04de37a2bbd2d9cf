"""SourceCursor: a source's items back in source order, and its state (first pending, skips)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.roundtrip import Part, check_save_restore

from conftest import make_corpus
from overlord import load_plan
from overlord.plan.select import MixState
from overlord.plan.step import taken_columns
from overlord.roles.cursor import SourceCursor, cursor_state
from overlord.roles.ledger import Ledger
from overlord.roles.source_loader import SourceLoader
from overlord.sources.catalog import job_files


@pytest.mark.integration
def test_a_source_cursor_resumes_from_its_state(tmp_path):
    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {f"data/web/p{i}.jsonl": 5 + i for i in range(3)}}},
            batch={"tokens_per_step": 128, "max_seq_len": 64, "lookahead": 4},
        )
    )
    files = job_files([("web", ["data/web/*"])], str(plan.base_dir))["web"]

    def make(state: dict[str, Any] | None) -> tuple[SourceCursor, SourceLoader]:
        start = None if state is None else state["cursor"]
        loader = SourceLoader(plan, files, "web", 0, 1, start)
        cursor = SourceCursor(
            "web",
            lambda epoch: len(files.at(epoch)),
            lambda k: loader.metadata(5.0),
            lambda: [((0, 0), 0, 1)],
            start,
        )
        return cursor, loader

    def advance(part: tuple[SourceCursor, SourceLoader]) -> list[Any]:
        cursor, _ = part
        cursor.peek(2)
        got = taken_columns(cursor.take([0, 2]))  # item 1 stays pending: a skip run
        return [got["key"].tolist(), got["tokens"].tolist()]

    outputs = check_save_restore(
        Part(make, advance, lambda p: {"cursor": p[0].state()}, lambda p: p[1].close()), 12
    )
    assert {k[0] for keys, _ in outputs for k in keys} == {0, 1}  # it crossed an epoch


def _one_shard_cursor(n: int) -> SourceCursor:
    """A cursor over one shard of ``n`` items (item ``i`` has ``i + 1`` tokens), in one block."""
    block = {
        "epoch": 0, "shard_pos": 0, "file_index": 0, "last": True, "stop": n,
        "index": np.arange(n, dtype=np.int64), "tokens": np.arange(1, n + 1, dtype=np.int64),
        "row": np.arange(n, dtype=np.int64), "chunk": np.full(n, -1, dtype=np.int64),
        "patches": np.zeros(n, dtype=np.int64),
    }  # fmt: skip
    return SourceCursor("s", lambda e: 1, lambda k: [block], lambda: [((0, 0), 0, 1)])


@settings(max_examples=60, deadline=None)
@given(
    takes=st.lists(st.sets(st.integers(0, 30), max_size=24), max_size=5),
    prefix=st.booleans(),
    backwards=st.booleans(),
)
def test_takes_of_the_first_items_or_any_match_a_list_model(takes, prefix, backwards):
    # the first pending items (the usual take) and any others, a few or many, in any order,
    # leave the same pending items and the same checkpoint as a list of the items, with the
    # placed ones ahead as skip runs
    cursor = _one_shard_cursor(130)  # more than the takes can take: some stay pending
    cursor.peek(129)
    pending, placed = list(range(130)), set()
    for asked in takes:
        chosen = {j for j in asked if j < len(pending)}  # the pending items there are
        idx = list(range(len(chosen))) if prefix else sorted(chosen, reverse=backwards)
        out = taken_columns(cursor.take(np.array(idx, dtype=np.int64)))
        items = [pending[j] for j in idx]
        assert out["key"][:, 2].tolist() == items and out["tokens"].tolist() == [
            i + 1 for i in items
        ]
        pending = [p for j, p in enumerate(pending) if j not in set(idx)]
        placed |= set(items)
        assert cursor.tokens == [p + 1 for p in pending]
        state = cursor.state()
        assert state["index"] == pending[0]
        ahead = sorted(i for i in placed if i > pending[0])
        assert [i for _, _, s, c in state["skip"] for i in range(s, s + c)] == ahead


def test_a_cursor_from_a_state_keeps_its_skip_runs_while_nothing_is_pending():
    # a state at item 2 of a shard whose items 5 and 6 were placed ahead: the loaders send the
    # shard again without them. A take of every item received so far leaves nothing pending,
    # and the checkpoint must still hold the skip run (else a resume delivers 5 and 6 again)
    start = {"epoch": 0, "shard_pos": 0, "index": 2, "skip": [[0, 0, 5, 2]]}
    first = {
        "epoch": 0, "shard_pos": 0, "file_index": 0, "last": False, "stop": 5,
        "index": np.arange(2, 5, dtype=np.int64), "tokens": np.full(3, 4, dtype=np.int64),
        "row": np.arange(2, 5, dtype=np.int64), "chunk": np.full(3, -1, dtype=np.int64),
        "patches": np.zeros(3, dtype=np.int64),
    }  # fmt: skip
    cursor = SourceCursor("s", lambda e: 1, lambda k: [first], lambda: [((0, 0), 0, 1)], start)
    cursor.peek(2)
    cursor.take(np.arange(3))  # items 2, 3 and 4: nothing pending, item 7 not received yet
    assert cursor.state() == {"epoch": 0, "shard_pos": 0, "index": 5, "skip": [[0, 0, 5, 2]]}


@settings(max_examples=40, deadline=None)
@given(takes=st.lists(st.sets(st.integers(0, 7), max_size=5), max_size=6), prefix=st.booleans())
def test_a_mark_builds_the_state_the_cursor_had_when_it_was_marked(takes, prefix):
    # the planner keeps marks and builds states only when asked: a mark must not move on
    # with the cursor (its placed-ahead keys are extended in place by later takes)
    cursor = _one_shard_cursor(40)
    cursor.peek(39)
    kept = []
    for chosen in takes:
        kept.append((cursor.mark(), cursor.state()))
        idx = list(range(len(chosen))) if prefix else sorted(chosen)
        cursor.take(np.array(idx, dtype=np.int64))
    kept.append((cursor.mark(), cursor.state()))
    assert [cursor_state(mark) for mark, _ in kept] == [state for _, state in kept]


def test_the_ledger_builds_a_kept_mark_into_the_state_of_its_step(job_plan):
    plan = load_plan(job_plan)
    ledger = Ledger(plan, {n: {"files": n} for n in plan.source_names})
    cursors = [_one_shard_cursor(40) for _ in plan.source_names]
    mix = MixState.zeros(len(cursors))
    for c in cursors:
        c.peek(39)
    want = {}
    for step in range(1, 4):
        want[step] = ledger.mark(step, cursors, mix, {"cost": {"refits": step}}).state()
        ledger.keep(step, ledger.mark(step, cursors, mix, {"cost": {"refits": step}}))
        for c in cursors:  # the next step moves the cursors and the mixture on
            c.take(np.array([0, 2], dtype=np.int64))
        mix.target += 1.5
        mix.placed[:] = mix.target * 0.75
    assert ledger.kept(2) == want[2]
    assert ledger.at(1) == want[1] and ledger.at(1) is ledger.at(1)  # built once
    assert ledger.state_dict(3)["sources"] == want[3]["sources"]
    assert want[3]["sources"][plan.source_names[0]]["cursor"]["skip"]  # a skip run was kept
    # a quarantine added later reaches the built states and the marks not built yet alike
    ledger.keep(4, ledger.mark(4, cursors, mix))
    ledger.quarantine([{"ids": ["a:1"]}])
    assert ledger.at(1)["quarantine"] == ledger.at(4)["quarantine"] == [{"ids": ["a:1"]}]
    assert "quarantine" not in ledger.mark(4, cursors, mix).state()
