"""Faults on the embedded runtime: loaders die, the planner restarts, a source hangs.

Every test compares what the trainer received with an uninterrupted run: the
stream must be the same, sample for sample, rank for rank.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_corpus

from overlord import Loader, LoaderError, load_plan
from overlord.journal import JournalError, decode, encode, read_segment, recover, segments
from overlord.roles.planner import Planner
from overlord.run import dump_line

STEPS = 16


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    sources = {
        "web": {"files": {f"data/web/part-{i}.jsonl": 15 + i for i in range(6)}, "loaders": 2},
        "code": {"files": {f"data/code/part-{i}.jsonl": 10 + i for i in range(4)}, "loaders": 2},
    }
    return make_corpus(
        root,
        sources,
        batch={"tokens_per_step": 512, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": 2},
        mixture={
            "schedule": [
                {"step": 0, "weights": {"web": 0.7, "code": 0.3}},
                {"step": STEPS, "weights": {"web": 0.3, "code": 0.7}},
            ]
        },
    )


def _plan(path: Path, **changes: Any):
    plan = load_plan(path)
    data = plan.model_dump(mode="json")
    for key, value in changes.items():
        if key == "shadows":
            for s in data["sources"]:
                s["shadows"] = value
        else:
            section, _, field = key.partition("__")
            data[section][field] = value
    from overlord.plan.spec import validate_plan

    return validate_plan(data, base_dir=plan.base_dir)


def _run(
    plan, actions: dict[tuple[int, int], Any] | None = None, steps: int = STEPS
) -> tuple[list[str], Loader]:
    """Every rank's batches of ``steps`` steps; ``actions[(step, rank)](loader)`` runs before it."""
    lines = []
    loader = Loader(plan)
    try:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(steps):
            for r, c in enumerate(clients):
                if actions and (step, r) in actions:
                    actions[(step, r)](loader)
                lines.append(dump_line(next(c)))
        loader.stats_at_end = loader.stats()  # type: ignore[attr-defined]
        loader.state_at_end = loader.state_dict()  # type: ignore[attr-defined]
    finally:
        loader.close()
    return lines, loader


@pytest.fixture(scope="module")
def reference(plan_path) -> list[str]:
    return _run(load_plan(plan_path))[0]


def _kill(source: str, k: int):
    def act(loader: Loader) -> None:
        planner = loader.planner.obj  # type: ignore[attr-defined]
        loader.runtime.kill(planner.slots[source][k][0])

    return act


def test_a_killed_loader_with_a_shadow_is_replaced_without_changing_the_stream(
    plan_path, reference
):
    plan = _plan(plan_path, shadows=1)
    lines, loader = _run(
        plan, {(3, 1): _kill("web", 0), (7, 0): _kill("code", 1), (11, 0): _kill("web", 0)}
    )
    assert lines == reference
    events = [e for e in loader.stats_at_end["events"] if e["event"] == "failover"]  # type: ignore[attr-defined]
    assert [(e["source"], e["loader"]) for e in events] == [("web", 0), ("code", 1), ("web", 0)]
    assert all(e["how"] == "promoted its shadow" for e in events)


def test_without_a_shadow_a_new_loader_reads_again_from_the_consumed_state(plan_path, reference):
    lines, loader = _run(load_plan(plan_path), {(4, 1): _kill("web", 1), (9, 0): _kill("code", 0)})
    assert lines == reference
    hows = [e["how"] for e in loader.stats_at_end["events"]]  # type: ignore[attr-defined]
    assert hows == ["started a new loader from the consumed state (no live shadow)"] * 2


def test_a_dead_shadow_is_skipped_and_replaced(plan_path, reference):
    def kill_both(loader: Loader) -> None:
        slot = loader.planner.obj.slots["web"][0]  # type: ignore[attr-defined]
        loader.runtime.kill(slot[1])  # the shadow first, then the primary
        loader.runtime.kill(slot[0])

    lines, loader = _run(_plan(plan_path, shadows=1), {(5, 0): kill_both})
    assert lines == reference
    slot = loader.stats_at_end["events"][0]  # type: ignore[attr-defined]
    assert slot["how"].startswith("started a new loader")


