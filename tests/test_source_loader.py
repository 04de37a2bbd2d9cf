"""SourceLoader: its read-ahead budget, the lift a waiting caller gives it, what it measures."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus, on_threads
from overlord import Loader, LoaderError, load_plan
from overlord.roles.source_loader import SourceLoader, _last
from overlord.sources.catalog import job_files

pytestmark = pytest.mark.integration

HANG_GUARD_S = 20.0  # only a hang takes this long


def lone_loader(tmp_path: Path, count: int, docs: int = 6) -> SourceLoader:
    """Loader 0 of ``count`` of a source of 16 shards whose budget share is under one shard."""
    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {f"data/web/part-{i:02d}.jsonl": docs for i in range(16)}}},
            batch={"tokens_per_step": 128, "max_seq_len": 64, "prefetch_steps": 1, "lookahead": 1},
        )
    )
    files = job_files([("web", ["data/web/*"])], str(plan.base_dir))
    return SourceLoader(plan, files["web"], "web", 0, count)


def held_back(loader: SourceLoader) -> dict[str, Any]:
    """The loader's stats once its reader holds a shard back on its whole budget.

    A new loader reads ahead 1/32 of its budget, or twice what the planner
    took: the calls here take what it reads until that reaches its budget.
    """
    while loader.stats()["tokens"] * 2 < loader.stats()["budget_tokens"]:
        loader.metadata(HANG_GUARD_S)
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        s = loader.stats()
        if s["waits_on"] == "budget":
            return s
        assert time.monotonic() < deadline, f"the reader never reached its budget: {s}"
        with loader.reader.lock:  # wake when it publishes or starts waiting (no fixed sleep)
            loader.reader.lock.wait(0.05)


def test_loaders_of_a_source_share_its_read_ahead(tmp_path):
    """Each of 4 loaders holds a quarter of the source's read-ahead, then it waits."""
    shares = {}
    for count in (1, 4):
        loader = lone_loader(tmp_path / str(count), count, docs=3)
        try:
            s = held_back(loader)
            shares[count] = s
            # within its share, but for the pieces the metadata calls waited for (each
            # lets one piece past a full budget, or the planner could wait forever)
            assert s["held_tokens"] <= s["budget_tokens"] or s["held_pieces"] <= 3
            assert s["reads_in_flight"] == 0
        finally:
            loader.close()
    # 3 documents of some 28 tokens (one piece) are past a quarter share
    assert shares[4]["held_pieces"] <= 3
    assert shares[1]["held_pieces"] > shares[4]["held_pieces"]
    assert shares[1]["budget_tokens"] >= 4 * shares[4]["budget_tokens"] - 3


def test_a_caller_waiting_for_the_next_shard_lifts_the_budget(tmp_path):
    """Nothing is released, yet every shard comes: waiting for one lets the reader publish it.

    Without the lift the second ``metadata`` call would wait out its timeout: the
    loader's share is full of items the planner received and holds.
    """
    loader = lone_loader(tmp_path, 2)
    try:
        got: list[tuple[int, int]] = []
        while len(got) < 8:  # loader 0 of 2 owns 8 of the 16 shards
            got += [(b["epoch"], b["shard_pos"]) for b in loader.metadata(5.0) if b["last"]]
        assert got == [(0, p) for p in range(0, 16, 2)]
        assert loader.stats()["held_tokens"] > 4 * loader.stats()["budget_tokens"]
    finally:
        loader.close()
    fresh = lone_loader(tmp_path / "b", 2)
    try:  # a constructor's take waits for an unread shard the same way
        out = fresh.take(np.array([[1, 4, 0]]))  # epoch 1: a whole epoch past its share
        assert len(out["lengths"]) == 1 and out["lengths"][0] > 0
    finally:
        fresh.close()


