"""``overlord validate`` on image-text sources: the first image of each is decoded.

A missing Pillow, an image Pillow cannot read, a wrong ``image_field`` and an
image too long for ``max_seq_len`` are problems named by file and row (and, in
a tar, member), found before a job starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from overlord.ops.cli import main
from overlord.ops.vision_data import (
    encode,
    image_text_parquet,
    image_text_tar,
    random_images,
    write_tar,
)
from overlord.plan.spec import validate_plan
from overlord.sources.probe import check_sources

TAR = {"name": "w", "path": "a.tar", "format": "webdataset", "text_field": "txt"}
PQ = {"name": "p", "path": "b.parquet", "format": "parquet", "image_field": "image"}


def plan_data(sources: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "seed": 1,
        "sources": sources,
        "batch": {"tokens_per_step": 4096, "max_seq_len": 2048},
        "vision": {},
    }
    return data | over


def problems(root: Path, sources: list[dict[str, Any]], **over: Any) -> list[str]:
    plan = validate_plan(plan_data(sources, **over), base_dir=root)
    return [str(p) for p in check_sources(plan)]


def good_files(root: Path) -> None:
    image_text_tar(root / "a.tar", random_images(3, seed=4))
    image_text_parquet(root / "b.parquet", random_images(3, seed=5))


def test_good_image_sources_have_no_problem(tmp_path: Path) -> None:
    good_files(tmp_path)
    assert problems(tmp_path, [TAR, PQ]) == []


def test_a_corrupt_first_image_is_named_by_file_row_and_member(tmp_path: Path) -> None:
    (e, d), = random_images(1, seed=6)  # fmt: skip
    # a blank caption is not a sample: its image is never decoded, so the check skips it
    write_tar(tmp_path / "a.tar", [("blank", {e: b"junk", "txt": b"  "}),
                                   ("bad", {"jpg": b"\xff\xd8 not a jpeg", "txt": b"x"}),
                                   ("ok", {e: d, "txt": b"fine"})])  # fmt: skip
    good = random_images(2, seed=7)
    image_text_parquet(tmp_path / "b.parquet", [("png", b"\x89PNG broken"), *good])
    found = problems(tmp_path, [TAR, PQ])
    assert len(found) == 2, found
    assert found[0].startswith(
        "source 'w', file a.tar, row 1, member bad.jpg: cannot decode the image ("
    )
    assert found[1].startswith("source 'p', file b.parquet, row 0: cannot decode the image (")


def test_a_wrong_image_field(tmp_path: Path) -> None:
    good_files(tmp_path)
    found = problems(tmp_path, [{**TAR, "image_field": "tiff"}, {**PQ, "image_field": "picture"}])
    assert found == [
        "source 'w', file a.tar, row 0: sample 's000000' has no image member ('tiff',) "
        "(it has ['jpg', 'txt'])",
        "source 'p', file b.parquet: no column 'picture' (columns: ['text', 'image'])",
    ]


def test_an_image_longer_than_a_row(tmp_path: Path) -> None:
    image_text_tar(tmp_path / "a.tar", [("png", encode(np.zeros((600, 600, 3), np.uint8), "png"))])
    batch = {"tokens_per_step": 256, "max_seq_len": 128}
    (found,) = problems(tmp_path, [TAR], batch=batch)
    assert found.startswith("source 'w', file a.tar, row 0, member s000000.png: the image gives ")
    assert "more than batch.max_seq_len 128" in found


def test_without_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good_files(tmp_path)
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` raises ImportError
    assert problems(tmp_path, [TAR, PQ]) == [
        "source 'w', file a.tar, row 0, member s000000.jpg: image sources need Pillow: "
        "pip install 'overlord-data[vision]'",
        "source 'p', file b.parquet, row 0: image sources need Pillow: "
        "pip install 'overlord-data[vision]'",
    ]


def test_the_command_prints_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_tar(tmp_path / "a.tar", [("bad", {"jpg": b"\xff\xd8 not a jpeg", "txt": b"x"})])
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_data([TAR])))
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "source 'w', file a.tar, row 0, member bad.jpg: cannot decode the image" in err
