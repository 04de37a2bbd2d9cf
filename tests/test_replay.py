"""Replaying a step: what `overlord replay` and `overlord.replay` rebuild equals what trainers got.

The reference is always a run's own output: `overlord run --dump`'s lines and the
batches `Loader.client` handed out, for steps before and after a resume.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import overlord
from conftest import make_corpus, overlord_cli
from overlord.errors import OverlordError
from overlord.ops.replay import run_replay
from overlord.ops.run import run_plan
from overlord.replays import ReplayError
from overlord.state import checkpoint

FIELDS = ("input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens")


def _plan(root: Path, **over: Any) -> overlord.Plan:
    settings = {
        "batch": {"tokens_per_step": 256, "max_seq_len": 64},
        "world": {"dp": 2},
        "recovery": {"snapshot_every": 5},  # several segments: a replay crosses snapshots
        **over,
    }
    path = make_corpus(
        root,
        sources={
            "web": {"files": {f"data/web/part-{i}.jsonl": 30 for i in range(3)}},
            "code": {"files": {"data/code/part-0.parquet": 40}, "text_field": "content"},
        },
        **settings,
    )
    return overlord.load_plan(path)


def _run(plan: overlord.Plan, steps: int, folder: Path, state: Any = None) -> list[str]:
    """`overlord run --dump --checkpoint-dir folder --checkpoint-every 4`: its dump lines."""
    out = io.StringIO()
    run_plan(
        plan, steps, dump=out, checkpoint_dir=str(folder), checkpoint_every=4, state=state,
        progress=False,
    )  # fmt: skip
    return out.getvalue().splitlines()


def _replayed(where: Path | str, step: int, **kw: Any) -> list[str]:
    out = io.StringIO()
    run_replay(str(where), step, out, **kw)
    return out.getvalue().splitlines()


def _by_step(lines: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in lines:
        out.setdefault(json.loads(line)["step"], []).append(line)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[overlord.Plan, Path, dict]:
    """A run of steps 0..13, then a run resumed from its checkpoint at step 8 up to step 20.

    Returns the plan, the checkpoint folder and the dump lines by step (steps 8..13
    as the resumed run delivered them).
    """
    root = tmp_path_factory.mktemp("replay")
    plan = _plan(root)
    folder = root / "ckpt"
    first = _run(plan, 14, folder)
    state = checkpoint.load(folder / "step-00000008.json")
    second = _run(plan, 20, folder, state)
    lines = _by_step(first)
    lines.update(_by_step(second))
    return plan, folder, lines


def test_a_run_with_a_checkpoint_folder_keeps_its_journal_one_folder_per_run(resumed):
    _, folder, _ = resumed
    runs = sorted(p.name for p in (folder / "journal").iterdir())
    assert runs == ["run-0000", "run-0001"]
    for run in runs:  # every segment kept (snapshots every 5 steps), and the plan it ran
        segs = sorted(p.name for p in (folder / "journal" / run).glob("seg-*.log"))
        firsts = (0, 5, 10) if run == "run-0000" else (8, 10, 15)
        assert segs[:3] == [f"seg-{s:010d}.log" for s in firsts], segs
        assert json.loads((folder / "journal" / run / "plan.json").read_text())["plan"]["seed"]
    assert sorted(p.name for p in folder.glob("step-*.json"))[0] == "step-00000004.json"


@pytest.mark.parametrize("step", [0, 3, 7, 8, 12, 16, 19])
def test_a_replayed_step_is_the_dump_line_for_line(resumed, step):
    """Before the resume, at it and after it: the dump's line, then the placement."""
    _, folder, lines = resumed
    got = _replayed(folder, step)
    assert len(got) == len(lines[step]) == 2
    for mine, dumped in zip(got, lines[step]):
        assert mine.startswith(dumped[:-1] + ',"placement":[')  # the same keys and values first