def test_a_release_wakes_a_reader_held_by_its_budget_once_its_next_piece_fits(
    tmp_path, monkeypatch
):
    """Releases one document at a time: the reader stays held until its next piece fits, then
    the release that made the room wakes it.

    Nothing else happens meanwhile (no metadata call, no caller waiting) and the reader's
    threads do not look again on their own within the test, so only the release can let
    the reader read on: if it did not wake it, the reader would stay held.
    """
    from overlord.roles import read_ahead

    monkeypatch.setattr(read_ahead, "POLL_S", 3600.0)
    loader = lone_loader(tmp_path, 1, docs=3)
    try:
        held_back(loader)
        blocks: list[dict[str, Any]] = []
        while not blocks:  # what it holds, as the planner received it
            blocks = loader.metadata(HANG_GUARD_S)
        keys = [
            [b["epoch"], b["shard_pos"], i] for b in blocks if not b["last"] for i in b["index"]
        ]
        deadline = time.monotonic() + HANG_GUARD_S
        # both threads asleep: the window thread (nor will it wake the scheduler) and the
        # scheduler, the only thread that waits on the loader's condition here
        while not (loader.reader.view().window_thread_waits and loader._lock._waiters):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the reader's threads never settled"
            time.sleep(0.01)
        read = loader.stats()["tokens"]
        for key in keys:
            with loader.reader.lock:
                assert loader.reader.waits_on == "budget" and not loader.reader.released_enough()
                assert loader.stats()["tokens"] == read, "it read on before its piece fit"
            loader.release(np.array([key], dtype=np.int64))
            with loader.reader.lock:
                if loader.reader.released_enough() or loader.reader.waits_on != "budget":
                    break
        else:
            pytest.fail(f"releasing all {len(keys)} documents it held left no room")
        deadline = time.monotonic() + HANG_GUARD_S
        while loader.stats()["tokens"] == read:  # the reader woke and read on
            assert time.monotonic() < deadline, f"the release did not wake it: {loader.stats()}"
            time.sleep(0.01)
    finally:
        loader.close()


def test_loaders_measure_what_a_token_costs_them(tmp_path):
    """The autoscaler's input: CPU seconds per token and per sample, memory, queue depth."""
    plan = make_corpus(
        tmp_path,
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 20 for i in range(4)}, "loaders": 2},
            "code": {"files": {f"data/code/p{i}.jsonl": 20 for i in range(4)}, "loaders": 2},
        },
    )
    with Loader(load_plan(plan)) as loader:
        clients = [loader.client(r) for r in range(2)]
        for _ in range(3):
            for c in clients:
                next(c)
        stats = loader.stats()["loaders"]
    assert len(stats) == 4
    for s in stats:
        assert 0 < s["cpu_s_per_token"] < 1e-2 and s["cpu_s_per_sample"] > s["cpu_s_per_token"]
        assert s["rss_bytes"] > 0 and not s["shadow"] and s["shards"] >= 1


def test_a_read_that_never_returns_times_out_naming_the_source_and_file(tmp_path, monkeypatch):
    plan_path = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": 5, "data/web/b.jsonl": 5}}},
        loading={"timeout_s": 1.5},
    )
    import overlord.sources.shard as shard_module

    real, stuck = shard_module.open_shard, threading.Event()

    def hangs_on_b(source, shard, *args):  # a read of b.jsonl never returns (a hung mount)
        if shard.name.endswith("b.jsonl"):
            stuck.wait()
        return real(source, shard, *args)

    monkeypatch.setattr(shard_module, "open_shard", hangs_on_b)
    try:
        with (
            pytest.raises(LoaderError, match=r"SourceLoader web\[0\].*data/web/b\.jsonl"),
            Loader(plan_path) as loader,
        ):
            clients = [loader.client(r) for r in range(2)]
            for _ in range(50):
                for c in clients:
                    next(c)
    finally:
        stuck.set()  # let the stuck reader thread end with the test


