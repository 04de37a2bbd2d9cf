"""The quarantine: samples skipped from a step on, every other source's stream as it was.

The corpus's documents all have ``max_seq_len`` tokens, so that each fills a
row: a step then takes the same number of items of each source whatever they
are, and a source's stream (its items step by step) is a prefix of its order.
That order is read from a plan of one row per step and one rank, where each
step is one item (a source's order does not depend on the batch's shape).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from support.jobs import restart_planner

from overlord import Loader, load_plan, validate_plan
from overlord.errors import CheckpointError, LoaderError, PlanError
from overlord.monitor.prometheus import METRICS
from overlord.ops.run import summarize
from overlord.plan.quarantine import parse_id
from overlord.state import checkpoint

LEN = 64  # max_seq_len: a document of LEN - 1 bytes and its end of text fill a row
STEPS = 12


def _docs(tag: str, n: int) -> list[dict[str, str]]:
    return [{"text": (f"{tag} {i:04d} " + "x" * LEN)[: LEN - 1]} for i in range(n)]


@pytest.fixture
def corpus(tmp_path: Path, make_corpus: Any) -> Path:
    """web: three JSONL files of 12 documents; code: one of 40; 4 rows per step, DP 2."""
    return make_corpus(
        tmp_path,
        sources={
            "web": {"files": {f"data/web/part-{i}.jsonl": _docs(f"w{i}", 12) for i in range(3)}},
            "code": {"files": {"data/code/part-0.jsonl": _docs("c", 40)}},
        },
        batch={"tokens_per_step": 4 * LEN, "max_seq_len": LEN, "prefetch_steps": 2},
        world={"dp": 2},
        loading={"timeout_s": 20},  # as the Ray tests': a loaded machine is not a hung loader
    )


def _with(plan: Any, **fields: Any) -> Any:
    data = plan.model_dump(mode="json")
    for key, value in fields.items():
        data[key] = {**(data.get(key) or {}), **value} if key != "quarantine" else value
    return validate_plan(data, base_dir=plan.base_dir)


def order(plan: Any, items: int) -> dict[str, list[str]]:
    """Each source's first ``items`` samples in its order (one item per step, one rank)."""
    one = _with(plan, batch={"tokens_per_step": LEN}, world={"dp": 1}, quarantine=None)
    out: dict[str, list[str]] = {n: [] for n in plan.source_names}
    with Loader(one) as loader:
        c = loader.client(0)
        while min(len(v) for v in out.values()) < items:
            (s,) = next(c).samples
            out[s.source].append(s.id)
    return out


def run(plan: Any, steps: int = STEPS, state: Any = None, at: Any = None) -> dict[str, Any]:
    """Each source's samples step by step (sorted within a step), the state and stats.

    ``at``: ``(step, action)``, the action run on the Loader before that step is read.
    """
    per: dict[str, list[list[str]]] = {n: [] for n in plan.source_names}
    with Loader(plan, state=state) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(loader.start_step, steps):
            if at is not None and at[0] == step:
                at[1](loader)
            got: dict[str, list[str]] = {n: [] for n in plan.source_names}
            for c in clients:
                for s in next(c).samples:
                    got[s.source].append(s.id)
            for n in per:
                per[n].append(sorted(got[n]))
        return {"per": per, "state": loader.state_dict(), "stats": loader.stats()}


def chunks(items: list[str], like: list[list[str]]) -> list[list[str]]:
    """``items`` cut into the steps of ``like`` (as many per step), each step sorted."""
    out, i = [], 0
    for step in like:
        out.append(sorted(items[i : i + len(step)]))
        i += len(step)
    return out


@pytest.mark.integration
def test_a_plan_quarantine_removes_its_samples_and_no_other(corpus):
    plan = load_plan(corpus)
    src = order(plan, 40)
    gone = [src["web"][i] for i in (0, 3, 4, 9, 17)]
    base = run(plan)
    quarantined = run(_with(plan, quarantine={"ids": gone}))
    q, b = quarantined["per"], base["per"]
    assert q["code"] == b["code"]  # every other source: its stream as it was
    assert [len(s) for s in q["web"]] == [len(s) for s in b["web"]]
    assert q["web"] == chunks([x for x in src["web"] if x not in gone], b["web"])
    assert not set(gone) & {x for s in q["web"] for x in s}
    assert b["web"] != q["web"]  # (the test can fail: the ids were in the stream)
    # counted, and held by the state
    stats = quarantined["stats"]["quarantine"]
    assert stats["samples"] == {"web": len(gone), "code": 0}
    assert quarantined["state"]["quarantine"] == [{"ids": gone, "files": [], "from_step": 0}]
    s = summarize(plan, quarantined["stats"], 0, STEPS, 0, 1.0, 0)
    assert s["quarantined_samples"] == {"web": len(gone), "code": 0}
    assert "quarantine" not in base["state"] and "quarantine" not in base["stats"]
    assert "quarantined_samples" not in summarize(plan, base["stats"], 0, STEPS, 0, 1.0, 0)