def test_payloads_stay_until_their_step_is_consumed_so_a_retry_can_take_them_again(plan_path):
    with Loader(load_plan(plan_path)) as loader:
        clients = [loader.client(r) for r in range(2)]
        first = [next(c) for c in clients]
        constructor = loader.constructors[0].obj  # type: ignore[attr-defined]
        again = constructor.batch(1, 0)  # step 1 is planned, not consumed: built again
        assert again.step == 1
        next(clients[0])  # rank 0 consumes step 1; rank 1 not yet: still held
        assert constructor.batch(1, 0).input_ids.tolist() == again.input_ids.tolist()
        assert first[0].step == 0


# ---- planner restart from its journal ---------------------------------------------------


def _restart_planner(loader: Loader) -> None:
    """What Ray does to a killed planner: a new one, built from the same arguments."""
    old = loader.planner.obj  # type: ignore[attr-defined]
    old.close()  # its files, as the system closes a killed process's
    args = (old.plan_data, old.base_dir, loader.loaders, loader.runtime, None, False)
    loader.planner.obj = Planner(*args, loader.shadows, loader.journal)  # type: ignore[attr-defined]


def test_a_restarted_planner_resumes_from_its_journal_and_replans_the_same_steps(
    plan_path, reference, tmp_path, caplog
):
    plan = _plan(plan_path, recovery__journal_dir=str(tmp_path), recovery__snapshot_every=4)
    # mid-step (rank 0 consumed, rank 1 not), at a snapshot boundary and between
    actions = {(s, r): _restart_planner for s, r in [(2, 1), (8, 0), (13, 1)]}
    lines, loader = _run(plan, actions)
    assert lines == reference
    restarts = [r.getMessage() for r in caplog.records if "restarted from its journal" in r.msg]
    assert [m.rsplit(" ", 1)[1] for m in restarts] == ["2", "8", "13"]
    (event,) = loader.stats_at_end["events"]  # type: ignore[attr-defined]
    assert event["event"] == "planner-recovered" and event["replanned"] >= 1
    assert not os.path.exists(loader.journal or "")  # removed when the job closed


def test_a_restart_after_a_failover_finds_the_new_loaders_in_the_journal(
    plan_path, reference, tmp_path
):
    plan = _plan(plan_path, recovery__journal_dir=str(tmp_path), shadows=1)
    lines, loader = _run(plan, {(5, 0): _kill("web", 1), (6, 1): _restart_planner})
    assert lines == reference


def _journal_dir(plan_path: Path, tmp_path: Path, steps: int) -> tuple[Path, list[dict]]:
    """A journal left by a job that planned and consumed ``steps`` steps, and its states."""
    plan = _plan(plan_path, recovery__journal_dir=str(tmp_path), recovery__snapshot_every=5)
    states = []
    loader = Loader(plan)
    clients = [loader.client(r) for r in range(plan.world.dp)]
    for _ in range(steps):
        for c in clients:
            next(c)
        states.append(loader.state_dict())
    path = Path(loader.journal or "")
    loader.journal = None  # keep it when closing
    loader.close()
    return path, states


def test_the_journal_replays_to_the_exact_state_of_every_consumed_step(plan_path, tmp_path):
    path, states = _journal_dir(plan_path, tmp_path, 12)
    recovered = recover(path)
    planner = Planner.__new__(Planner)  # only its replay arithmetic
    plan = _plan(plan_path)
    from overlord.plan.schedule import Schedule

    planner.schedule, planner.names = Schedule(plan), plan.source_names
    state = recovered[-1].snapshot
    replayed = {state["step"]: state}
    for d in recovered[-1].deltas:
        state = planner._apply(state, d)
        replayed[state["step"]] = state
    for s in states:
        if s["step"] in replayed:
            assert replayed[s["step"]]["sources"] == s["sources"]
    assert recovered[-1].consumed == 11
    assert len(segments(path)) <= 2  # older segments are dropped once consumed


