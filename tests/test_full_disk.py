"""A full disk under each output of a run ends in an overlord error naming that output.

Writes to /dev/full fail with ENOSPC, as on a full disk: each output is pointed
at it (by a link, where the output's name is fixed).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest

from conftest import make_corpus
from overlord.ops.cli import main

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")

FULL = "No space left on device"


def run(capsys: pytest.CaptureFixture[str], plan: Path, *args: str) -> tuple[int, str, str]:
    code = main(["run", str(plan), "--steps", "6", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_dump_on_a_full_disk_is_named(tmp_path, capsys) -> None:
    plan = make_corpus(tmp_path / "corpus")
    code, _, err = run(capsys, plan, "--dump", "/dev/full")
    assert code == 1
    assert err.strip().splitlines() == [f"overlord: cannot write the dump /dev/full: {FULL}"]


def test_a_dump_that_cannot_be_opened_is_named(tmp_path, capsys) -> None:
    plan = make_corpus(tmp_path / "corpus")
    code, _, err = run(capsys, plan, "--dump", str(tmp_path / "missing" / "dump.jsonl"))
    assert code == 1 and f"cannot write the dump {tmp_path / 'missing' / 'dump.jsonl'}" in err


def test_a_report_on_a_full_disk_names_its_file_after_the_summary(tmp_path, capsys) -> None:
    plan = make_corpus(tmp_path / "corpus")
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").symlink_to("/dev/full")
    code, out, err = run(capsys, plan, "--report", str(report))
    assert code == 1
    assert "steps 0..5:" in out and "balance (" in out  # the summary, printed
    assert err.strip().splitlines()[-1] == (
        f"overlord: cannot write the report's {report / 'report.md'}: {FULL}"
    )
    assert not (report / "report.md").exists()  # the link was removed, not left torn


def test_a_checkpoint_on_a_full_disk_is_named_and_the_older_ones_kept(
    tmp_path, capsys, monkeypatch
) -> None:
    plan = make_corpus(tmp_path / "corpus")
    ckpt = tmp_path / "ckpt"
    real = tempfile.mkstemp
    saves = []

    def full_after_two(*args, **kwargs):  # the third save's file is on a full disk
        fd, path = real(*args, **kwargs)
        saves.append(path)
        if len(saves) >= 3:
            os.close(fd)
            fd = os.open("/dev/full", os.O_WRONLY)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", full_after_two)
    code, _, err = run(capsys, plan, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert code == 1
    assert err.strip().splitlines() == [
        f"overlord: cannot write checkpoint {ckpt / 'step-00000006.json'}: {FULL}"
    ]
    kept = sorted(p.name for p in ckpt.glob("step-*"))
    assert kept == ["step-00000002.json", "step-00000004.json"]


class _Fixed:
    hex = "ab" * 16


def test_a_journal_on_a_full_disk_is_named(tmp_path, capsys, monkeypatch) -> None:
    journal = tmp_path / "journal"
    plan = make_corpus(tmp_path / "corpus", recovery={"journal_dir": str(journal)})
    monkeypatch.setattr(uuid, "uuid4", _Fixed)  # the job's journal folder gets a known name
    folder = journal / "overlord-journal" / "overlord-abababab-abababab"
    folder.mkdir(parents=True)
    (folder / "seg-0000000000.tmp").symlink_to("/dev/full")  # the first snapshot's file
    code, _, err = run(capsys, plan)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"overlord: cannot write the planner's journal {folder / 'seg-0000000000.tmp'}: "
        f"{FULL} (recovery.journal_dir sets its folder)"
    )