@pytest.mark.integration
def test_from_step_leaves_the_steps_before_it_as_they_were(corpus):
    plan = load_plan(corpus)
    src = order(plan, 40)
    base = run(plan)["per"]
    at = 5
    delivered = [x for s in base["web"][:at] for x in s]
    gone = [delivered[1], *src["web"][len(delivered) + 1 : len(delivered) + 4]]
    q = run(_with(plan, quarantine={"ids": gone, "from_step": at}))["per"]
    assert q["web"][:at] == base["web"][:at] and delivered[1] in q["web"][1] + q["web"][0]
    assert q["code"] == base["code"]
    rest = [x for x in src["web"][len(delivered) :] if x not in gone]
    assert q["web"][at:] == chunks(rest, base["web"][at:])


@pytest.mark.integration
def test_a_files_pattern_removes_every_sample_of_its_files(corpus):
    plan = load_plan(corpus)
    src = order(plan, 60)
    base = run(plan)["per"]
    q = run(_with(plan, quarantine={"files": ["data/web/*-2.jsonl"]}))["per"]
    assert q["code"] == base["code"]
    kept = [x for x in src["web"] if not x.startswith("data/web/part-2")]
    assert q["web"] == chunks(kept, base["web"])
    assert any(x.startswith("data/web/part-2") for s in base["web"] for x in s)


@pytest.mark.integration
def test_a_resume_keeps_the_quarantine_and_its_stream(corpus, tmp_path):
    plan = load_plan(corpus)
    gone = order(plan, 30)["web"][2:12:3]
    qplan = _with(plan, quarantine={"ids": gone, "from_step": 3})
    whole = run(qplan)["per"]
    first = run(qplan, steps=6)
    saved = checkpoint.load(checkpoint.save(tmp_path / "ckpt", first["state"]))
    assert saved["quarantine"] == [{"ids": gone, "files": [], "from_step": 3}]
    # resumed with the plan that has no quarantine section: the state's is in force
    second = run(plan, state=saved)
    for n in plan.source_names:
        assert first["per"][n] + second["per"][n] == whole[n]
    assert second["state"]["quarantine"] == saved["quarantine"]
    # the same plan again: its section equals the state's, nothing is added twice
    assert run(qplan, steps=8, state=saved)["state"]["quarantine"] == saved["quarantine"]


@pytest.mark.integration
def test_a_quarantine_added_at_a_resume_applies_from_the_resume_step(corpus):
    plan = load_plan(corpus)
    src = order(plan, 40)
    base = run(plan)
    first = run(plan, steps=4)
    delivered = [x for s in first["per"]["web"] for x in s]
    gone = [delivered[0], *src["web"][len(delivered) : len(delivered) + 3]]
    resumed = run(_with(plan, quarantine={"ids": gone}), state=first["state"])
    assert resumed["state"]["quarantine"] == [{"ids": gone, "files": [], "from_step": 4}]
    assert resumed["per"]["code"] == base["per"]["code"][4:]
    rest = [x for x in src["web"][len(delivered) :] if x not in gone]
    assert resumed["per"]["web"] == chunks(rest, base["per"]["web"][4:])


