"""The pure helpers of ``benchmarks/memory.py``: states, what overlord holds, extrapolation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks._lib.colocated import (
    IMAGE_BLOCK,
    INDEX_BLOCK,
    ImageReader,
    MiB,
    SourceReader,
    State,
    decode_patches,
    images_shuffle,
    linear,
    make_image_corpus,
    overlord_shuffle,
    parse_state,
)
from benchmarks._lib.memory_cells import (
    DESIGNS,
    Cell,
    fit_sources,
    keys,
    parse_designs,
    plan_cells,
    run_key,
)
from benchmarks._lib.memory_report import (
    at_target,
    crossover,
    index_table,
    node_breakdown,
    node_table,
    report,
)
from benchmarks._lib.procfs import CATEGORIES
from benchmarks.memory import torchrun_env


def test_parse_state() -> None:
    assert parse_state("index") == State("index")
    assert parse_state(" Shuffle:16MB") == State("shuffle", 16 * MiB)
    assert parse_state("shuffle:64MiB").label == "shuffle:64MB"
    assert parse_state("images") == State("images", 16 * MiB)
    assert parse_state("Images:4MB").label == "images:4MB"
    for bad in ("shuffle", "shuffle:0MB", "shuffle:1.5MB", "shuffle:4GB", "images:0MB", "img", ""):
        with pytest.raises(ValueError, match="expected 'index', 'shuffle:<N>MB', 'images'"):
            parse_state(bad)


def test_images_shuffle_holds_about_as_many_images() -> None:
    st = parse_state("images:16MB")
    # 16 MiB of 1.25 MiB decoded images: 13 of them, 30 KiB each encoded: 390 KiB, 7 blocks
    got = images_shuffle(st, 1.25 * MiB, 30 * 1024)
    assert got == {"block_bytes": IMAGE_BLOCK, "window_blocks": 7}
    assert images_shuffle(st, 64 * MiB, 1000) == {"block_bytes": IMAGE_BLOCK, "window_blocks": 1}
    with pytest.raises(ValueError, match="an images state"):
        images_shuffle(parse_state("shuffle:16MB"), MiB, 1024)
    with pytest.raises(ValueError, match="positive sizes"):
        images_shuffle(st, 0, 1024)


def test_overlord_holds_the_same_window() -> None:
    assert overlord_shuffle(parse_state("shuffle:64MB")) == {
        "block_bytes": MiB,
        "window_blocks": 64,
    }
    assert overlord_shuffle(State("index")) == {"block_bytes": INDEX_BLOCK, "window_blocks": 1}


def test_linear() -> None:
    assert linear([(32.0, 100.0)], 32) == 100.0
    assert linear([(8.0, 10.0), (16.0, 18.0)], 32) == pytest.approx(34.0)
    assert linear([(8.0, 10.0), (16.0, 18.0), (16.0, 20.0)], 16) == pytest.approx(
        linear([(8.0, 10.0), (16.0, 19.0)], 16)
    )
    with pytest.raises(ValueError, match="cannot give a line"):
        linear([(8.0, 10.0)], 32)
    with pytest.raises(ValueError, match="no points"):
        linear([], 1)


def test_crossover() -> None:
    assert crossover([(0.0, 0.5), (4.0, 1.5)]) == pytest.approx(2.0)
    assert crossover([(4.0, 1.5), (0.0, 0.5)]) == pytest.approx(2.0)  # any order
    assert crossover([(0.0, 1.2), (4.0, 3.0)]) == 0.0
    assert crossover([(0.0, 0.2), (4.0, 0.9)]) is None


def test_fit_sources() -> None:
    assert fit_sources(32, 4 * 16 * MiB, 3 * 2**30) == [32]  # 2 GiB fits
    assert fit_sources(32, 4 * 64 * MiB, 3 * 2**30) == [4, 8]  # 8 GiB does not: S=8 (2 GiB)
    assert fit_sources(32, 4 * 64 * MiB, 4 * 2**30) == [8, 16]
    assert fit_sources(32, 0, 1) == [32]


def test_plan_cells_measures_what_fits_and_the_index_target() -> None:
    cells = plan_cells(
        [parse_state("index"), parse_state("shuffle:64MB")], [0, 1], (8, 4, 32), False
    )
    assert cells[:2] == [Cell("bare", "", 1, 0, 0), Cell("bare", "", 8, 0, 0)]
    assert Cell("baseline", "index", 1, 4, 32) in cells
    assert Cell("baseline", "shuffle:64MB", 1, 4, 32) not in cells
    assert Cell("overlord", "shuffle:64MB", 8, 0, 32, 0) in cells  # 4 GiB of windows
    assert Cell("overlord", "shuffle:64MB", 8, 0, 32, 1) in cells  # a shadow: twice that
    assert Cell("overlord", "shuffle:64MB", 8, 0, 16, 1) not in cells
    wide = plan_cells([parse_state("shuffle:64MB")], [1], (8, 4, 128), False)
    # 32 GiB of windows at S=128 does not fit: S=32 (8 GiB) and 16, carried along their line
    assert [c.s for c in wide if c.kind == "overlord"] == [16, 32]
    assert Cell("overlord-node", "shuffle:64MB", 8, 0, 32) in cells  # no standby
    assert Cell("baseline", "index", 8, 2, 16) in cells
    assert Cell("overlord", "index", 8, 0, 16, 1) in cells
    assert Cell("overlord-node", "index", 8, 0, 16) in cells
    assert not [c for c in cells if c.kind == "overlord-node" and c.shadows]
    assert len(cells) == len(set(cells))
    node = plan_cells([parse_state("index")], [0, 1], (8, 4, 32), False, ("overlord-node",))
    assert node == [
        Cell("bare", "", 1, 0, 0),
        Cell("bare", "", 8, 0, 0),
        Cell("overlord-node", "index", 8, 0, 32),
        Cell("overlord-node", "index", 8, 0, 16),
    ]
    quick = plan_cells([parse_state("index")], [0], (2, 2, 4), True, ("baseline", "overlord-node"))
    assert [c.kind for c in quick] == ["bare", "bare", "baseline", "overlord-node"]
    images = plan_cells([parse_state("images:16MB")], [0, 1], (8, 4, 32), False)
    assert Cell("baseline", "images:16MB", 1, 4, 32) in images  # 2 GiB of buffers: fits
    assert Cell("overlord", "images:16MB", 8, 0, 32, 1) in images
    assert Cell("baseline", "index", 8, 2, 16) not in images


def _run(kind: str, r: int, s: int, total: float, shadows: int = 0, w: int = 4) -> dict:
    return {"kind": kind, "state": "x", "R": r, "W": w, "S": s, "shadows": shadows, "total": total}


def test_at_target_carries_the_baseline_by_rank_and_by_source() -> None:
    bare = {1: {"total": 100.0}, 8: {"total": 800.0}}
    runs = [
        _run("baseline", 1, 8, 100.0 + 80),  # one trainer's loader: 10 per source
        _run("baseline", 1, 16, 100.0 + 160),
        _run("overlord", 8, 32, 800.0 + 500),
        _run("overlord", 8, 32, 800.0 + 999, shadows=1),
    ]
    got = at_target(runs, bare, "x", 0, (8, 4, 32))
    assert got is not None
    assert got["baseline_loader"] == pytest.approx(8 * 320)
    assert got["overlord_loader"] == pytest.approx(500)
    assert got["ratio"] == pytest.approx(8 * 320 / 500)
    assert got["total_ratio"] == pytest.approx((8 * 320 + 800) / 1300)
    assert got["baseline_how"] == "R=1 S=8 and 16, line to S=32, x8"
    assert got["overlord_how"] == "R=8 S=32"
    assert at_target(runs, bare, "other", 0, (8, 4, 32)) is None


def test_parse_designs() -> None:
    assert parse_designs("overlord-node, baseline") == ("baseline", "overlord-node")
    assert parse_designs(",".join(DESIGNS)) == DESIGNS
    for bad in ("", "ray", "baseline,node"):
        with pytest.raises(ValueError, match="expected a comma-separated subset"):
            parse_designs(bad)


def test_runs_of_earlier_sweeps_stand_for_their_cells() -> None:
    old = {"kind": "overlord", "state": "index", "R": 8, "W": 0, "S": 32}  # no shadows field
    assert run_key(old) in keys(Cell("overlord", "index", 8, 0, 32), (8, 4, 32))
    node = {**old, "kind": "overlord-node", "shadows": 0}
    assert run_key(node) not in keys(Cell("overlord", "index", 8, 0, 32), (8, 4, 32))
    assert run_key(node) in keys(Cell("overlord-node", "index", 8, 0, 32), (8, 4, 32))
    # carried: a run at the target's S stands for the smaller S the sweep would measure
    assert run_key(node) in keys(Cell("overlord-node", "index", 8, 0, 8), (8, 4, 32))
    # but the index target's own cell is measured at its own S
    assert run_key(node) not in keys(Cell("overlord-node", "index", 8, 0, 16), (8, 4, 32))


def test_torchrun_env_gives_each_rank_its_place_on_one_node() -> None:
    env = torchrun_env(3, 29555)
    assert [e["RANK"] for e in env] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "2"]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_PORT"]) for e in env} == {
        ("3", "3", "29555")
    }
    assert env[0]["MASTER_ADDR"] == "127.0.0.1"


def _node_runs() -> tuple[list[dict], dict]:
    bare = {"kind": "bare", "state": "", "R": 8, "W": 0, "S": 0, "shadows": 0, "total": 800.0}
    one = {**bare, "R": 1, "total": 100.0}
    runs = [
        bare,
        one,
        {**_run("baseline", 8, 16, 800.0 + 400, w=2), "state": "index"},
        {**_run("baseline", 1, 16, 100.0 + 50, w=2), "state": "index"},
        {**_run("overlord", 8, 16, 800.0 + 500), "state": "index"},
        {
            **_run("overlord-node", 8, 16, 800.0 + 200),
            "state": "index",
            "trainer_pss": [240.0] + [110.0] * 7,  # rank 0 +140, the others +10 each
        },
    ]
    for x in runs:  # what measured_table reads of every run
        x.update(parts=dict.fromkeys(CATEGORIES, 0), count=dict.fromkeys(CATEGORIES, 0), seconds=1)
    return runs, {1: one, 8: bare}


def test_node_breakdown_splits_rank_0_from_the_other_trainers() -> None:
    runs, bare = _node_runs()
    got = node_breakdown(runs[-1], bare)
    assert got["rank0"] == pytest.approx(140)
    assert got["others"] == pytest.approx(70)
    assert got["other_each"] == pytest.approx(10)
    assert got["rest"] == pytest.approx(1000 - 240 - 770)  # what no trainer holds


def test_node_mode_is_reported_beside_ray() -> None:
    runs, bare = _node_runs()
    designs = [("overlord", 0, "shadows 0"), ("overlord-node", 0, "node mode")]
    table = index_table(runs, bare, designs)
    rows = table.splitlines()
    assert rows[-2].startswith("| overlord on Ray, shadows 0 |")
    assert rows[-2].endswith(" | 0.80x | 0.92x |")  # 400/500 loader, 1200/1300 total
    assert rows[-1].startswith("| overlord in node mode |")
    assert rows[-1].endswith(" | 2.00x | 1.20x |")  # 400/200, 1200/1000
    target = (8, 2, 16)
    ray = at_target(runs, bare, "index", 0, target)
    node = at_target(runs, bare, "index", 0, target, "overlord-node")
    assert ray is not None and node is not None
    assert (ray["design"], node["design"]) == ("overlord", "overlord-node")
    assert node["ratio"] == pytest.approx(8 * 50 / 200)  # a baseline of R=1 is carried x R
    lines = node_table([ray, node], target).splitlines()
    assert len(lines) == 5 and lines[-1].startswith("| index |")
    assert " | 0.80x | 2.00x | " in lines[-1]  # Ray's loader ratio, then node mode's
    text, rows = report(runs, [parse_state("index")], [0], target)
    assert [x["design"] for x in rows] == ["overlord", "overlord-node"]
    assert "node mode: overlord's loader memory is below the colocated one already" in text


def test_shuffle_reader_holds_its_buffer(tmp_path) -> None:
    lines = [
        json.dumps({"text": f"doc {i} " + "x" * (i % 50)}).encode() + b"\n" for i in range(400)
    ]
    path = tmp_path / "a.jsonl"
    path.write_bytes(b"".join(lines))
    raw = np.frombuffer(path.read_bytes(), np.uint8)
    np.save(tmp_path / "a.npy", np.concatenate(([0], np.flatnonzero(raw == 10) + 1)))
    spec = {"file": str(path), "index": str(tmp_path / "a.npy")}
    reader = SourceReader(spec, State("shuffle", 4096), [1])
    held = sum(len(x) for x in reader.buffer)
    assert 4096 <= held < 4096 + max(len(x) for x in lines)
    texts = [reader.next_text() for _ in range(1000)]  # wraps around the file
    assert all(t.startswith("doc ") for t in texts)
    assert sum(len(x) for x in reader.buffer) < 2 * 4096
    reader.close()
    index = SourceReader(spec, State("index"), [1])
    seen = {index.next_text() for _ in range(400)}  # one epoch: every document once
    index.close()
    assert seen == {json.loads(x)["text"] for x in lines}


def test_image_reader_decodes_as_overlord_and_holds_its_buffer(tmp_path) -> None:
    pytest.importorskip("PIL")
    from overlord.plan.vision import VisionSpec
    from overlord.sources.images import image_patches, normalize

    sources = make_image_corpus(tmp_path, 5, per_base=24)
    assert [s["name"] for s in sources] == ["s000", "s001", "s002", "s003", "s004"]
    assert sources[4]["file"] != sources[0]["file"]
    assert (tmp_path / "isources" / "s004" / "part-0.tar").resolve() == (
        tmp_path / "ibase" / "stdlib.tar"
    )
    v = VisionSpec()
    import tarfile

    with tarfile.open(sources[1]["file"]) as tar:
        jpgs = [m for m in tar.getmembers() if m.name.endswith(".jpg")][:3]
        datas = [tar.extractfile(m).read() for m in jpgs]  # type: ignore[union-attr]
    for data in datas:  # the colocated worker's plain Pillow gives overlord's patches
        u8 = image_patches(data, v)
        assert np.array_equal(decode_patches(data, v), normalize(u8.reshape(-1, u8.shape[-1]), v))
    state = State("images", 2 * MiB)
    reader = ImageReader(sources[1], state, [3], v)
    assert 2 * MiB <= reader.held() < 2 * MiB + max(len(x[0]) * 588 * 4 for x in reader.buffer)
    for _ in range(sources[1]["images"] + 5):  # wraps around the tar
        patches, text = reader.next_sample()
        assert patches.dtype == np.float32 and patches.shape[1] == 3 * 14 * 14
        assert text.startswith("image ")
    assert sources[1]["decoded_bytes"] > 0 and sources[1]["sample_bytes"] > 0
