"""Faults on the embedded runtime: loaders die, the planner restarts, sources are re-sized.

Every test compares what the trainer received with an uninterrupted run: the
stream must be the same, sample for sample, rank for rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.jobs import kill, repartition, restart_planner, run_job, set_threads

from conftest import make_corpus, write_file
from overlord import Loader, load_plan
from overlord.plan.spec import validate_plan
from overlord.roles.api import ConstructorRole

pytestmark = pytest.mark.integration

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


def changed(path: Path, **changes: Any):
    """The plan at ``path`` with ``section__field=value`` changes (``shadows`` for every source)."""
    plan = load_plan(path)
    data = plan.model_dump(mode="json")
    for key, value in changes.items():
        if key == "shadows":
            for s in data["sources"]:
                s["shadows"] = value
        else:
            section, _, field = key.partition("__")
            data[section][field] = value
    return validate_plan(data, base_dir=plan.base_dir)


@pytest.fixture(scope="module")
def reference(plan_path) -> list[str]:
    return run_job(load_plan(plan_path)).lines


def test_a_killed_loader_with_a_shadow_is_replaced_without_changing_the_stream(
    plan_path, reference
):
    plan = changed(plan_path, shadows=1)
    ran = run_job(plan, {(3, 1): kill("web", 0), (7, 0): kill("code", 1), (11, 0): kill("web", 0)})
    assert ran.lines == reference
    events = [e for e in ran.stats["events"] if e["event"] == "failover"]
    assert [(e["source"], e["loader"]) for e in events] == [("web", 0), ("code", 1), ("web", 0)]
    assert all(e["how"] == "promoted its shadow" for e in events)


def test_without_a_shadow_a_new_loader_reads_again_from_the_consumed_state(plan_path, reference):
    ran = run_job(load_plan(plan_path), {(4, 1): kill("web", 1), (9, 0): kill("code", 0)})
    assert ran.lines == reference
    hows = [e["how"] for e in ran.stats["events"]]
    assert hows == ["started a new loader from the consumed state (no live shadow)"] * 2


def test_a_dead_shadow_is_skipped_and_replaced(plan_path, reference):
    def kill_both(loader: Loader) -> None:
        slot = loader.slots()["web"][0]
        loader.runtime.kill(slot[1])  # the shadow first, then the primary
        loader.runtime.kill(slot[0])

    ran = run_job(changed(plan_path, shadows=1), {(5, 0): kill_both})
    assert ran.lines == reference
    assert ran.stats["events"][0]["how"].startswith("started a new loader")


def test_a_file_added_while_the_job_runs_is_not_read_by_a_loader_started_later(
    tmp_path, make_corpus
):
    """The job's files are listed once: a loader a failover starts reads the same list.

    It used to list the folder again, and the job died (``could not broadcast
    input array from shape (55,) into shape (54,)``) or, with equal lengths,
    delivered other tokens.
    """
    files = {f"data/web/part-{i}.jsonl": 30 for i in range(6)}
    plan = make_corpus(
        tmp_path,
        {"web": {"files": files, "loaders": 1, "shadows": 0}},
        batch={"tokens_per_step": 256, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": 1},
    )
    reference = run_job(plan, steps=40).lines

    def add_then_kill(loader: Loader) -> None:
        write_file(tmp_path / "data/web/part-6.jsonl", 30, tag="web/part-6")
        kill("web", 0)(loader)

    ran = run_job(plan, {(10, 0): add_then_kill}, steps=40)
    assert ran.lines == reference
    assert [e["event"] for e in ran.stats["events"]] == ["failover"]
    assert all("part-6" not in line for line in ran.lines)


def test_payloads_stay_until_their_step_is_consumed_so_a_retry_can_take_them_again(plan_path):
    with Loader(load_plan(plan_path)) as loader:
        clients = [loader.client(r) for r in range(2)]
        first = [next(c) for c in clients]
        constructor = loader.constructors[0]
        again = constructor.call(ConstructorRole.batch, 1, 0).result()  # planned, not consumed
        assert again.step == 1
        next(clients[0])  # rank 0 consumes step 1; rank 1 not yet: still held
        retried = constructor.call(ConstructorRole.batch, 1, 0).result()
        assert retried.input_ids.tolist() == again.input_ids.tolist()
        assert first[0].step == 0


# ---- planner restart from its journal ---------------------------------------------------


def test_a_restarted_planner_resumes_from_its_journal_and_replans_the_same_steps(
    plan_path, reference, tmp_path, caplog
):
    plan = changed(plan_path, recovery__journal_dir=str(tmp_path), recovery__snapshot_every=4)
    # mid-step (rank 0 consumed, rank 1 not), at a snapshot boundary and between
    actions = {(s, r): restart_planner for s, r in [(2, 1), (8, 0), (13, 1)]}
    ran = run_job(plan, actions)
    assert ran.lines == reference
    restarts = [r.getMessage() for r in caplog.records if "restarted from its journal" in r.msg]
    assert [m.rsplit(" ", 1)[1] for m in restarts] == ["2", "8", "13"]
    (event,) = ran.stats["events"]  # the last planner's
    assert event["event"] == "planner-recovered" and event["replanned"] >= 1
    assert ran.journal is not None and not os.path.exists(ran.journal)  # removed at the close


def test_a_restart_after_a_failover_finds_the_new_loaders_in_the_journal(
    plan_path, reference, tmp_path
):
    plan = changed(plan_path, recovery__journal_dir=str(tmp_path), shadows=1)
    ran = run_job(plan, {(5, 0): kill("web", 1), (6, 1): restart_planner})
    assert ran.lines == reference


# ---- re-partitioning a source while it is read (the autoscaler's act) --------------------


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
        batch={"tokens_per_step": 1024, "max_seq_len": 64, "prefetch_steps": 1, "lookahead": 4},
        world={"dp": 2},
    )


BIG_STEPS = 140


@pytest.fixture(scope="module")
def big_reference(big_plan) -> list[str]:
    return run_job(load_plan(big_plan), steps=BIG_STEPS).lines


def test_repartitioning_a_source_never_changes_the_stream(big_plan, big_reference):
    actions = {
        (1, 1): repartition("web", 3),  # mid-step
        (5, 0): repartition("code", 1),
        (8, 0): repartition("web", 1),
        (12, 1): repartition("code", 3),
    }
    ran = run_job(load_plan(big_plan), actions, BIG_STEPS)
    assert ran.lines == big_reference
    events = [e for e in ran.stats["events"] if e["event"] == "repartition"]
    assert [(e["source"], e["loaders"]) for e in events] == [
        ("web", "2 -> 3"),
        ("code", "2 -> 1"),
        ("web", "3 -> 1"),
        ("code", "1 -> 3"),
    ]
    # the new partitions did serve: every rank consumed past each boundary
    for e in events:
        cursor = ran.state["sources"][e["source"]]["cursor"]
        assert [cursor["epoch"], cursor["shard_pos"]] > e["at"]
    # old partitions are closed once consumed: of the 12 loaders ever started, the current
    # ones are left (web's 1 and code's 3)
    live = sorted((s["source"], s["loader"]) for s in ran.stats["loaders"])
    assert live == [("code", 0), ("code", 1), ("code", 2), ("web", 0)]


def test_threads_change_while_reading_without_changing_the_stream(big_plan, big_reference):
    actions = {(3, 0): set_threads("web", 4), (8, 1): set_threads("web", 1)}
    assert run_job(load_plan(big_plan), actions, BIG_STEPS).lines == big_reference


def test_failover_and_planner_restart_after_a_repartition(big_plan, big_reference, tmp_path):
    plan = changed(big_plan, recovery__journal_dir=str(tmp_path), shadows=1)
    actions = {
        (1, 0): repartition("web", 3),
        (4, 1): kill("web", 3),  # a loader of the new partition
        (6, 0): restart_planner,
        (8, 1): repartition("code", 1),
        (10, 0): restart_planner,
        (30, 0): kill("code", 2),
        (33, 1): restart_planner,
    }
    ran = run_job(plan, actions, BIG_STEPS)
    assert ran.lines == big_reference
    cursor = ran.state["sources"]["code"]["cursor"]
    assert len(ran.stats["loaders"]) == 3 + 1  # web's 3 and code's 1 (the old ones retired)
    assert (cursor["epoch"], cursor["shard_pos"]) > (0, 2)  # code's one loader served


def test_a_restarted_planner_keeps_the_autoscalers_timers_and_costs(
    big_plan, big_reference, tmp_path
):
    """The cooldown a scale-down waits for, and each source's cost, survive a restart."""
    plan = changed(
        big_plan,
        recovery__journal_dir=str(tmp_path),
        autoscale__cpus=5,
        autoscale__every=3,
        autoscale__cooldown_steps=1_000,  # nothing shrinks: the timers only run
    )
    seen: list[tuple[dict, dict]] = []

    def restart(loader: Loader) -> None:
        before = loader.stats()["autoscaler"]
        restart_planner(loader)
        seen.append((before, loader.stats()["autoscaler"]))

    ran = run_job(plan, {(10, 0): restart, (25, 1): restart}, BIG_STEPS)
    assert ran.lines == big_reference
    assert len(seen) == 2
    for before, after in seen:
        assert before["policy"]["low_since"] and before["cost"]  # timers running, costs measured
        assert after == before


def test_the_autoscaler_resizes_sources_within_its_budget_and_the_stream_stays(
    big_plan, big_reference
):
    plan = changed(big_plan, autoscale__cpus=5, autoscale__every=4, autoscale__horizon_steps=8)
    ran = run_job(plan, steps=BIG_STEPS)
    assert ran.lines == big_reference
    decisions = ran.stats["scaling"]
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
    events = ran.stats["events"]
    assert any(e["event"] == "repartition" and e["loaders"] == "2 -> 1" for e in events)