@pytest.mark.integration
def test_a_live_addition_refuses_a_planned_step_and_survives_a_planner_restart(corpus, tmp_path):
    plan = _with(load_plan(corpus), recovery={"journal_dir": str(tmp_path / "journal")})
    src = order(plan, 40)
    at, gone = 4, src["web"][14:20]
    seen: dict[str, Any] = {}

    def add(loader: Loader) -> None:
        with pytest.raises(LoaderError) as e:
            loader.quarantine([src["web"][20]], from_step=at - 1)  # consumed already
        seen["refused"] = str(e.value)
        seen["added"] = loader.quarantine(gone)  # from the first step not planned yet
        restart_planner(loader)  # a new planner resumes from the journal, quarantine and all

    live = run(plan, at=(at, add))
    found = re.search(r"the earliest step it can take effect is (\d+)", seen["refused"])
    assert found is not None and f"step {at - 1} is planned already" in seen["refused"]
    step = seen["added"]["from_step"]
    # planning runs at most prefetch_steps + 1 steps ahead of what every rank consumed
    assert at <= int(found[1]) <= step <= at + plan.batch.prefetch_steps + 1
    expected = run(_with(plan, quarantine={"ids": gone, "from_step": step}))
    assert live["per"] == expected["per"]
    assert live["state"]["quarantine"] == [{"ids": gone, "files": [], "from_step": step}]
    assert sum(len(s) for s in live["per"]["web"]) == sum(len(s) for s in expected["per"]["web"])


@pytest.mark.integration
def test_checkpoints_taken_after_a_live_addition_hold_it(corpus):
    plan = load_plan(corpus)
    gone = order(plan, 30)["web"][20:24]
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(2):
            for c in clients:
                next(c)
        added = loader.quarantine(gone, from_step=6)
        state = loader.state_dict()  # the state before step 2: planned before the addition
    assert state["step"] == 2 and added["from_step"] == 6
    assert state["quarantine"] == [{"ids": gone, "files": [], "from_step": 6}]
    assert (
        run(plan, state=state)["per"]
        == run(_with(plan, quarantine={"ids": gone, "from_step": 6}), state=state)["per"]
    )


def test_a_plan_without_quarantine_keeps_its_fingerprint(corpus):
    plan = load_plan(corpus)
    q = _with(plan, quarantine={"ids": ["data/web/part-0.jsonl:1"]})
    assert plan.quarantine is None and q.quarantine is not None
    assert q.stream_fingerprint() == plan.stream_fingerprint()  # the state records it instead


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"ids": ["data/web/part-0.jsonl"]}, "quarantine.ids"),
        ({"ids": ["data/web/part-0.jsonl:x"]}, "quarantine.ids"),
        ({"ids": [":3"]}, "quarantine.ids"),
        ({"from_step": -1}, "quarantine.from_step"),
        ({"files": [""]}, "quarantine.files"),
    ],
)
def test_a_malformed_quarantine_is_refused_with_its_field(corpus, bad, field):
    with pytest.raises(PlanError) as e:
        _with(load_plan(corpus), quarantine=bad)
    assert field in str(e.value)


@pytest.mark.integration
def test_ids_and_patterns_the_job_has_no_file_for_are_refused_naming_them(corpus):
    plan = load_plan(corpus)
    for bad, named in [
        ({"ids": ["data/web/part-9.jsonl:3"]}, "'data/web/part-9.jsonl:3'"),
        ({"files": ["data/nothing/*"]}, "'data/nothing/*'"),
    ]:
        with pytest.raises(PlanError) as e:
            Loader(_with(plan, quarantine=bad))
        assert named in str(e.value) and "quarantine" in str(e.value)
    with Loader(plan) as loader:
        for ids, files, step, named in [
            (["data/web/part-9.jsonl:3"], [], None, "no source of the job reads"),
            (["nocolon"], [], None, "malformed"),
            ([], ["zzz*"], None, "matches no file"),
            (["data/web/part-0.jsonl:1"], [], -1, "a step is 0 or more"),
            ([], [], None, "names no sample id"),
        ]:
            with pytest.raises(LoaderError, match=named):
                loader.quarantine(ids, files, from_step=step)
    # a state whose quarantine names a file the job lacks is refused before any role starts
    state = run(plan, steps=2)["state"]
    state["quarantine"] = [{"ids": ["data/web/gone.jsonl:1"], "files": [], "from_step": 0}]
    with pytest.raises(CheckpointError, match="gone.jsonl"):
        Loader(plan, state=state)


@pytest.mark.integration
def test_the_metric_is_part_of_the_contract_and_counts(corpus):
    plan = load_plan(corpus)
    gone = order(plan, 20)["web"][:3]
    assert METRICS["overlord_quarantined_samples_total"][0] == "counter"
    with Loader(_with(plan, quarantine={"ids": gone})) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(8):
            for c in clients:
                next(c)
        sources = loader.monitor()["sources"]
    assert sources["web"]["quarantined"] == 3 and sources["code"]["quarantined"] == 0


