"""Reading a plan file: repeated keys, alias bombs and deep nesting are errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlord import load_plan
from overlord.errors import PlanError
from overlord.plan.plan_file import MAX_PLAN_NODES, read_plan_file

PLAN = """\
seed: 1
sources:
  - &web {name: web, path: "data/*.jsonl", format: jsonl}
  - {<<: *web, name: code}
batch: {tokens_per_step: 128, max_seq_len: 64}
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "a"}\n')
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


def test_anchors_and_merge_keys_still_read(tmp_path: Path) -> None:
    plan = load_plan(write(tmp_path, PLAN))
    assert [s.name for s in plan.sources] == ["web", "code"]
    assert plan.sources[1].path == plan.sources[0].path


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, PLAN + "seed: 2\n")
    with pytest.raises(PlanError, match=r"the key 'seed' is given twice: at lines 1 and 6") as e:
        load_plan(path)
    assert str(path) in str(e.value)


def test_a_repeated_key_inside_a_source_is_refused(tmp_path: Path) -> None:
    text = PLAN.replace("{name: web,", "{name: web, name: web2,")
    with pytest.raises(PlanError, match=r"the key 'name' is given twice: at line 3$"):
        read_plan_file(write(tmp_path, text))


def test_an_alias_bomb_is_refused_before_it_is_walked(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):  # 10**10 values once expanded, in under 1 KB
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    path = write(tmp_path, "\n".join(lines) + "\n")
    assert path.stat().st_size < 1024
    with pytest.raises(PlanError, match=f"over {MAX_PLAN_NODES:,} values once its aliases"):
        load_plan(path)


def test_deep_nesting_is_a_plan_error_not_a_recursion_error(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(PlanError, match="nested too deeply") as e:
        load_plan(path)
    assert str(path) in str(e.value)
