"""benchmarks/faults.py in its smallest mode: its verdicts are computed, and they are right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import faults

pytestmark = pytest.mark.integration


def test_the_fault_table_computes_its_verdicts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "faults.json"
    faults.main(["--quick", "--trials", "3", "--parts", "abc", "--cases", "deep JSON",
                 "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())
    a = got["trials"]
    assert a["trials"] == 3 and len(a["rows"]) == 3 and a["first_exact"] is True
    assert all(isinstance(r["exact"], bool) for r in a["rows"])
    assert a["exact"] == sum(r["exact"] for r in a["rows"])
    # the job rewinds to any checkpoint it wrote: every restart exact, from the one drawn
    assert a["exact"] == a["as_chosen"] == 3 and a["refused"] == a["failed"] == 0
    assert f"{a['exact']}/3 exact" in printed
    # every damaged checkpoint and journal refused, the intact ones and a torn tail resumed
    damage = got["damage"]
    assert len(damage) >= 15 and all(r["refused"] == r["expected"] for r in damage), damage
    assert any(r["what"] == "journal" and r["refused"] for r in damage)
    # each names the file, or the field path of the number out of range
    named = [
        r
        for r in damage
        if r["refused"] and ("DIR/" in r["message"] or "sources.src0." in r["message"])
    ]
    assert named == [r for r in damage if r["refused"]]
    (deep,) = got["hostile"]
    assert deep["verdict"] == "skipped" and deep["ok"] is True
    assert "row 40: malformed JSON (nested too deeply" in deep["message"]
    assert 0 < deep["ratio"] < faults.PEAK_RATIO and deep["wall_s"] < deep["timeout_s"]


def test_a_hostile_input_that_is_read_whole_fails_its_verdict() -> None:
    from benchmarks._lib.hostile import verdict

    base = {"timed_out": False, "error": None, "skipped": 0}
    assert verdict(base) == "READ (not bounded)"
    assert verdict({**base, "skipped": 1}) == "skipped"
    assert verdict({**base, "error": "PlanError: the plan ..."}) == "named"
    assert verdict({**base, "error": "crashed (rc -9): killed"}) == "CRASHED"
    assert verdict({**base, "timed_out": True, "skipped": 1}) == "TIMEOUT"