def test_one_rank_and_the_text_as_the_trainer_received_it(resumed):
    plan, folder, lines = resumed
    (line,) = _replayed(folder, 11, rank=1, text=True)
    got = json.loads(line)
    assert line.startswith(lines[11][1][:-1])
    with overlord.Loader(plan, state=checkpoint.load(folder / "step-00000008.json")) as loader:
        clients = [loader.client(r) for r in range(2)]
        batch = [[next(c) for c in clients] for _ in range(4)][-1][1]
    for s, place, ids, text in zip(batch.samples, got["placement"], got["ids"], got["text"]):
        row, off = place["row"], place["offset"]
        assert row == s.row
        want = batch.input_ids[row, off : off + s.tokens]
        assert ids == want.tolist()
        # a document starts at its offset: its positions restart there
        assert batch.position_ids[row, off] == 0
        assert text == bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        assert s.id.split(":")[0].rsplit("/", 1)[-1].split(".")[0] in text  # its own text


def test_the_python_replay_is_the_clients_batches_arrays_and_all(resumed):
    plan, folder, _ = resumed
    state = checkpoint.load(folder / "step-00000012.json")
    with overlord.Loader(plan, state=state) as loader:
        clients = [loader.client(r) for r in range(2)]
        steps = [[next(c) for c in clients] for _ in range(6)]
    for step in (12, 17):
        got = overlord.replay(folder, step)
        want = steps[step - 12]
        assert [b.rank for b in got] == [0, 1]
        for g, w in zip(got, want):
            assert (g.step, g.samples, g.cost) == (w.step, w.samples, w.cost)
            for f in FIELDS:
                assert np.array_equal(getattr(g, f), getattr(w, f)), f


def test_from_checkpoints_alone_a_step_is_planned_forward(resumed, tmp_path):
    plan, folder, lines = resumed
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in folder.glob("step-*.json"):
        shutil.copy(p, bare / p.name)
    with pytest.raises(ReplayError, match=r"keeps no plan of its run: give the plan it ran"):
        _replayed(bare, 10)
    for step in (10, 15):  # from the checkpoints at 8 and 12, planned two and three steps
        got = _replayed(bare, step, plan=plan)
        assert [g.split(',"placement"')[0] + "}" for g in got] == lines[step]
    # a kept run's plan.json (its segments gone) is found by the checkpoint's fingerprint
    shutil.copytree(folder / "journal", bare / "journal")
    for seg in (bare / "journal").rglob("seg-*.log"):
        seg.unlink()
    got = _replayed(bare, 10)
    assert [g.split(',"placement"')[0] + "}" for g in got] == lines[10]


def test_a_mesh_replays_every_global_rank(tmp_path):
    plan = _plan(tmp_path, world={"dp": 2, "cp": 2, "tp": 2}, batch={
        "tokens_per_step": 256, "max_seq_len": 64, "cp_layout": "zigzag"})  # fmt: skip
    folder = tmp_path / "ckpt"
    lines = _by_step(_run(plan, 6, folder))
    with overlord.Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        steps = [[next(c) for c in clients] for _ in range(6)]
    got = overlord.replay(folder, 4)
    assert len(got) == plan.world.size == 8
    for g, w in zip(got, steps[4]):
        assert (g.rank, g.cp_rank, g.samples) == (w.rank, w.cp_rank, w.samples)
        assert np.array_equal(g.input_ids, w.input_ids)
    assert [r.split(',"placement"')[0] + "}" for r in _replayed(folder, 4)] == lines[4]
    with pytest.raises(ReplayError, match="--text: rank 0's batch holds no whole rows"):
        _replayed(folder, 4, text=True)


