"""A checkpoint file carries a digest of its content: a changed or damaged file is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlord import checkpoint
from overlord.errors import CheckpointError

STATE = {
    "version": 3,
    "fingerprint": "abc",
    "step": 12,
    "sources": {
        "web": {
            "fingerprint": "def",
            "cursor": {"epoch": 0, "shard_pos": 1, "index": 7, "skip": [[0, 1, 9, 2]]},
            "target": 812.5,
            "placed": 790.0,
            "files": [[0, [["data/web/a.jsonl", 1234]]]],
        }
    },
}


def test_a_saved_checkpoint_loads_as_it_was_saved(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, STATE)
    assert json.loads(path.read_text())["digest"].startswith("sha256:")
    assert checkpoint.load(path) == STATE
    assert checkpoint.load(tmp_path) == STATE  # the newest of the folder


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(step=13),
        lambda d: d["sources"]["web"]["cursor"].update(index=8),
        lambda d: d["sources"]["web"].update(placed=1580.0),
        lambda d: d["sources"]["web"]["cursor"].update(skip=[[0, 1, 9, 10**9]]),
        lambda d: d["sources"].pop("web"),
        lambda d: d.update(version=4),
    ],
    ids=["step", "cursor digit", "placed doubled", "skip count", "source removed", "version"],
)
def test_an_edited_field_is_refused_naming_the_file(tmp_path: Path, edit) -> None:
    path = checkpoint.save(tmp_path, STATE)
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match="does not match its digest") as e:
        checkpoint.load(path)
    assert str(path) in str(e.value)


def test_a_flipped_byte_is_refused(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, STATE)
    data = bytearray(path.read_bytes())
    at = data.index(b'"index":7') + len(b'"index":')
    data[at] = ord("5")  # still valid JSON: only the digest can tell
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its digest"):
        checkpoint.load(path)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, STATE)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {path}"):
        checkpoint.load(path)


def test_a_file_written_before_digests_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "step-00000012.json"
    path.write_text(json.dumps(STATE))
    assert checkpoint.load(path) == STATE


def test_a_state_with_nan_is_not_written(tmp_path: Path) -> None:
    bad = json.loads(json.dumps(STATE))
    bad["sources"]["web"]["placed"] = float("nan")
    with pytest.raises(ValueError):
        checkpoint.save(tmp_path, bad)
    assert not list(tmp_path.glob("step-*.json"))


def test_a_failed_write_names_the_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, {**STATE, "step": 11})

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("overlord.state.checkpoint.os.fsync", full)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*12\.json: No space"):
        checkpoint.save(tmp_path, STATE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000011.json"]
    assert checkpoint.load(tmp_path)["step"] == 11  # the previous one is intact


def test_temporary_files_of_killed_saves_are_removed(tmp_path):
    import os
    import time

    old = tmp_path / ".tmp-killed.json"
    old.write_text("{")  # a save killed midway, long ago
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    young = tmp_path / ".tmp-in-progress.json"
    young.write_text("{")  # another save, now
    checkpoint.save(tmp_path, STATE)
    assert not old.exists() and young.exists()


def test_numbers_no_run_writes_are_refused_before_anything_is_built(tmp_path):
    import overlord
    from conftest import make_corpus

    plan = overlord.load_plan(make_corpus(tmp_path))
    with overlord.Loader(plan) as loader:
        client = loader.client(0)
        next(client)
        state = loader.state_dict()
    bad = json.loads(json.dumps(state))
    name = plan.source_names[0]
    bad["sources"][name]["cursor"]["skip"] = [[0, 0, 1, 10**9]]  # would be held item by item
    bad["sources"][name]["placed"] = float("nan")
    with pytest.raises(CheckpointError) as e:
        overlord.Loader(plan, state=bad)
    message = str(e.value)
    assert f"sources.{name}.cursor.skip: 1000000000 items placed ahead" in message
    assert f"sources.{name}.placed: expected a finite number >= 0, found nan" in message
    with overlord.Loader(plan, state=state) as loader:  # the state as written resumes
        assert next(loader.client(0)).step == state["step"]
