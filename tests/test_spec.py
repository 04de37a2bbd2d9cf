"""``overlord.plan.spec``: a bad plan lists every problem with its field path.

Nothing is started: plans are validated only (``load_plan`` globs the files).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_corpus
from overlord import PlanError, load_plan
from overlord.plan.spec import validate_plan


def test_glob_matching_nothing_names_source_and_pattern(tmp_path: Path) -> None:
    sources = {
        "web": 4,
        "code": {
            "files": {"data/code/a.jsonl": 4},
            "path": ["data/code/*.jsonl", "data/kode/*.jsonl"],
        },
    }
    plan = make_corpus(tmp_path, sources)
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert len(e.value.problems) == 1
    path, msg = e.value.problems[0]
    assert path == "sources[1].path"
    assert "'code'" in msg and "'data/kode/*.jsonl' matches no file" in msg
    assert str(plan) in str(e.value)


def test_weight_naming_an_unknown_source(tmp_path: Path) -> None:
    mixture = {
        "schedule": [
            {"step": 0, "weights": {"web": 0.5, "code": 0.5}},
            {"step": 10, "weights": {"web": 0.5, "wbe": 0.5}},
        ]
    }
    plan = make_corpus(tmp_path, mixture=mixture)
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert len(e.value.problems) == 1
    path, msg = e.value.problems[0]
    assert path == "mixture.schedule[1].weights.wbe"
    assert "unknown source 'wbe'" in msg and "code" in msg and "web" in msg
    assert "mixture.schedule[1].weights.wbe" in str(e.value)


def test_tokens_per_step_not_a_multiple_of_max_seq_len(tmp_path: Path) -> None:
    plan = make_corpus(tmp_path, batch={"tokens_per_step": 300, "max_seq_len": 64})
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert [p for p, _ in e.value.problems] == ["batch.tokens_per_step"]
    assert "300" in e.value.problems[0][1] and "64" in e.value.problems[0][1]


def test_rows_not_divisible_by_dp(tmp_path: Path) -> None:
    plan = make_corpus(tmp_path, world={"dp": 3})  # 4 rows per step
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert [p for p, _ in e.value.problems] == ["world.dp"]
    assert "4 rows" in e.value.problems[0][1] and "dp=3" in e.value.problems[0][1]
    # the same through the Python API's DP override
    with pytest.raises(PlanError) as e:
        load_plan(make_corpus(tmp_path / "ok")).with_dp(3)
    assert [p for p, _ in e.value.problems] == ["world.dp"]


def test_several_schema_problems_are_reported_at_once(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        seed="not a number",
        batch={"max_seq_len": -1},
        world={"dp": 0},
        extra_field=1,
        sources={"web": {"files": {"data/web/a.jsonl": 3}, "format": "csv"}},
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    paths = sorted(p for p, _ in e.value.problems)
    assert paths == sorted(
        ["seed", "sources[0].format", "batch.max_seq_len", "world.dp", "extra_field"]
    )
    assert f"has {len(paths)} problem(s)" in str(e.value)
    for p in paths:
        assert f"  - {p}: " in str(e.value)


def test_several_semantic_problems_are_reported_at_once(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        sources={"web": 4, "code": {"files": {"data/code/a.jsonl": 4}, "name": "web"}},
        batch={"tokens_per_step": 100},
        mixture={
            "schedule": [
                {"step": 0, "weights": {"web": 1.0, "wbe": 1.0}},
                {"step": 0, "weights": {"web": 1.0, "cdoe": 1.0}},
            ]
        },
        tokenizer={"kind": "hf"},
        balance={
            "cost": {
                "alpha": 1.0,
                "beta": 0.0,
                "model": {"params": 1e9, "layers": 8, "hidden": 512},
            }
        },
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    expected = [
        "sources[1].name",
        "batch.tokens_per_step",
        "mixture.schedule[1].step",
        "mixture.schedule[0].weights.wbe",
        "mixture.schedule[1].weights.cdoe",
        "tokenizer.path",
        "balance.cost",
    ]
    assert sorted(p for p, _ in e.value.problems) == sorted(expected)
    assert "has 7 problem(s)" in str(e.value)


def test_schema_and_semantic_problems_are_reported_together(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        seed="x",
        mixture={"schedule": [{"step": 0, "weights": {"web": 1.0, "wbe": 1.0}}]},
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert sorted(p for p, _ in e.value.problems) == ["mixture.schedule[0].weights.wbe", "seed"]


def test_glob_and_other_problems_are_reported_together(tmp_path: Path) -> None:
    plan = make_corpus(
        tmp_path,
        sources={"web": {"files": {"data/web/a.jsonl": 3}, "path": "data/nothing/*.jsonl"}},
        world={"dp": 3},
    )
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert sorted(p for p, _ in e.value.problems) == ["sources[0].path", "world.dp"]


def test_unreadable_or_invalid_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read the plan file"):
        load_plan(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1, 2\nsources: {")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(PlanError, match="a plan is a mapping, found list"):
        load_plan(bad)


def test_plan_object_validation_reports_field_paths() -> None:
    data = {
        "sources": [{"name": "bad name!", "path": "x", "format": "jsonl"}],
        "batch": {"tokens_per_step": 64, "max_seq_len": 16},
    }
    with pytest.raises(PlanError) as e:
        validate_plan(data)
    assert [p for p, _ in e.value.problems] == ["sources[0].name"]
    assert "the data plan has 1 problem(s)" in str(e.value)