def test_parse_id_takes_urls_and_chunks_apart():
    assert parse_id("s3://b/x.jsonl:12#2") == ("s3://b/x.jsonl", 12, 2)
    assert parse_id("a.idx:0") == ("a.idx", 0, None)
    for bad in ("a.jsonl", "a.jsonl:-1", "a.jsonl:1#", "a.jsonl:1#x"):
        with pytest.raises(ValueError, match="malformed"):
            parse_id(bad)


@pytest.mark.ray
@pytest.mark.integration
def test_on_ray_the_command_quarantines_a_live_job(ray_session, corpus, monkeypatch):
    """``overlord quarantine JOB add``, in a process of its own, reaches the job's planner."""
    from conftest import overlord_cli

    plan = load_plan(corpus)
    src = order(plan, 40)
    gone = src["web"][16:22]
    at = 3
    step = at + plan.batch.prefetch_steps + 2  # not planned yet: ranks run at most that ahead
    job = "quarantine-live"
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    out: dict[str, list[list[str]]] = {n: [] for n in plan.source_names}
    with Loader(plan, runtime="ray", job=job) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for s in range(STEPS):
            if s == at:
                refused = overlord_cli("quarantine", job, "add", gone[0], "--from-step", "1")
                assert refused.returncode == 1, refused.stderr
                assert "step 1 is planned already" in refused.stderr
                assert "the earliest step it can take effect is" in refused.stderr
                bad = overlord_cli("quarantine", job, "add", "data/web/nope.jsonl:1")
                assert bad.returncode == 1 and "'data/web/nope.jsonl:1'" in bad.stderr
                added = overlord_cli("quarantine", job, "add", *gone, "--from-step", str(step))
                assert added.returncode == 0, added.stderr
                assert f"from step {step}" in added.stdout
            got: dict[str, list[str]] = {n: [] for n in plan.source_names}
            for c in clients:
                for x in next(c).samples:
                    got[x.source].append(x.id)
            for n in out:
                out[n].append(sorted(got[n]))
        listed = overlord_cli("quarantine", job, "list")
        assert listed.returncode == 0 and gone[0] in listed.stdout
        state = loader.state_dict()
        quarantined = loader.monitor()["sources"]["web"]["quarantined"]
    expected = run(_with(plan, quarantine={"ids": gone, "from_step": step}))
    assert out == expected["per"]
    assert state["quarantine"] == [{"ids": gone, "files": [], "from_step": step}]
    assert quarantined == expected["stats"]["quarantine"]["samples"]["web"] > 0


@pytest.mark.integration
def test_trainers_that_rewind_to_a_state_before_the_addition_keep_it(corpus):
    """A rewind goes back in the stream, never in the quarantine: it applies from its step."""
    from overlord.roles.api import PlannerRole
    from overlord.roles.client import Client
    from overlord.roles.rewind import Stamps

    plan = load_plan(corpus)
    # after step 7, ranks may ask up to prefetch_steps + 1 steps ahead: step 10 may be
    # planned, step 11 is not; the web samples of steps 11 on are 22 on in its order
    gone, step, steps = order(plan, 40)["web"][24:30], 11, 16
    want = run(_with(plan, quarantine={"ids": gone, "from_step": step}), steps=steps)["per"]
    assert want != run(plan, steps=steps)["per"]  # (the test can fail: they are trained)
    dp = plan.world.dp
    with Loader(plan) as loader:
        planner = loader.planner.obj  # type: ignore[attr-defined]
        planner.stamps = planner.consumption.stamps = Stamps(None)  # as a job on Ray does
        # and, as there, a build ahead of the rewind waits and is dropped, not raised at
        # the new clients (the builds of one process's ranks race the rewind otherwise)
        planner.wait_for_ranks = True
        clients = [loader.client(r) for r in range(dp)]
        early = None
        for s in range(8):
            for c in clients:
                next(c)
            if s == 2:
                early = clients[0].state_dict()  # the state before step 3: no quarantine
        assert early is not None and "quarantine" not in early
        loader._notices.flush()  # noqa: SLF001 - every rank consumed step 7: plan up to 10
        loader.planner.call(PlannerRole.rank_plan, step - 1, 0).result()
        with pytest.raises(LoaderError, match=f"earliest step it can take effect is {step}"):
            loader.quarantine(gone, from_step=step - 1)
        loader.quarantine(gone, from_step=step)
        for c in clients:
            c.close()
        for r in range(dp):
            assert loader.planner.call(PlannerRole.reconnect, r, early).result() == 3
        clients = [Client(r, loader._constructor_of[r], loader.planner, 3) for r in range(dp)]
        got: dict[str, list[list[str]]] = {n: [] for n in plan.source_names}
        for _ in range(3, steps):
            ids: dict[str, list[str]] = {n: [] for n in plan.source_names}
            for c in clients:
                for x in next(c).samples:
                    ids[x.source].append(x.id)
            for n in got:
                got[n].append(sorted(ids[n]))
        state = loader.state_dict()
    assert got == {n: v[3:] for n, v in want.items()}
    assert state["quarantine"] == [{"ids": gone, "files": [], "from_step": step}]