def test_loader_stats_count_records_empty_skipped_and_epochs(tmp_path):
    """Counts are per file (once, whatever the epochs); epochs are those begun."""
    records = [{"text": f"document {i} " + "x" * i} for i in range(5)]
    records[1:1] = [{"text": ""}, {"text": "  \n"}, '{"text": 7}']  # rows 1, 2 empty; 3 bad
    plan = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": records}}}, on_error="skip")
    with Loader(load_plan(plan)) as loader:
        clients = [loader.client(r) for r in range(2)]
        batches = [next(c) for _ in range(4) for c in clients]
        (s,) = loader.stats()["loaders"]
    delivered = Counter(x.id for b in batches for x in b.samples)
    assert {i.split(":")[1] for i in delivered} == {"0", "4", "5", "6", "7"}  # no empty one
    assert (s["records"], s["empty"], s["skipped"], s["dropped"]) == (8, 2, 1, 0)
    # a file of 5 samples: a record delivered k times was read in k epochs at least
    assert max(delivered.values()) >= 2
    assert s["epochs"] >= max(delivered.values())


class CountingCondition(threading.Condition):
    """A condition that counts how its waits ended: notified (True) or timed out (False)."""

    def __init__(self, lock: Any = None) -> None:
        super().__init__(lock)
        self.ends: Counter[bool] = Counter()

    def wait(self, timeout: float | None = None) -> bool:
        woken = super().wait(timeout)
        self.ends[woken] += 1
        return woken


def test_the_window_thread_wakes_for_its_own_wait_only(tmp_path, monkeypatch):
    """Notices to the loader's other waiters leave the window thread asleep; its own wake it.

    The loader's lock is notified several times a piece (a piece done, items published,
    released or asked for), none of which gives the window thread room for its next
    window; a window taken to be cut does, and wakes it (not its wait's timeout).
    """
    with monkeypatch.context() as m:
        m.setattr(threading, "Condition", CountingCondition)
        loader = lone_loader(tmp_path, 1)
    try:
        held_back(loader)
        reader, cv = loader.reader, loader.reader.window_turn
        assert isinstance(cv, CountingCondition)
        deadline = time.monotonic() + HANG_GUARD_S
        while not reader.view().settled:  # nothing moves until an item is released or asked
            assert time.monotonic() < deadline, reader.view()
            with reader.lock:
                reader.lock.wait(0.05)
        woken = cv.ends[True]
        for _ in range(50):  # what a release or a metadata call does to the loader's lock
            with reader.lock:
                reader.lock.notify_all()
        assert cv.ends[True] == woken
        for _ in range(40):  # each call lifts the budget: pieces start, windows are taken
            loader.metadata(HANG_GUARD_S)
            if cv.ends[True] > woken:
                break
        assert cv.ends[True] > woken
    finally:
        loader.close()


def test_one_reader_thread_cuts_its_pieces_on_the_scheduler_more_on_kept_workers(
    tmp_path, monkeypatch
):
    """At ``loading.threads: 1`` no piece is handed to a worker thread; at 2 every piece is."""
    from overlord.roles import read_ahead

    recorded, cut_on = on_threads(read_ahead.cut_items)
    monkeypatch.setattr(read_ahead, "cut_items", recorded)
    loader = lone_loader(tmp_path / "one", 1)
    try:
        held_back(loader)
    finally:
        loader.close()
    assert cut_on and set(cut_on) == {"overlord-loader-web-0"}, Counter(cut_on)

    cut_on.clear()
    loader = lone_loader(tmp_path / "two", 1)
    try:
        loader.set_threads(2)
        before = len(cut_on)
        while len(cut_on) < before + 3:  # pieces started from now on
            loader.metadata(HANG_GUARD_S)
    finally:
        loader.close()
    assert {t for t in cut_on[before + 1 :]} == {"overlord-piece-web-0"}, Counter(cut_on)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 200])
def test_the_last_key_of_a_take_is_the_greatest_in_source_order(n):
    # a few keys are compared in plain Python, many by one sort: both are the same order
    rng = np.random.default_rng(n)
    for _ in range(30):
        keys = rng.integers(0, 3, size=(n, 3)) * np.array([1, 1, 1000]) + rng.integers(
            0, 4, size=(n, 3)
        )
        assert _last(keys) == tuple(max(keys.tolist()))
