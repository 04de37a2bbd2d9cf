"""The planner's journal: its records, torn and corrupt ends, and replay to exact states."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_corpus
from overlord import Loader, load_plan
from overlord.plan.schedule import Schedule
from overlord.plan.spec import validate_plan
from overlord.state import format as statefmt
from overlord.state.journal import JournalError, decode, encode, read_segment, recover, segments


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("journal")
    sources = {
        "web": {"files": {f"data/web/part-{i}.jsonl": 15 + i for i in range(6)}, "loaders": 2},
        "code": {"files": {f"data/code/part-{i}.jsonl": 10 + i for i in range(4)}},
    }
    return make_corpus(
        root,
        sources,
        batch={"tokens_per_step": 512, "max_seq_len": 64, "prefetch_steps": 1},
        mixture={
            "schedule": [
                {"step": 0, "weights": {"web": 0.7, "code": 0.3}},
                {"step": 16, "weights": {"web": 0.3, "code": 0.7}},
            ]
        },
    )


def journal_of(plan_path: Path, tmp_path: Path, steps: int) -> tuple[Path, list[dict]]:
    """A journal left by a job that planned and consumed ``steps`` steps, and its states."""
    plan = load_plan(plan_path)
    data = plan.model_dump(mode="json")
    data["recovery"].update(journal_dir=str(tmp_path), snapshot_every=5)
    plan = validate_plan(data, base_dir=plan.base_dir)
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


@pytest.mark.integration
def test_the_journal_replays_to_the_exact_state_of_every_consumed_step(plan_path, tmp_path):
    path, states = journal_of(plan_path, tmp_path, 12)
    recovered = recover(path)
    plan = load_plan(plan_path)
    replayed, _ = statefmt.replay([(r.snapshot, r.deltas) for r in recovered], Schedule(plan).named)
    compared = [s for s in states if s["step"] in replayed]
    assert len(compared) >= 3  # the steps of the last segment (older ones were dropped)
    for s in compared:
        assert replayed[s["step"]]["sources"] == s["sources"]
    assert recovered[-1].consumed == 11
    assert len(segments(path)) <= 2  # older segments are dropped once consumed


@pytest.mark.integration
def test_a_torn_or_corrupt_record_is_rejected_with_its_place_and_the_rest_is_used(
    plan_path, tmp_path
):
    path, _ = journal_of(plan_path, tmp_path, 8)
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


@pytest.mark.integration
def test_a_delta_is_small(plan_path, tmp_path):
    path, _ = journal_of(plan_path, tmp_path, 9)
    records = [r for seg in segments(path) for r in read_segment(seg)[0]]
    deltas = [len(encode(r)) for r in records if r["t"] == "plan"]
    assert len(deltas) >= 4 and max(deltas) < 200  # two sources; the benchmark measures ten