def test_a_torn_or_corrupt_record_is_rejected_with_its_place_and_the_rest_is_used(
    plan_path, tmp_path
):
    path, _ = _journal_dir(plan_path, tmp_path, 8)
    seg = segments(path)[-1]
    records, end, problem = read_segment(seg)
    assert problem is None and records[0]["t"] == "snap"
    data = seg.read_bytes()
    # a torn last record: the writer died in the middle of it
    seg.write_bytes(data[:-7])
    with pytest.raises(JournalError, match=r"record \d+ at byte \d+: torn record"):
        read_segment(seg)
    got = recover(path)[-1]
    assert "torn record" in got.problems[0] and "records before it are used" in got.problems[0]
    # every record but the torn last one is used
    assert got.deltas == [r["d"] for r in records[:-1] if r["t"] == "plan"]
    assert got.consumed == max(r["s"] for r in records[:-1] if r["t"] == "cons")
    # a flipped byte in the middle: its checksum fails, reading stops there
    lines = data.splitlines(keepends=True)
    bad = lines[2].replace(b'"t"', b'"T"', 1)
    seg.write_bytes(b"".join([*lines[:2], bad, *lines[3:]]))
    with pytest.raises(JournalError, match="record 2 at byte .*checksum mismatch"):
        read_segment(seg)
    assert recover(path)[-1].deltas == [r["d"] for r in records[1:2] if r["t"] == "plan"]


def test_a_journal_without_an_intact_snapshot_is_an_error(tmp_path):
    (tmp_path / "seg-0000000000.log").write_bytes(b"garbage\n")
    with pytest.raises(JournalError, match="no intact snapshot"):
        recover(tmp_path)


def test_records_round_trip_and_carry_a_checksum():
    rec = {"t": "plan", "s": 7, "d": {"c": {"web": [0, 3, 12, []]}, "p": {"web": 448}}}
    line = encode(rec)
    assert decode(line, "here") == rec
    with pytest.raises(JournalError, match="here: checksum mismatch"):
        decode(line.replace(b"448", b"449"), "here")


def test_a_delta_is_small(plan_path, tmp_path):
    path, _ = _journal_dir(plan_path, tmp_path, 9)
    records = [r for seg in segments(path) for r in read_segment(seg)[0]]
    deltas = [len(encode(r)) for r in records if r["t"] == "plan"]
    assert deltas and max(deltas) < 200  # two sources; the benchmark measures ten


# ---- a source that hangs ---------------------------------------------------------------


def test_a_read_that_never_returns_times_out_naming_the_source_and_file(tmp_path, monkeypatch):
    plan_path = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": 5, "data/web/b.jsonl": 5}}},
        loading={"timeout_s": 1.5},
    )
    import overlord.sources.shard as shard_module

    real, stuck = shard_module.read_shard, threading.Event()

    def hangs_on_b(source, shard, *args):  # a read of b.jsonl never returns (a hung mount)
        if shard.name.endswith("b.jsonl"):
            stuck.wait()
        return real(source, shard, *args)

    monkeypatch.setattr(shard_module, "read_shard", hangs_on_b)
    t0 = time.monotonic()
    try:
        with (
            pytest.raises(LoaderError, match=r"SourceLoader web\[0\].*data/web/b\.jsonl"),
            Loader(plan_path) as loader,
        ):
            clients = [loader.client(r) for r in range(2)]
            for _ in range(50):
                for c in clients:
                    next(c)
        assert time.monotonic() - t0 < 10  # the plan's 1.5 s, and the close
    finally:
        stuck.set()  # let the stuck reader thread end with the test


# ---- read-ahead: a source's budget, shared by its loaders --------------------------------


