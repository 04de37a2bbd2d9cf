"""Changing the mixture mid-run: a resume with a changed plan, each change allowed or refused.

Every document of the corpus is 63 bytes, 64 tokens with its end of
document, one whole row of ``max_seq_len`` 64: no item is ever skipped for
want of room, so each source's samples arrive in its own order, and the
stream of a source can be compared run against run as one sequence of ids.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import make_corpus
from overlord import Loader, checkpoint, load_plan
from overlord.errors import CheckpointError, LoaderError
from overlord.ops.cli import main
from overlord.plan.spec import Plan, validate_plan
from overlord.state import format as statefmt
from overlord.state.changes import DROPPED, classify, refused

STEPS, MORE = 4, 6  # steps before the checkpoint, and after it


def _docs(tag: str, n: int) -> list[dict[str, Any]]:
    return [{"text": (f"{tag} document {i:03d} " + "x" * 63)[:63]} for i in range(n)]


@pytest.fixture(name="plan", scope="module")
def _plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    root = tmp_path_factory.mktemp("remix")
    path = make_corpus(
        root,
        {
            name: {"files": {f"data/{name}/{k}.jsonl": _docs(f"{name}{k}", 40) for k in "ab"}}
            for name in ("web", "code", "books", "news")
        },
        batch={"tokens_per_step": 512, "max_seq_len": 64},
        world={"dp": 1},
        balance={"method": "none"},
        mixture={"schedule": [{"step": 0, "weights": {"web": 2, "code": 1, "books": 1}}]},
    )
    return load_plan(path)


def _edit(plan: Plan, **changes: Any) -> Plan:
    """``plan`` with top-level sections replaced; ``sources=`` a function of the source list."""
    data = plan.model_dump(mode="json")
    for key, value in changes.items():
        data[key] = value(data[key]) if callable(value) else value
    return validate_plan(data, base_dir=plan.base_dir)


def _without_news(plan: Plan) -> Plan:
    return _edit(plan, sources=lambda ss: [s for s in ss if s["name"] != "news"])


def run(plan: Plan, steps: int, state: dict[str, Any] | None = None) -> tuple[list[Any], Any]:
    """Every step's samples as (source, id) in batch order, and the state after them."""
    out = []
    with Loader(plan, state=state) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(steps):
            out.append([(s.source, s.id) for c in clients for s in next(c).samples])
        return out, json.loads(json.dumps(loader.state_dict()))


