"""`overlord demo` end to end: corpus, plan, run, report, on a short run."""

from __future__ import annotations

import re

import pytest

from overlord.ops.demo import run_demo
from overlord.plans import load_plan

SOURCES = ["stdlib", "tests", "docs", "licenses"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_demo_writes_plan_report_and_plots(tmp_path, capsys):
    assert run_demo(tmp_path, steps=20, dp=2) == 0
    printed = capsys.readouterr().out

    plan = load_plan(tmp_path / "plan.yaml")  # validates, and every glob matches shards
    assert plan.source_names == SOURCES
    assert plan.world.dp == 2
    assert {s.suffix for s in (tmp_path / "data" / "stdlib").iterdir()} == {".jsonl", ".gz"}
    assert sorted((tmp_path / "checkpoints").glob("step-*.json"))[-1].name == "step-00000020.json"
    for png in ("mixture.png", "balance.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG
    md = (tmp_path / "report.md").read_text()
    assert "![mixture](mixture.png)" in md and "![balance](balance.png)" in md
    assert str(tmp_path.resolve()) in printed  # the report names the folder it wrote

    for text in (printed, md):
        assert re.search(r"[\d.]+ M tokens/s", text)
        assert re.search(r"Peak memory [\d,]+ MiB", text)
        assert re.search(r"checkpoint [\d,]+ bytes", text)
        # balance of the plan's method and of the baseline, as mean / p95 / max of max/LB
        for who in (r"overlord \(kk\)", r"per-rank loader \(none\)"):
            assert re.search(who + r"\W+1\.\d{4}\W+1\.\d{4}\W+1\.\d{4}", text), who
        # the whole run's row of the mixture table: realized (target) for every source
        overall = next(line for line in text.splitlines() if "all 0-19" in line)
        shares = re.findall(r"([\d.]+)% \(([\d.]+)%\)", overall)
        assert len(shares) == len(SOURCES)
        assert all(abs(float(a) - float(b)) < 2.0 for a, b in shares)
        assert abs(sum(float(a) for a, _ in shares) - 100) < 0.5
    for name in SOURCES:
        assert re.search(rf"\b{name}\b", printed)


@pytest.mark.integration
def test_demo_reuses_its_corpus(tmp_path, capsys):
    run_demo(tmp_path, steps=2, dp=2)
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "data").rglob("*") if p.is_file()}
    capsys.readouterr()
    run_demo(tmp_path, steps=2, dp=2)
    assert "Corpus reused" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in shards} == shards
