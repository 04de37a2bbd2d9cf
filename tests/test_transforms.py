"""Per-record transforms: run on the SourceLoader, a failing one is a bad record with its place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_corpus
from overlord import Loader, PlanError, SourceError, load_plan
from overlord.sources.transforms import clean_text, pack_zlib_json, zlib_json


def test_zlib_json_unpacks_what_pack_zlib_json_packed():
    text = "document ünïcode " * 40
    packed = pack_zlib_json(text)
    assert isinstance(packed, str) and packed != text
    assert zlib_json(packed) == text
    with pytest.raises(ValueError):
        zlib_json("not packed")


def test_clean_text_is_idempotent_and_changes_messy_text():
    messy = "a  b\r\n\n\n\nc\t "
    once = clean_text(messy)
    assert once != messy and clean_text(once) == once


@pytest.mark.integration
def test_a_transform_runs_on_every_record_and_a_failing_one_names_its_place(tmp_path):
    records = [{"text": pack_zlib_json(f"document {i} " * (i + 1))} for i in range(12)]
    plain = make_corpus(
        tmp_path / "plain",
        {
            "web": {
                "files": {
                    "data/web/a.jsonl": [{"text": f"document {i} " * (i + 1)} for i in range(12)]
                }
            }
        },
    )
    packed = make_corpus(
        tmp_path / "packed",
        {
            "web": {
                "files": {"data/web/a.jsonl": records},
                "transform": "overlord.sources.transforms:zlib_json",
            }
        },
    )

    def texts(path: Path) -> tuple[list[str], list[int]]:
        with Loader(load_plan(path)) as loader:
            batch = next(loader.client(0))
        return [s.id for s in batch.samples], batch.input_ids.ravel().tolist()

    ids, tokens = texts(packed)
    assert (ids, tokens) == texts(plain)  # the same documents' tokens, in the same order
    assert bytes(t for t in tokens if t < 256).decode().startswith("document")

    broken = make_corpus(
        tmp_path / "broken",
        {
            "web": {
                "files": {"data/web/a.jsonl": [*records[:3], {"text": "not packed"}, *records[4:]]},
                "transform": "overlord.sources.transforms:zlib_json",
            }
        },
    )
    with pytest.raises(SourceError, match=r"file data/web/a\.jsonl, row 3: transform"):
        texts(broken)


def test_code_from_outside_overlord_is_refused_without_consent(tmp_path):
    for name in ("subprocess:getoutput", "builtins:eval", "nope:f"):
        source = {"files": {"data/web/a.jsonl": 3}, "transform": name}
        path = make_corpus(tmp_path / name.replace(":", "-"), {"web": source})
        with pytest.raises(
            PlanError, match=r"sources\[0\]\.transform: .* from outside overlord"
        ) as e:
            load_plan(path)
        assert f"'{name}'" in str(e.value) and "allow_imports: true" in str(e.value)


def test_overlords_own_transforms_need_no_consent():
    from overlord.plan.rules import BUILTIN_TRANSFORMS
    from overlord.sources import transforms

    for name in BUILTIN_TRANSFORMS:  # each names a function of overlord.sources.transforms
        assert callable(getattr(transforms, name.split(":")[1]))
        assert transforms.load_transform(name) is getattr(transforms, name.split(":")[1])
    with pytest.raises(ValueError, match="the plan does not allow it"):
        transforms.load_transform("overlord.sources.transforms:load_transform")


_PROBE_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")
def upper(text):
    return text.upper()
"""


def consenting_plan(tmp_path: Path, module: str, allow: bool) -> Path:
    (tmp_path / f"{module}.py").write_text(_PROBE_MODULE.format(marker=str(tmp_path / "marker")))
    return make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": 3}, "transform": f"{module}:upper"}},
        transforms={"allow_imports": allow},
    )


def test_validate_never_imports_a_transform(tmp_path):
    path = consenting_plan(tmp_path, "probe_transform_a", allow=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-m", "overlord", "validate", str(path)],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "marker").exists()  # checked by its name, never run


@pytest.mark.integration
def test_a_consenting_plan_runs_its_transform_and_a_missing_one_names_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    path = consenting_plan(tmp_path, "probe_transform_b", allow=True)
    with Loader(path) as loader:
        batch = next(loader.client(0))
    assert (tmp_path / "marker").exists()
    assert bytes(batch.input_ids[0][:10].tolist()).decode(errors="ignore").isupper()
    missing = make_corpus(
        tmp_path / "missing",
        {"web": {"files": {"data/web/a.jsonl": 3}, "transform": "nope:f"}},
        transforms={"allow_imports": True},
    )
    with (
        pytest.raises(SourceError, match=r"transform nope:f: cannot import module 'nope'"),
        Loader(missing) as loader,
    ):
        next(loader.client(0))