def per_source(steps: list[Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for step in steps:
        for source, sample in step:
            out.setdefault(source, []).append(sample)
    return out


def same_stream(changed: list[str], reference: list[str]) -> None:
    """One source's ids after a change are its ids without it, as far as both reach."""
    n = min(len(changed), len(reference))
    assert n >= 4, "too few samples to compare"
    assert changed[:n] == reference[:n]


@pytest.fixture(name="before", scope="module")
def _before(plan: Plan) -> tuple[list[Any], dict[str, Any], dict[str, list[str]]]:
    """The plan without 'news': its first steps, its state, and every source's stream."""
    base = _without_news(plan)
    first, state = run(base, STEPS)
    whole, _ = run(base, STEPS + 2 * MORE)
    assert whole[:STEPS] == first
    return first, state, per_source(whole[STEPS:])


def _two_points(steps: int) -> dict[str, Any]:
    first, then = {"web": 2, "code": 1, "books": 1}, {"web": 1, "code": 3, "books": 1}
    return {"schedule": [{"step": 0, "weights": first}, {"step": steps, "weights": then}]}


ALLOWED = {
    "a new schedule": lambda p: _edit(p, mixture=_two_points(STEPS)),
    "tokens per step": lambda p: _edit(p, batch={**p.batch.model_dump(mode="json"),
                                                 "tokens_per_step": 256}),  # fmt: skip
    "the mesh": lambda p: _edit(p, world={"dp": 2}),
    "loading and autoscale": lambda p: _edit(
        p, loading={**p.loading.model_dump(mode="json"), "threads": 2},
        autoscale={**p.autoscale.model_dump(mode="json"), "every": 3},
    ),
    "a source's loaders": lambda p: _edit(
        p, sources=lambda ss: [{**s, "loaders": 2} if s["name"] == "web" else s for s in ss]
    ),
    "a source added": lambda p: _edit(
        p, mixture={"schedule": [{"step": 0, "weights": {"web": 2, "code": 1, "books": 1,
                                                           "news": 2}}]},  # fmt: skip
    ),
    "a source removed": lambda p: _edit(
        p,
        sources=lambda ss: [s for s in ss if s["name"] != "books"],
        mixture={"schedule": [{"step": 0, "weights": {"web": 2, "code": 1}}]},
    ),
}


@pytest.mark.parametrize("change", list(ALLOWED))
def test_an_allowed_change_resumes_and_every_kept_source_continues_its_stream(
    plan: Plan, before: Any, change: str
) -> None:
    first, state, reference = before
    new = ALLOWED[change](_without_news(plan) if change != "a source added" else plan)
    changes = classify(state, new, before=_without_news(plan))
    assert changes and not refused(changes), [c.line() for c in changes]
    after, _ = run(new, MORE, state)
    streams = per_source(after)
    kept = [n for n in new.source_names if n in state["sources"]]
    for name in kept:
        same_stream(streams[name], reference[name])
    assert set(streams) <= set(new.source_names)


def test_the_reference_is_each_source_alone(plan: Plan, before: Any) -> None:
    """The per-source comparison means something: a source's stream is its own order."""
    _, _, reference = before
    alone = _edit(_without_news(plan), mixture=None,
                  sources=lambda ss: [s for s in ss if s["name"] == "code"])  # fmt: skip
    steps, _ = run(alone, STEPS + 6)
    ids = per_source(steps)["code"]
    first_ids = per_source(before[0])["code"]
    same_stream(ids, first_ids + reference["code"])


def test_an_added_source_starts_at_its_epoch_0(plan: Plan, before: Any) -> None:
    _, state, _ = before
    after, later = run(ALLOWED["a source added"](plan), MORE, state)
    news = per_source(after)["news"]
    alone = _edit(plan, mixture=None, sources=lambda ss: [s for s in ss if s["name"] == "news"])
    fresh, _ = run(alone, 8)
    same_stream(news, per_source(fresh)["news"])
    assert later["sources"]["news"]["cursor"]["epoch"] == 0
    line = next(c.line() for c in classify(state, ALLOWED["a source added"](plan)))
    assert line.startswith("allowed  sources.news:") and f"epoch 0 from step {STEPS}" in line
    assert DROPPED not in later  # nothing removed: the state is as it always was


def test_a_removed_source_is_dropped_and_recorded(plan: Plan, before: Any, tmp_path: Path) -> None:
    _, state, _ = before
    new = ALLOWED["a source removed"](_without_news(plan))
    after, later = run(new, 2, state)
    assert "books" not in later["sources"] and "books" not in per_source(after)
    assert later[DROPPED] == [{"source": "books", "step": STEPS}]
    # the record survives a checkpoint and another resume
    checkpoint.save(tmp_path, later)
    _, again = run(new, 1, checkpoint.load(tmp_path))
    assert again[DROPPED] == [{"source": "books", "step": STEPS}]
    # and a journal's deltas: apply carries it from step to step
    half = dict.fromkeys(later["sources"], 0.5)
    moved = statefmt.apply(later, {"c": {}, "p": {}}, lambda s: half)
    assert moved[DROPPED] == later[DROPPED]
    # back again: it starts over, and its removal stays in the record
    back = _edit(new, sources=lambda ss: ss + [s for s in plan.model_dump(mode="json")["sources"]
                                                if s["name"] == "books"])  # fmt: skip
    line = next(c.line() for c in classify(later, back) if c.field == "sources.books")
    assert f"dropped at step {STEPS}: it starts over" in line
    _, third = run(back, 1, later)
    assert third["sources"]["books"]["cursor"]["epoch"] == 0
    assert third[DROPPED] == [{"source": "books", "step": STEPS}]


def _source(which: str, **fields: Any) -> Any:
    return lambda ss: [{**s, **fields} if s["name"] == which else s for s in ss]


REFUSED = {
    # change, the field a resume names, the old value, the new value
    "path": (dict(sources=_source("web", path="data/news/*")), "sources.web.path",
             "data/web/*", "data/news/*"),
    "text field": (dict(sources=_source("code", text_field="body")), "sources.code.text_field",
                   "text", "body"),
    "format": (dict(sources=_source("web", format="parquet")), "sources.web.format",
               "jsonl", "parquet"),
    "transform": (dict(sources=_source("web", transform="overlord.sources.transforms:zlib_json")),
                  "sources.web.transform", None, "overlord.sources.transforms:zlib_json"),
    "seed": (dict(seed=99), "seed", 1234, 99),
    "max_seq_len": (dict(batch={"tokens_per_step": 512, "max_seq_len": 128}),
                    "batch.max_seq_len", 64, 128),
    "shuffle": (dict(shuffle={"block_bytes": 4096, "window_blocks": 2}),
                "shuffle.window_blocks", 8, 2),
    "tokenizer": (dict(tokenizer={"kind": "hf", "path": "tokenizer.json"}), "tokenizer.kind",
                  "bytes", "hf"),
}  # fmt: skip


@pytest.mark.parametrize("change", list(REFUSED))
def test_a_refused_change_names_the_field_its_values_and_what_to_do(
    plan: Plan, before: Any, change: str
) -> None:
    _, state, _ = before
    old = _without_news(plan)
    edits, field, was, now = REFUSED[change]
    new = _edit(old, **edits)
    named = refused(classify(state, new, before=old))
    assert field in [c.field for c in named], [c.line() for c in named]
    c = next(c for c in named if c.field == field)
    assert (c.old, c.new) == (was, now)
    assert "set it back" in c.why and "new name" in c.why
    # without the old plan, a resume still refuses, naming each source read another way
    with pytest.raises(CheckpointError, match=r"refused  sources\.(web|code): fingerprint"):
        Loader(new, state=state)


def test_a_checkpoint_of_another_plan_sharing_no_source_is_refused(plan: Plan, before: Any) -> None:
    _, state, _ = before
    other = _edit(plan, sources=lambda ss: [s for s in ss if s["name"] == "news"], mixture=None)
    (only,) = classify(state, other)
    assert not only.allowed and "shares no source with this plan" in only.why
    with pytest.raises(CheckpointError, match="shares no source"):
        Loader(other, state=state)


def test_a_renamed_source_is_a_removal_and_an_addition(plan: Plan, before: Any) -> None:
    _, state, _ = before
    renamed = _edit(
        _without_news(plan),
        sources=_source("books", name="library"),
        mixture={"schedule": [{"step": 0, "weights": {"web": 2, "code": 1, "library": 1}}]},
    )
    lines = {c.field: c.line() for c in classify(state, renamed)}
    assert "a rename to 'library' is a removal and an addition" in lines["sources.books"]
    assert "keep the name 'books' to continue its order" in lines["sources.books"]
    assert "a rename of 'books'" in lines["sources.library"]
    after, later = run(renamed, 2, state)
    assert later[DROPPED] == [{"source": "books", "step": STEPS}]
    assert later["sources"]["library"]["cursor"]["epoch"] == 0


def test_a_schedule_that_starts_after_the_resume_step_is_refused(plan: Plan, before: Any) -> None:
    _, state, _ = before
    late = _edit(_without_news(plan), mixture={"schedule": [
        {"step": STEPS + 5, "weights": {"web": 1, "code": 1, "books": 1}}]})  # fmt: skip
    named = refused(classify(state, late))
    assert [c.field for c in named] == ["mixture.schedule[0].step"]
    assert f"add a point at step {STEPS} or earlier" in named[0].why
    with pytest.raises(CheckpointError, match="after the resume step"):
        Loader(late, state=state)
    # the same schedule from the resume step on is allowed
    assert not refused(classify(state, _edit(late, mixture=_two_points(STEPS))))


def test_an_unchanged_plan_has_no_change_and_its_state_is_untouched(
    plan: Plan, before: Any
) -> None:
    _, state, _ = before
    old = _without_news(plan)
    assert classify(state, old) == [] and classify(state, old, before=old) == []
    assert DROPPED not in state


def test_a_bad_dropped_record_is_refused_naming_it(plan: Plan, before: Any) -> None:
    _, state, _ = before
    bad = {**copy.deepcopy(state), DROPPED: [{"source": "books", "step": -1}]}
    with pytest.raises(CheckpointError, match="dropped: expected"):
        Loader(_without_news(plan), state=bad)


def _diff(*args: str) -> tuple[int, str]:
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["diff", *args])
    return code, out.getvalue()


def _write(plan: Plan, path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(plan.model_dump(mode="json", exclude_none=True)))
    return path


def test_overlord_diff_prints_each_change_and_fails_when_one_is_refused(
    plan: Plan, before: Any
) -> None:
    _, state, _ = before
    root = plan.base_dir
    old = _without_news(plan)
    checkpoint.save(root / "ckpt", state)
    was = _write(old, root / "was.yaml")
    grown = _write(ALLOWED["a source added"](plan), root / "grown.yaml")
    code, out = _diff(str(root / "ckpt"), str(grown))
    assert code == 0
    assert f"step-{STEPS:08d}.json (step {STEPS}, sources web, code, books)" in out
    assert "allowed  sources.news: (none) -> in the plan: added" in out
    assert out.rstrip().endswith("1 allowed, 0 refused")
    reseeded = _write(_edit(ALLOWED["a source removed"](old), seed=5), root / "reseeded.yaml")
    gone = _write(_edit(old, sources=_source("books", path="data/gone/*")), root / "gone.yaml")
    code, out = _diff(str(root / "ckpt"), str(reseeded), "--was", str(gone))  # its files gone
    assert "refused  seed: 1234 -> 5" in out
    code, out = _diff(str(root / "ckpt"), str(reseeded), "--was", str(was))
    assert code == 1
    assert "allowed  sources.books: in the checkpoint -> (none): removed" in out
    assert "refused  seed: 1234 -> 5: it decides the items of 'web', 'code'" in out
    assert "1 refused" in out and "the plan cannot resume this checkpoint" in out
    same = _write(old, root / "o.yaml")
    code, out = _diff(str(root / "ckpt" / f"step-{STEPS:08d}.json"), str(same))
    assert code == 0 and "no change" in out


def test_overlord_diff_names_a_recorded_file_that_changed(plan: Plan, tmp_path: Path) -> None:
    root = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": _docs("w", 8),
                                                    "data/web/b.jsonl": _docs("v", 8)}}},
                       world={"dp": 1})  # fmt: skip
    _, state = run(load_plan(root), 1)
    checkpoint.save(tmp_path / "ckpt", state)
    (tmp_path / "data/web/b.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    code, out = _diff(str(tmp_path / "ckpt"), str(root))
    assert code == 1
    assert "refused  files: as recorded -> changed: source 'web': file data/web/b.jsonl" in out


def test_a_trainer_reconnects_to_a_resumed_job_with_the_checkpoint_of_before_the_change(
    job_plan: Path,
) -> None:
    """A job served from a checkpoint with a source removed takes that checkpoint back."""
    from overlord.monitor.figures import Figures
    from overlord.roles.consumption import Consumption
    from overlord.roles.ledger import Ledger
    from overlord.roles.rewind import Stamps

    plan = _edit(load_plan(job_plan), sources=lambda ss: [s for s in ss if s["name"] == "web"])
    web = {
        "fingerprint": plan.source_fingerprint("web"),
        "cursor": {"epoch": 0, "shard_pos": 0, "index": 3, "skip": []},
        "placed": 192.0,
        "target": 192.0,
    }
    ledger = Ledger(plan, {})
    dropped = [{"source": "code", "step": 3}]
    ledger.restart(3, {"step": 3, "sources": {"web": web}, DROPPED: dropped})
    rewound: list[int] = []
    consumption = Consumption(
        plan, Figures(plan.source_names, 1), ledger, planned=lambda: 3,
        settle=lambda before, done: None, rewind=lambda s: rewound.append(int(s["step"])),
        stamps=Stamps(None),
    )  # fmt: skip
    consumption.restart(3)
    consumption.origin = ledger.at(3)
    code = {**web, "fingerprint": "0" * 16}  # the removed source, as the old plan read it
    old = {"version": statefmt.STATE_VERSION, "fingerprint": "1" * 16, "step": 3,
           "sources": {"web": web, "code": code}}  # fmt: skip
    assert consumption.reconnect(0, old) == 3 and rewound == [3]
    ahead = {**web, "cursor": {**web["cursor"], "index": 4}}  # not where the job started
    moved = {**old, "sources": {**old["sources"], "web": ahead}}
    with pytest.raises(LoaderError, match="carries no stamp of this job"):
        consumption.reconnect(0, moved)


def test_a_client_of_a_resumed_loader_accepts_the_checkpoint_it_started_from(
    plan: Plan, before: Any
) -> None:
    _, state, _ = before
    new = ALLOWED["a source removed"](_without_news(plan))
    with Loader(new, state=state) as loader:
        client = loader.client(0)
        client.load_state_dict(state)  # the position it started from: nothing to do
        next(client)
        with pytest.raises(CheckpointError, match=r"expected 4 \(checkpoint\), found 5"):
            client.load_state_dict(state)
        client.close()


def test_a_planner_restarted_from_its_journal_keeps_the_record_of_a_removed_source(
    plan: Plan, before: Any, tmp_path: Path
) -> None:
    from support.jobs import restart_planner, run_job

    _, state, _ = before
    new = ALLOWED["a source removed"](_without_news(plan))
    journal = {**new.recovery.model_dump(mode="json"), "journal_dir": str(tmp_path)}
    new = _edit(new, recovery=journal)
    plain = run_job(new, steps=STEPS + 4, state=state)
    restarted = run_job(new, {(STEPS + 2, 0): restart_planner}, steps=STEPS + 4, state=state)
    # the restart as the planner records it (its log line depends on the logging set-up
    # that other tests leave behind)
    assert any(e.get("event") == "planner-recovered" for e in restarted.stats["events"])
    assert restarted.lines == plain.lines
    assert restarted.state[DROPPED] == plain.state[DROPPED] == [{"source": "books", "step": STEPS}]


@pytest.mark.ray
@pytest.mark.integration
def test_a_job_on_ray_resumed_with_a_changed_plan_takes_trainers_with_the_old_checkpoint(
    ray_session: Any, plan: Plan, before: Any
) -> None:
    from overlord import connect
    from overlord.ops.run import dump_line

    _, state, _ = before
    new = _edit(ALLOWED["a source removed"](_without_news(plan)), world={"dp": 2})
    want = []
    with Loader(new, state=state) as loader:
        local = [loader.client(r) for r in range(2)]
        want = [dump_line(next(c)) for _ in range(3) for c in local]
    with Loader(new, runtime="ray", job="t-remix", state=state):
        clients = [connect("t-remix", rank=r, state=state, stop_step=STEPS + 3) for r in range(2)]
        got = [dump_line(next(c)) for _ in range(3) for c in clients]
        after = clients[0].state_dict()
        for c in clients:
            c.close()
    assert got == want
    assert after[DROPPED] == [{"source": "books", "step": STEPS}]


def test_a_run_with_a_checkpoint_folder_names_a_refused_field_without_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the run keeps its plan beside its journal: diff and run --resume name the field
    root = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": _docs("w", 16)}}},
        batch={"tokens_per_step": 128, "max_seq_len": 64},
        world={"dp": 1},
    )
    ckpt = tmp_path / "ckpt"
    assert main(["run", str(root), "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    data = load_plan(root).model_dump(mode="json")
    data["sources"][0]["text_field"] = "body"
    changed = _write(validate_plan(data, base_dir=tmp_path), tmp_path / "changed.yaml")
    code, out = _diff(str(ckpt), str(changed))
    assert code == 1
    assert "refused  sources.web.text_field: text -> body" in out
    capsys.readouterr()
    assert main(["run", str(changed), "--steps", "4", "--resume", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "sources.web.text_field: text -> body" in err