def test_a_pre_tokenized_source_shows_its_token_ids(tmp_path):
    rng = np.random.default_rng(3)
    docs = [np.append(rng.integers(3, 900, rng.integers(5, 60)), 2) for _ in range(200)]
    np.save(tmp_path / "a.npy", np.concatenate(docs).astype(np.int32))
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({
        "seed": 5,
        "sources": [{"name": "tok", "path": "a.npy", "format": "tokens", "eos_id": 2}],
        "batch": {"tokens_per_step": 256, "max_seq_len": 64},
        "world": {"dp": 2},
    }))  # fmt: skip
    plan = overlord.load_plan(tmp_path / "plan.yaml")
    folder = tmp_path / "ckpt"
    lines = _by_step(_run(plan, 5, folder))
    got = [json.loads(line) for line in _replayed(folder, 3, text=True)]
    flat = np.concatenate(docs)
    for line, dumped in zip(got, lines[3]):
        assert line["samples"] == json.loads(dumped)["samples"]
        assert line["text"] == [None] * len(line["samples"])
        for ids in line["ids"]:  # each sample's ids are a run of the file's own tokens
            hits = np.flatnonzero(flat[: len(flat) - len(ids) + 1] == ids[0])
            assert any(np.array_equal(flat[h : h + len(ids)], ids) for h in hits)


def test_bad_input_is_named(resumed, tmp_path):
    plan, folder, _ = resumed
    with pytest.raises(ReplayError, match=r"step 20 is not in .*range: run-0001: steps 8\.\."):
        _replayed(folder, 20)
    with pytest.raises(ReplayError, match="steps count from 0"):
        _replayed(folder, -1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReplayError, match="holds no checkpoint .* and no kept journal"):
        _replayed(empty, 3)
    with pytest.raises(ReplayError, match="no folder ./nowhere"):
        _replayed("./nowhere", 3)
    with pytest.raises(ReplayError, match="no job named 'no-such-job' served on this machine"):
        _replayed("no-such-job", 3)
    with pytest.raises(ReplayError, match="is a file"):
        _replayed(folder / "step-00000004.json", 3)
    with pytest.raises(ReplayError, match=r"--rank 2 is outside the run's world: dp=2"):
        _replayed(folder, 3, rank=2)


def test_a_missing_source_file_is_named(tmp_path):
    plan = _plan(tmp_path)
    folder = tmp_path / "ckpt"
    _run(plan, 4, folder)
    (tmp_path / "data/web/part-1.jsonl").unlink()
    with pytest.raises(OverlordError, match="part-1.jsonl"):
        _replayed(folder, 2)


