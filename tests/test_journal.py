"""The planner's journal: its records, torn ends, refused edits, and replay to exact states."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from conftest import make_corpus
from overlord import Loader, load_plan
from overlord.plan.schedule import Schedule
from overlord.plan.spec import validate_plan
from overlord.state import format as statefmt
from overlord.state import journal as journal_module
from overlord.state.journal import (
    SEED,
    Journal,
    JournalError,
    decode,
    encode,
    read_segment,
    recover,
    resume,
    segments,
)


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
def test_a_torn_last_record_is_skipped_with_its_place_and_the_rest_is_used(plan_path, tmp_path):
    path, _ = journal_of(plan_path, tmp_path, 8)
    seg = segments(path)[-1]
    records, end, problem = read_segment(seg)
    assert problem is None and records[0]["t"] == "snap"
    data = seg.read_bytes()
    assert data.startswith(encode(journal_module.header(int(seg.name[4:-4])), SEED))
    # a torn last record: the writer died in the middle of it
    seg.write_bytes(data[:-7])
    with pytest.raises(JournalError, match=r"record \d+ at byte \d+: torn record"):
        read_segment(seg)
    got = recover(path)[-1]
    assert "torn record" in got.problems[0] and "records before it are used" in got.problems[0]
    # every record but the torn last one is used
    assert got.deltas == [r["d"] for r in records[:-1] if r["t"] == "plan"]
    assert got.consumed == max(r["s"] for r in records[:-1] if r["t"] == "cons")


def edits(data: bytes) -> dict[str, bytes]:
    """Damaged copies of a segment's bytes, each a whole file of whole lines."""
    lines = data.splitlines(keepends=True)
    digest, _, text = lines[2][:-1].partition(b" ")
    flipped = bytearray(data)
    flipped[len(lines[0]) + len(lines[1]) + 40] ^= 0x01
    return {
        # a field's text edited, its digest left: what a hand edit of a number does
        "a field edited": b"".join(
            [*lines[:2], digest + b" " + text.replace(b'"s":', b'"s": '), b"\n", *lines[3:]]
        ),
        "one byte flipped": bytes(flipped),
        "a record deleted": b"".join([*lines[:2], *lines[3:]]),
        "two records swapped": b"".join([*lines[:2], lines[3], lines[2], *lines[4:]]),
        "header version": lines[0].replace(b'"journal":2', b'"journal":3') + b"".join(lines[1:]),
    }


@pytest.mark.integration
@pytest.mark.parametrize(
    "kind",
    [
        "a field edited",
        "one byte flipped",
        "a record deleted",
        "two records swapped",
        "header version",
    ],  # fmt: skip
)
def test_a_damaged_record_refuses_the_journal_naming_file_record_and_field(
    plan_path, tmp_path, kind
):
    path, _ = journal_of(plan_path, tmp_path, 8)
    seg = segments(path)[-1]
    assert len(seg.read_bytes().splitlines()) >= 5
    seg.write_bytes(edits(seg.read_bytes())[kind])
    with pytest.raises(JournalError) as caught:
        recover(path)
    message = str(caught.value)
    assert f"journal {seg}, record " in message
    assert "field 'digest'" in message or "field 'journal'" in message
    with pytest.raises(JournalError):  # and a restarted planner does not resume from it
        resume(path, {})


def test_an_edit_whose_crc_is_fixed_is_caught_by_the_chained_digest(tmp_path):
    rec = {"t": "plan", "s": 7, "d": {"p": {"web": 448}}}
    line = encode(rec, SEED)
    forged = json.dumps({**rec, "d": {"p": {"web": 449}}}, separators=(",", ":")).encode()
    # a format-1 line with a fixed CRC reads; the same text under a chain digest does not
    assert decode(f"{zlib.crc32(forged):08x} ".encode() + forged + b"\n", "here")["s"] == 7
    with pytest.raises(JournalError, match="here: field 'digest': expected"):
        decode(line[:33] + forged + b"\n", "here", SEED)
    assert decode(line, "here", SEED) == rec


def legacy_segment(path: Path, records: list[dict]) -> None:
    """A segment as the journal wrote it before its header and chain: a CRC-32 per line."""
    path.write_bytes(b"".join(encode(r) for r in records))


