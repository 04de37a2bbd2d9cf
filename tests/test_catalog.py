"""A job's files: listed once, recorded in the state, and what a resume does when they change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.jobs import run_job

from conftest import make_corpus, write_file
from overlord import CheckpointError, Loader, load_plan
from overlord.sources.catalog import File, SourceFiles, job_files


def files(*names_sizes: tuple[str, int]) -> tuple[File, ...]:
    return tuple(File(n, f"/data/{n}", size) for n, size in names_sizes)


def test_an_epoch_reads_the_list_that_starts_at_or_before_it():
    old, new = files(("a", 1), ("b", 2)), files(("a", 1), ("b", 2), ("c", 3))
    lists = SourceFiles("web", [(0, old), (5, new)])
    assert [len(lists.at(e)) for e in (0, 4, 5, 9)] == [2, 2, 3, 3]


def test_files_listed_now_join_at_the_next_epoch_and_only_if_they_differ():
    lists = SourceFiles("web", [(0, files(("a", 1)))])
    assert lists.joined(list(files(("a", 1))), 3) == lists  # nothing new: one list
    grown = lists.joined(list(files(("b", 2), ("a", 1))), 3)  # listed in any order
    assert grown.lists == [(0, files(("a", 1))), (4, files(("a", 1), ("b", 2)))]
    # a later list the state did not reach yet is replaced by what is there now
    assert grown.joined(list(files(("a", 1), ("c", 5))), 2).at(3) == files(("a", 1), ("c", 5))


def test_a_record_round_trips_and_resolves_local_names_against_the_plans_folder():
    lists = SourceFiles("web", [(0, files(("x/a.jsonl", 10))), (2, files(("s3://b/c", 4)))])
    back = SourceFiles.of_record("web", json.loads(json.dumps(lists.record())), "/plans")
    assert back == lists
    assert back.at(0)[0].url == "/plans/x/a.jsonl" and back.at(2)[0].url == "s3://b/c"


def test_a_missing_or_resized_file_of_the_current_epoch_is_named():
    lists = SourceFiles("web", [(0, files(("a", 1), ("b", 2)))])
    problems = lists.check({"a": File("a", "/data/a", 7)}, 0)
    assert problems == [
        "source 'web': file a changed size since the checkpoint: 1 bytes then, 7 now",
        "source 'web': file b of the current epoch is missing",
    ]


# ---- resuming a job whose files changed ---------------------------------------------------


def plan_of(tmp_path: Path) -> Path:
    """One source of 3 small files (an epoch is a dozen steps), one rank."""
    return make_corpus(
        tmp_path,
        {"web": {"files": {f"data/web/part-{i}.jsonl": 40 for i in range(3)}}},
        batch={"tokens_per_step": 256, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": 1},
    )


def step_ids(lines: list[str]) -> list[list[str]]:
    return [[s["id"] for s in json.loads(line)["samples"]] for line in lines]


def first_step_of_epoch_1(steps: list[list[str]]) -> int:
    """The first step that holds a record seen before: the source's second epoch began."""
    seen: set[str] = set()
    for i, ids in enumerate(steps):
        if seen & set(ids):
            return i
        seen |= set(ids)
    raise AssertionError("the run never reached a second epoch")


@pytest.mark.integration
def test_a_file_added_between_runs_joins_at_the_next_epoch(tmp_path):
    plan = plan_of(tmp_path)
    reference = step_ids(run_job(plan, steps=40).lines)
    boundary = first_step_of_epoch_1(reference)
    assert boundary >= 8
    state = run_job(plan, steps=4).state  # a checkpoint in the middle of epoch 0
    write_file(tmp_path / "data/web/part-3.jsonl", 40, tag="web/part-3")
    resumed = step_ids(run_job(plan, steps=40, state=state).lines)
    # the recorded files until the epoch ends: the same samples as if nothing was added
    # (the step before the boundary may already look ahead into the next epoch)
    assert resumed[: boundary - 1 - 4] == reference[4 : boundary - 1]
    # then the new file's records, every one of them, and none before the boundary
    new = [(i + 4, x) for i, ids in enumerate(resumed) for x in ids if "part-3" in x]
    assert min(step for step, _ in new) >= boundary - 1
    assert {x for _, x in new} == {f"data/web/part-3.jsonl:{r}" for r in range(40)}
    assert not any("part-3" in x for ids in reference for x in ids)


@pytest.mark.integration
def test_the_state_records_the_files_and_a_resume_keeps_them(tmp_path):
    plan = plan_of(tmp_path)
    ran = run_job(plan, steps=3)
    recorded = ran.state["sources"]["web"]["files"]
    assert recorded == [[0, [[f"data/web/part-{i}.jsonl", p.stat().st_size] for i, p in
                             enumerate(sorted((tmp_path / "data/web").iterdir()))]]]  # fmt: skip
    resumed = run_job(plan, steps=5, state=ran.state)
    assert resumed.state["sources"]["web"]["files"] == recorded


@pytest.mark.integration
@pytest.mark.parametrize("change", ["remove", "grow"])
def test_a_file_of_the_current_epoch_that_changed_stops_the_resume_naming_it(tmp_path, change):
    plan = plan_of(tmp_path)
    state = run_job(plan, steps=2).state
    victim = tmp_path / "data/web/part-1.jsonl"
    if change == "remove":
        victim.unlink()
        match = r"file data/web/part-1\.jsonl of the current epoch is missing"
    else:
        victim.write_text(victim.read_text() + '{"text": "one more"}\n')
        match = r"file data/web/part-1\.jsonl changed size since the checkpoint: \d+ bytes then"
    with pytest.raises(CheckpointError, match=match):
        Loader(load_plan(plan), state=state)


def test_a_checkpoint_of_the_old_format_is_refused_with_its_version(tmp_path):
    plan = load_plan(plan_of(tmp_path))
    old = {"version": 1, "step": 3, "sources": {}}
    with pytest.raises(CheckpointError, match="version 1 is not supported: expected 3"):
        Loader(plan, state=old)


def test_the_job_lists_its_files_once_with_their_sizes(tmp_path):
    plan = load_plan(plan_of(tmp_path))
    listed = job_files([("web", ["data/web/*.jsonl"])], str(plan.base_dir))["web"]
    assert [(f.name, f.size) for f in listed.at(0)] == [
        (f"data/web/part-{i}.jsonl", (tmp_path / f"data/web/part-{i}.jsonl").stat().st_size)
        for i in range(3)
    ]