@pytest.mark.integration
def test_a_chunk_id_removes_that_chunk_and_a_record_id_all_of_its_chunks(tmp_path, make_corpus):
    """Records of three rows' length, split: an id with #k names one chunk."""
    long = [{"text": (f"r{i:03d} " + "y" * 4 * LEN)[: 3 * LEN - 1]} for i in range(20)]
    plan = load_plan(
        make_corpus(
            tmp_path,
            sources={"web": {"files": {"data/web/a.jsonl": long}}, "code": 30},
            batch={"tokens_per_step": 4 * LEN, "max_seq_len": LEN, "long_docs": "split"},
        )
    )
    base = run(plan, steps=8)["per"]
    web = [x for s in base["web"] for x in s]
    record = web[0].split("#")[0]
    chunk = next(x for x in web if x.split("#")[0] != record and x.endswith("#1"))
    q = run(_with(plan, quarantine={"ids": [record, chunk]}), steps=8)["per"]
    seen = [x for s in q["web"] for x in s]
    assert not [x for x in seen if x.split("#")[0] == record]
    assert chunk not in seen and chunk.replace("#1", "#0") in seen
    assert chunk.replace("#1", "#2") in seen


def test_the_rules_come_into_force_at_their_step_and_name_what_they_refuse():
    """The planner's part without a runtime: additions, their steps, each block's filter."""
    import numpy as np

    from overlord.roles.quarantine import Quarantine
    from overlord.sources.catalog import File, SourceFiles

    names = ("data/a/0.jsonl", "data/a/1.jsonl", "data/v/0.tar")
    files = {
        "a": SourceFiles("a", [(0, tuple(File(n, n, 1) for n in names[:2]))]),
        "v": SourceFiles("v", [(0, (File(names[2], names[2], 1),))]),
    }
    q = Quarantine(["a", "v"], files)
    assert not q.due(0) and q.dropper(0) is None  # nothing to do without an addition
    bad = {"ids": ["data/a/9.jsonl:1", "data/v/0.tar:3"], "files": ["x/*"], "from_step": 0}
    problems = q.problems(bad)
    assert len(problems) == 3
    assert "'data/a/9.jsonl:1'" in problems[0] and "by their key" in problems[1]
    assert "'x/*'" in problems[2]
    q.add({"ids": ["data/a/0.jsonl:2", "data/a/1.jsonl:5#1"], "files": [], "from_step": 3})
    q.add({"ids": [], "files": ["data/v/*"], "from_step": 5})
    assert not q.add({"ids": [], "files": ["data/v/*"], "from_step": 9})  # the same: not again
    assert q.due(0) and q.arm(0) == [] and q.dropper(0) is None
    assert not q.due(2) and q.due(3) and q.arm(3) == [0]
    drop = q.dropper(0)
    assert drop is not None and q.dropper(1) is None
    row, chunk = np.array([2, 5, 5, 7]), np.array([-1, 0, 1, -1])
    assert drop(0, 0, row, chunk).tolist() == [True, False, False, False]  # 0.jsonl: row 2
    assert drop(0, 1, row, chunk).tolist() == [False, False, True, False]  # 1.jsonl: 5#1
    assert drop(0, 1, np.array([1]), np.array([-1])) is None
    assert q.arm(5) == [1] and q.dropper(1)(0, 0, row, chunk).all()