def _lone_loader(tmp_path: Path, count: int):
    """Loader 0 of ``count`` of a source of 16 shards whose budget share is under one shard."""
    from overlord.roles.source_loader import SourceLoader, token_budget
    from overlord.sources.shard import shard_order

    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {f"data/web/part-{i:02d}.jsonl": 12 for i in range(16)}}},
            batch={"tokens_per_step": 128, "max_seq_len": 64, "prefetch_steps": 1, "lookahead": 1},
        )
    )
    loader = SourceLoader(plan.model_dump(mode="json"), str(plan.base_dir), "web", 0, count)
    assert token_budget(plan, count) == -(-(4 * 128 + 64) // count)
    return loader, shard_order(plan.seed, "web", 0, 16)


def test_loaders_of_a_source_share_its_read_ahead(tmp_path):
    """With 4 loaders each holds a quarter of the source's budget (and the shard past it)."""
    loader, _ = _lone_loader(tmp_path, 4)
    try:
        time.sleep(1.0)  # let it read as far as its budget allows
        s = loader.stats()
        # 12 documents of some 20 tokens are past a 144-token share: one shard, then it waits
        assert s["budget_tokens"] == 144 and s["held_shards"] == 1 and s["queued_blocks"] == 1
        assert s["held_tokens"] > s["budget_tokens"]
    finally:
        loader.close()


def test_a_caller_waiting_for_the_next_shard_lifts_the_budget(tmp_path):
    """Nothing is released, yet every shard comes: waiting for one lets the reader publish it.

    Without the lift the second ``metadata`` call would wait out its timeout: the
    loader's share is full of items the planner received and holds.
    """
    loader, _ = _lone_loader(tmp_path, 2)
    try:
        got = []
        while len(got) < 8:  # loader 0 of 2 owns 8 of the 16 shards
            got += [(b["epoch"], b["shard_pos"]) for b in loader.metadata(5.0)]
        assert got == [(0, p) for p in range(0, 16, 2)]
        assert loader.stats()["held_tokens"] > 4 * loader.stats()["budget_tokens"]
    finally:
        loader.close()
    fresh, _ = _lone_loader(tmp_path / "b", 2)
    try:  # a constructor's take waits for an unread shard the same way
        out = fresh.take(np.array([[1, 4, 0]]))  # epoch 1: a whole epoch past its share
        assert len(out["lengths"]) == 1 and out["lengths"][0] > 0
    finally:
        fresh.close()


def test_loaders_measure_what_a_token_costs_them(plan_path):
    """The autoscaler's input: CPU seconds per token and per sample, memory, queue depth."""
    with Loader(load_plan(plan_path)) as loader:
        clients = [loader.client(r) for r in range(2)]
        for _ in range(3):
            for c in clients:
                next(c)
        stats = loader.stats()["loaders"]
    assert len(stats) == 4
    for s in stats:
        assert 0 < s["cpu_s_per_token"] < 1e-2 and s["cpu_s_per_sample"] > s["cpu_s_per_token"]
        assert s["rss_bytes"] > 0 and s["queued_blocks"] >= 0 and not s["shadow"]


def test_a_repeated_delivery_is_dropped_by_its_step_and_rank():
    """A retried call may hand the client a batch it already has: it is skipped."""
    from overlord.batch import Batch
    from overlord.roles.client import Client
    from overlord.runtime.inline import InlineHandle, InlineRuntime

    def batch(step: int) -> Batch:
        z = np.zeros(0, dtype=np.int32)
        return Batch(step, 1, z, z, z, z, z, [], 0.0)

    class Replays:  # answers the first request for step 1 with step 0 again
        def __init__(self) -> None:
            self.replayed = False

        def batch(self, step: int, rank: int) -> Batch:
            if step == 1 and not self.replayed:
                self.replayed = True
                return batch(0)
            return batch(step)

    class Planner:
        def mark_consumed(self, rank: int, step: int) -> None:
            pass

    rt = InlineRuntime()
    client = Client(1, InlineHandle(Replays(), "c"), InlineHandle(Planner(), "p"), rt, 0, 3)
    assert [b.step for b in client] == [0, 1, 2]

    class Wrong(Replays):
        def batch(self, step: int, rank: int) -> Batch:
            return batch(step + 1)

    with pytest.raises(LoaderError, match="asked for step 0 and received step 1"):
        next(Client(1, InlineHandle(Wrong(), "c"), InlineHandle(Planner(), "p"), rt, 0))


# ---- re-partitioning a source while it is read (the autoscaler's act) --------------------


def _repartition(source: str, count: int):
    def act(loader: Loader) -> None:
        loader.planner.obj.repartition(source, count)  # type: ignore[attr-defined]

    return act


@pytest.fixture(scope="module")
def big_plan(tmp_path_factory) -> Path:
    """Shards larger than what a loader reads ahead, so a new partition has shards to read."""
    root = tmp_path_factory.mktemp("scaling")
    sources = {
        "web": {"files": {f"data/web/part-{i}.jsonl": 40 + i for i in range(16)}, "loaders": 2},
        "code": {"files": {f"data/code/part-{i}.jsonl": 40 + i for i in range(12)}, "loaders": 2},
    }
    return make_corpus(
        root,
        sources,
        batch={
            "tokens_per_step": 1024,
            "max_seq_len": 64,
            "prefetch_steps": 1,
            "lookahead": 4,
        },
        world={"dp": 2},
    )


BIG_STEPS = 140


@pytest.fixture(scope="module")
def big_reference(big_plan) -> list[str]:
    return _run(load_plan(big_plan), steps=BIG_STEPS)[0]


def _read_past(loader: Loader, source: str) -> list[bool]:
    """For each re-partition of ``source``: did every rank consume past its boundary?"""
    cursor = loader.state_at_end["sources"][source]["cursor"]  # type: ignore[attr-defined]
    at_end = (cursor["epoch"], cursor["shard_pos"])
    parts = loader.planner.obj.parts[source]  # type: ignore[attr-defined]
    return [at_end > p.start for p in parts if p.loader == 0 and p.start != (0, 0)]


def test_repartitioning_a_source_never_changes_the_stream(big_plan, big_reference):
    actions = {
        (1, 1): _repartition("web", 3),  # mid-step
        (5, 0): _repartition("code", 1),
        (8, 0): _repartition("web", 1),
        (12, 1): _repartition("code", 3),
    }
    lines, loader = _run(load_plan(big_plan), actions, BIG_STEPS)
    assert lines == big_reference
    # the new partitions did serve: the trainer consumed past each boundary
    assert _read_past(loader, "web") == [True, True]
    assert _read_past(loader, "code") == [True, True]
    events = [e for e in loader.stats_at_end["events"] if e["event"] == "repartition"]  # type: ignore[attr-defined]
    assert [(e["source"], e["loaders"]) for e in events] == [
        ("web", "2 -> 3"),
        ("code", "2 -> 1"),
        ("web", "3 -> 1"),
        ("code", "1 -> 3"),
    ]
    live = loader.stats_at_end["loaders"]  # type: ignore[attr-defined]
    # old partitions are closed once consumed: fewer than the 12 loaders ever started
    assert len(live) < 2 + 3 + 1 + 2 + 1 + 3


def test_threads_change_while_reading_without_changing_the_stream(big_plan, big_reference):
    def threads(n: int):
        return lambda loader: loader.planner.obj.set_threads("web", n)  # type: ignore[attr-defined]

    lines, _ = _run(load_plan(big_plan), {(3, 0): threads(4), (8, 1): threads(1)}, BIG_STEPS)
    assert lines == big_reference


def test_failover_and_planner_restart_after_a_repartition(big_plan, big_reference, tmp_path):
    plan = _plan(big_plan, recovery__journal_dir=str(tmp_path), shadows=1)
    actions = {
        (1, 0): _repartition("web", 3),
        (4, 1): _kill("web", 3),  # a loader of the new partition
        (6, 0): _restart_planner,
        (8, 1): _repartition("code", 1),
        (10, 0): _restart_planner,
        (30, 0): _kill("code", 2),
        (33, 1): _restart_planner,
    }
    lines, loader = _run(plan, actions, BIG_STEPS)
    assert lines == big_reference
    assert _read_past(loader, "code") == [True]


def test_a_restarted_planner_keeps_the_autoscalers_timers_and_costs(
    big_plan, big_reference, tmp_path
):
    """The cooldown a scale-down waits for, and each source's cost, survive a restart."""
    plan = _plan(
        big_plan,
        recovery__journal_dir=str(tmp_path),
        autoscale__cpus=5,
        autoscale__every=3,
        autoscale__cooldown_steps=1_000,  # nothing shrinks: the timers only run
    )
    seen: list[tuple[dict, dict]] = []

    def restart(loader: Loader) -> None:
        before = loader.planner.obj  # type: ignore[attr-defined]
        state = (before.scaler.state_dict(), dict(before._cost))
        _restart_planner(loader)
        after = loader.planner.obj  # type: ignore[attr-defined]
        seen.append((state, (after.scaler.state_dict(), dict(after._cost))))

    lines, _ = _run(plan, {(10, 0): restart, (25, 1): restart}, BIG_STEPS)
    assert lines == big_reference
    for (policy, cost), restored in seen:
        assert policy["low_since"] and cost  # timers running, costs measured
        assert restored == (policy, cost)


def test_the_autoscaler_resizes_sources_within_its_budget_and_the_stream_stays(
    big_plan, big_reference
):
    plan = _plan(big_plan, autoscale__cpus=5, autoscale__every=4, autoscale__horizon_steps=8)
    lines, loader = _run(plan, steps=BIG_STEPS)
    assert lines == big_reference
    decisions = loader.stats_at_end["scaling"]  # type: ignore[attr-defined]
    assert len(decisions) >= BIG_STEPS // 4 - 2
    for d in decisions:
        # the budget bounds the cores the readers are expected to burn, not their threads
        burn = [s["cpu_cores"] for s in d["sources"].values()]
        assert d["cpu_cores"] == pytest.approx(sum(burn)) and sum(burn) <= 5 + 1e-9
        assert all(
            0 <= c <= s["loaders"] * s["threads"] for c, s in zip(burn, d["sources"].values())
        )
        assert all(s["reason"] for s in d["sources"].values()) and d["reason"]
    # reading costs a few microseconds a token and this trainer asks a few hundred thousand
    # tokens a second: one loader a source is enough, and the second ones are let go
    events = loader.stats_at_end["events"]  # type: ignore[attr-defined]
    assert any(e["event"] == "repartition" and e["loaders"] == "2 -> 1" for e in events)


def test_loaders_a_repartition_just_started_keep_their_source_measured(big_plan):
    """A source's cost outlives the loaders that measured it.

    Loaders a re-partition just started have read nothing yet. Were the source
    then unmeasured, the autoscaler would count it at one core per reader
    thread and shrink it to fit the budget, and the next decision would grow it
    again: a flap, each turn a re-partition.
    """
    plan = _plan(big_plan, autoscale__cpus=5, autoscale__every=10_000)  # decide when told
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(6):
            for c in clients:
                next(c)
        planner = loader.planner.obj  # type: ignore[attr-defined]
        planner._autoscale(6)
        before = planner.scaling[-1]["sources"]
        for name in planner.names:  # every current loader as a fresh one: nothing measured
            for k in planner._current(name):
                fresh = planner.slots[name][k][0].obj
                measured = fresh.stats
                fresh.stats = lambda m=measured: {**m(), "cpu_s_per_token": float("nan")}
        planner._autoscale(7)
        after = planner.scaling[-1]["sources"]
    for name, d in after.items():
        assert d["capacity_tokens_per_s"] == before[name]["capacity_tokens_per_s"] > 0
        assert (d["loaders"], d["threads"]) == (before[name]["loaders"], before[name]["threads"])


# ---- per-record transforms ---------------------------------------------------------------


def test_a_transform_runs_on_every_record_and_a_failing_one_names_its_place(tmp_path):
    from overlord import SourceError
    from overlord.sources.transforms import pack_zlib_json

    records = [{"text": pack_zlib_json(f"document {i} " * (i + 1))} for i in range(12)]
    plain = make_corpus(
        tmp_path / "plain",
        {
            "web": {
                "files": {
                    "data/web/a.jsonl": [{"text": f"document {i} " * (i + 1)} for i in range(12)]
                }
            }
        },
    )
    packed = make_corpus(
        tmp_path / "packed",
        {
            "web": {
                "files": {"data/web/a.jsonl": records},
                "transform": "overlord.sources.transforms:zlib_json",
            }
        },
    )

    def texts(path: Path) -> tuple[list[str], list[int]]:
        with Loader(load_plan(path)) as loader:
            batch = next(loader.client(0))
        return [s.id for s in batch.samples], batch.input_ids.ravel().tolist()

    ids, tokens = texts(packed)
    assert (ids, tokens) == texts(plain)  # the same documents' tokens, in the same order
    assert bytes(t for t in tokens if t < 256).decode().startswith("document")

    broken = make_corpus(
        tmp_path / "broken",
        {
            "web": {
                "files": {"data/web/a.jsonl": [*records[:3], {"text": "not packed"}, *records[4:]]},
                "transform": "overlord.sources.transforms:zlib_json",
            }
        },
    )
    with pytest.raises(SourceError, match=r"file data/web/a\.jsonl, row 3: transform"):
        texts(broken)


def test_a_transform_that_cannot_be_loaded_is_a_plan_error(tmp_path):
    from overlord import PlanError

    path = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": 3}, "transform": "nope:f"}})
    with pytest.raises(PlanError, match=r"sources\[0\]\.transform: cannot import module 'nope'"):
        load_plan(path)