def test_the_command_writes_the_lines_to_a_file(resumed, tmp_path):
    _, folder, lines = resumed
    out = tmp_path / "r.jsonl"
    done = overlord_cli("replay", str(folder), "--step", "9", "--rank", "0", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (line,) = out.read_text().splitlines()
    assert line.startswith(lines[9][0][:-1])
    done = overlord_cli("replay", str(folder), "--step", "99")
    assert done.returncode == 1
    assert "overlord: step 99 is not in" in done.stderr


@pytest.mark.ray
@pytest.mark.integration
def test_a_live_job_replays_by_name(ray_session, tmp_path):
    """A job on Ray, replayed by its name: a step its planner still keeps, one only its journal
    holds, and one not planned yet."""
    plan = _plan(
        tmp_path,
        batch={"tokens_per_step": 256, "max_seq_len": 64, "prefetch_steps": 1},
        recovery={"snapshot_every": 100},  # the live job's journal holds every step from 0
    )
    address = ray_session.get_runtime_context().gcs_address
    with overlord.Loader(plan, runtime="ray", job="t-replay") as loader:
        clients = [loader.client(r) for r in range(2)]
        steps = [[next(c) for c in clients] for _ in range(12)]
        for step in (11, 2):  # kept by the planner (not every rank consumed it); journal only
            got = overlord.replay("t-replay", step, address=address)
            for g, w in zip(got, steps[step]):
                assert (g.step, g.rank, g.samples) == (w.step, w.rank, w.samples)
                for f in FIELDS:
                    assert np.array_equal(getattr(g, f), getattr(w, f)), f
        with pytest.raises(ReplayError, match="step 40 of job 't-replay' is not planned yet"):
            overlord.replay("t-replay", 40, address=address)


def test_a_resume_on_another_dp_size_replays_with_its_own_ranks(tmp_path):
    """Each run's journal keeps its own plan: the steps of a run resumed on 4 ranks have 4."""
    plan = _plan(tmp_path)
    folder = tmp_path / "ckpt"
    first = _by_step(_run(plan, 6, folder))
    second = _by_step(
        _run(plan.with_dp(4), 10, folder, checkpoint.load(folder / "step-00000004.json"))
    )
    for step, lines in ((3, first[3]), (4, second[4]), (9, second[9])):
        got = _replayed(folder, step)
        assert len(got) == len(lines) == (2 if step < 4 else 4)
        assert [g.split(',"placement"')[0] + "}" for g in got] == lines


def test_the_text_of_an_hf_tokenizer_is_its_records_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "data": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    rng = np.random.default_rng(1)
    words = ["hello", "world", "data"]
    texts = [" ".join(rng.choice(words, rng.integers(3, 20))) for _ in range(300)]
    path = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": [{"text": t} for t in texts]}}},
        tokenizer={"kind": "hf", "path": "tok.json", "eos": "</s>"},
        batch={"tokens_per_step": 256, "max_seq_len": 64},
        world={"dp": 2},
    )
    folder = tmp_path / "ckpt"
    _run(overlord.load_plan(path), 6, folder)
    lines = [json.loads(line) for line in _replayed(folder, 4, text=True)]
    seen = 0
    for line in lines:
        for s, text in zip(line["samples"], line["text"]):
            row = int(s["id"].split(":")[1])  # whole documents: no '#k' chunk
            assert text == texts[row] + " </s>"
            seen += 1
    assert seen > 4


def test_replay_is_exact_across_a_mixture_change_and_a_quarantine(tmp_path):
    """A run, then a resume with a source added, new weights and a quarantine from a step on.

    Every step of both runs (before the resume, between it and the quarantine, after
    it) replays as the trainers' dump of it.
    """
    from conftest import write_file

    plan = _plan(tmp_path)
    folder = tmp_path / "ckpt"
    first = _by_step(_run(plan, 10, folder))
    write_file(tmp_path / "data/books/part-0.jsonl", 30, "text", "books/part-0")
    data = plan.model_dump(mode="json")
    data["sources"].append({"name": "books", "path": "data/books/*", "format": "jsonl"})
    data["mixture"] = {"schedule": [{"step": 0, "weights": {"web": 1, "code": 1, "books": 2}}]}
    state = checkpoint.load(folder / "step-00000008.json")
    free = _by_step(_run(overlord.validate_plan(data, base_dir=tmp_path), 16, tmp_path / "free",
                         state))  # fmt: skip
    later = [json.loads(x) for st in range(11, 16) for x in free[st]]  # taken without it
    ids = [s["id"] for line in later for s in line["samples"] if s["source"] == "web"][:3]
    assert len(ids) == 3
    data["quarantine"] = {"ids": ids, "from_step": 11}
    changed = overlord.validate_plan(data, base_dir=tmp_path)
    second = _by_step(_run(changed, 16, folder, state))
    assert any(s["source"] == "books" for x in second[9] for s in json.loads(x)["samples"])
    for step in (3, 7):
        assert [x.split(',"placement"')[0] for x in _replayed(folder, step)] == [
            x[:-1] for x in first[step]
        ]
    for step in (8, 10, 11, 15):  # the resumed run's steps, before and after the quarantine
        assert [x.split(',"placement"')[0] for x in _replayed(folder, step)] == [
            x[:-1] for x in second[step]
        ]
    taken = {s["id"] for st in range(11, 16) for x in second[st] for s in json.loads(x)["samples"]}
    assert not taken & set(ids)
    assert second[10] == free[10]  # before the quarantine's step, the stream without it