def test_a_journal_written_before_the_chain_still_reads_and_resumes(tmp_path):
    state = {"version": 3, "step": 4, "sources": {}}
    legacy_segment(
        tmp_path / "seg-0000000004.log",
        [
            {"t": "snap", "state": state, "consumed": 3, "loaders": {"web": 1}},
            {"t": "plan", "s": 4, "d": {"c": {}, "p": {}}},
            {"t": "cons", "s": 4},
        ],
    )
    got = recover(tmp_path)
    assert len(got) == 1 and got[0].chain is None and got[0].consumed == 4
    assert got[0].deltas == [{"c": {}, "p": {}}] and got[0].problems == []
    # a planner resumes on it: it appends lines of format 1 to that segment, then a new
    # snapshot starts a segment of format 2, and both read back
    journal = Journal(tmp_path)
    journal.continue_after(got[0])
    journal.consumed(5)
    journal.snapshot({**state, "step": 8}, 7, {"web": 1})
    journal.delta(8, {"c": {}, "p": {}})
    journal.close()
    old, new = segments(tmp_path)
    assert old.read_bytes().splitlines(keepends=True)[-1] == encode({"t": "cons", "s": 5})
    assert new.read_bytes().startswith(encode(journal_module.header(8), SEED))
    assert [r.consumed for r in recover(tmp_path)] == [5, 7]
    # and a damaged line of format 1 refuses it too, naming its field
    data = old.read_bytes().replace(b'"s":5', b'"s":6')
    old.write_bytes(data)
    with pytest.raises(JournalError, match=r"record 3 at byte \d+: field 'crc32'"):
        recover(tmp_path)


def test_a_journal_without_an_intact_snapshot_is_an_error(tmp_path):
    (tmp_path / "seg-0000000000.log").write_bytes(encode({"t": "snap", "state": {}}, SEED)[:-3])
    with pytest.raises(JournalError, match="no intact snapshot"):
        recover(tmp_path)
    (tmp_path / "seg-0000000000.log").write_bytes(b"garbage\n")
    with pytest.raises(JournalError, match="record 0 at byte 0: field 'digest'"):
        recover(tmp_path)


def test_records_round_trip_and_carry_a_chained_digest():
    rec = {"t": "plan", "s": 7, "d": {"c": {"web": [0, 3, 12, []]}, "p": {"web": 448}}}
    line = encode(rec, SEED)
    assert decode(line, "here", SEED) == rec
    with pytest.raises(JournalError, match="here: field 'digest'"):
        decode(line.replace(b"448", b"449"), "here", SEED)
    with pytest.raises(JournalError, match="here: field 'digest'"):  # another place in a chain
        decode(line, "here", line[:32].decode())
    with pytest.raises(JournalError, match="here: field 'crc32': checksum mismatch"):
        decode(encode(rec).replace(b"448", b"449"), "here")


def test_a_segment_renamed_is_refused_by_its_header(tmp_path):
    journal = Journal(tmp_path)
    journal.snapshot({"version": 3, "step": 10, "sources": {}}, 9, {})
    journal.close()
    (tmp_path / "seg-0000000010.log").rename(tmp_path / "seg-0000000020.log")
    with pytest.raises(JournalError, match="record 0 at byte 0: field 'start': expected 20"):
        recover(tmp_path)


def test_a_full_disk_names_the_journal_file(tmp_path):
    # writes to /dev/full fail with ENOSPC: the snapshot's temporary file is a link to it
    (tmp_path / "seg-0000000000.tmp").symlink_to("/dev/full")
    journal = Journal(tmp_path)
    with pytest.raises(
        JournalError,
        match=r"cannot write the planner's journal .*seg-0000000000\.tmp: No space left on device",
    ):
        journal.snapshot({"version": 3, "step": 0, "sources": {}}, -1, {})
    journal.close()


@pytest.mark.integration
def test_a_delta_is_small(plan_path, tmp_path):
    path, _ = journal_of(plan_path, tmp_path, 9)
    records = [r for seg in segments(path) for r in read_segment(seg)[0]]
    deltas = [len(encode(r, SEED)) for r in records if r["t"] == "plan"]
    assert len(deltas) >= 4 and max(deltas) < 200  # two sources; the benchmark measures ten


def test_a_resumed_journal_goes_on_with_its_chain(tmp_path):
    state = {"version": 3, "step": 4, "sources": {}}
    journal = Journal(tmp_path)
    journal.snapshot(state, 3, {})
    journal.delta(4, {"c": {}, "p": {}})
    journal.close()
    data = (tmp_path / "seg-0000000004.log").read_bytes()
    (tmp_path / "seg-0000000004.log").write_bytes(data + b"0123456789abcdef")  # torn by a kill
    (got,) = recover(tmp_path)
    assert got.problems and got.chain == data.splitlines()[-1][:32].decode()
    journal = Journal(tmp_path)
    journal.continue_after(got)  # cuts the torn end, and chains the next record to the last
    journal.delta(5, {"c": {}, "p": {}})
    journal.consumed(5)
    journal.close()
    (again,) = recover(tmp_path)
    assert again.problems == [] and len(again.deltas) == 2 and again.consumed == 5
