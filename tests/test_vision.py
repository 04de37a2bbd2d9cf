"""Image-text sources: readers, the vision rule, batches, errors, hybrid balance.

The pixel checks compare against an independent Pillow implementation of the
rule, written here from the docs' words (guides/images.md), not from overlord's code.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

import overlord
from overlord.errors import PlanError, SourceError
from overlord.ops.run import run_plan
from overlord.ops.vision_data import (
    caption,
    encode,
    image_text_parquet,
    image_text_tar,
    random_images,
    shipped_photos,
    write_tar,
)
from overlord.plan.balance import assign, rank_costs
from overlord.plan.cost import CostModel
from overlord.plan.hybrid import assign_modules, module_costs
from overlord.plan.spec import BalanceMethod, validate_plan
from overlord.plan.vision import Modules
from overlord.sources.catalog import list_files
from overlord.sources.images import normalize
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import BytesTokenizer

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
P, M = 14, 2


# ---- an independent implementation of the docs' rule -----------------------------------


def ref_size(h: int, w: int, min_px: int = 3136, max_px: int = 1003520) -> tuple[int, int]:
    f = P * M
    h1, w1 = max(f, int(math.floor(h / f + 0.5)) * f), max(f, int(math.floor(w / f + 0.5)) * f)
    if h1 * w1 > max_px:
        b = math.sqrt(h * w / max_px)
        h1, w1 = max(f, int(h / b / f) * f), max(f, int(w / b / f) * f)
    elif h1 * w1 < min_px:
        b = math.sqrt(min_px / (h * w))
        h1, w1 = math.ceil(h * b / f) * f, math.ceil(w * b / f) * f
    return h1, w1


def ref_pixels(data: bytes) -> tuple[np.ndarray, tuple[int, int]]:
    """float32 patches (n, 3*P*P) and the grid, one patch at a time."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    h1, w1 = ref_size(img.height, img.width)
    x = np.asarray(img.resize((w1, h1), Image.BICUBIC), dtype=np.float32) / 255
    x = (x - MEAN) / STD
    gh, gw = h1 // P, w1 // P
    out = []
    for gy in range(gh):
        for gx in range(gw):
            patch = x[gy * P : (gy + 1) * P, gx * P : (gx + 1) * P, :]  # (y, x, c)
            out.append(np.transpose(patch, (2, 0, 1)).reshape(-1))  # (c, y, x)
    return np.stack(out), (gh, gw)


# ---- helpers -----------------------------------------------------------------------------


def images_under_test() -> list[tuple[str, bytes]]:
    shipped = [(n.rsplit(".", 1)[1], d) for n, d in shipped_photos()]
    assert shipped, "matplotlib's sample photographs are the decode tests' real images"
    # generated: thumbnails to large, jpg/png/webp, RGB/L/RGBA/P, extreme aspect ratios
    extreme = [("png", encode(np.full((3, 900, 3), 200, np.uint8), "png")),
               ("jpg", encode(np.full((700, 20, 3), 90, np.uint8), "jpg"))]  # fmt: skip
    return random_images(12, seed=3, sizes=(5, 500)) + extreme + shipped


def make_plan(root: Path, sources: list[dict[str, Any]], **over: Any) -> overlord.Plan:
    data: dict[str, Any] = {
        "seed": 5,
        "sources": sources,
        "batch": {"tokens_per_step": 4096, "max_seq_len": 2048},
        "world": {"dp": 2},
        "vision": {},
        "loading": {"timeout_s": 20},
        "shuffle": {"block_bytes": 2048, "window_blocks": 3},
    }
    data.update(over)
    return validate_plan(data, base_dir=root)


def shard_items(plan: overlord.Plan, i: int = 0) -> Any:
    spec = plan.sources[i]
    files = list_files(spec.name, [spec.path], str(plan.base_dir))  # type: ignore[list-item]
    return load_shard_items(plan, spec, files, BytesTokenizer(), 0, 0)


TAR = {"name": "w", "path": "a.tar", "format": "webdataset", "text_field": "txt"}
PQ = {"name": "p", "path": "b.parquet", "format": "parquet", "image_field": "image"}


# ---- the rule and the pixels -------------------------------------------------------------


@pytest.mark.parametrize("h,w", [(1, 1), (10, 10), (56, 56), (100, 200), (4000, 3000),
                                 (3, 900), (700, 20), (1080, 1920), (27, 29)])  # fmt: skip
def test_resize_rule(h: int, w: int) -> None:
    from overlord.plan.vision import VisionSpec, resized

    assert resized(h, w, VisionSpec()) == ref_size(h, w)
    h1, w1 = resized(h, w, VisionSpec())
    assert h1 % 28 == 0 and w1 % 28 == 0


def test_pixels_tokens_and_ids_equal_an_independent_implementation(tmp_path: Path) -> None:
    imgs = images_under_test()
    image_text_tar(tmp_path / "a.tar", imgs)
    image_text_parquet(tmp_path / "b.parquet", imgs)
    plan = make_plan(tmp_path, [TAR, PQ])
    for s, keyed in ((0, True), (1, False)):
        items = shard_items(plan, s)
        assert len(items) == len(imgs) and not items.skipped
        for j in range(len(items)):
            i = int(items.row[j])  # the sample's place in the tar, the Parquet row
            if keyed:
                assert items.keys[j] == f"s{i:06d}"
            want, grid = ref_pixels(imgs[i][1])
            assert tuple(items.grid[j]) == grid and items.patches[j] == grid[0] * grid[1]
            at = int(items.patch_start[j])
            got = normalize(items.pixels[at : at + items.patches[j]], plan.vision)
            assert got.dtype == np.float32 and np.array_equal(got, want)
            n_img = grid[0] * grid[1] // (M * M)
            toks = items.tokens[items.start[j] : items.start[j] + items.length[j]]
            text = list(caption(i).encode()) + [256]
            assert toks.tolist() == [258] * n_img + text


def test_batches_carry_images_in_sample_order(tmp_path: Path) -> None:
    imgs = random_images(16, seed=4, sizes=(20, 200))
    image_text_tar(tmp_path / "a.tar", imgs)
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"text": f"plain text {i} " * (1 + i % 9)}) + "\n" for i in range(40))
    )
    text = {"name": "t", "path": "t.jsonl", "format": "jsonl"}
    plan = make_plan(tmp_path, [TAR, text], batch={"tokens_per_step": 2048, "max_seq_len": 512})
    seen = 0
    with overlord.Loader(plan) as loader:
        clients = [loader.client(r) for r in range(2)]
        for _ in range(3):
            for c in clients:
                b = next(c)
                assert b.pixel_values is not None and b.image_grid is not None
                assert b.image_grid.dtype == np.int32 and b.pixel_values.dtype == np.float32
                assert b.labels is not None and b.input_ids is not None
                assert not (b.labels == 258).any()  # no loss predicts an image token
                assert (b.labels[b.input_ids == 258] == -100).all()  # none at an image token
                want, grids = [], []
                for smp in b.samples:
                    if smp.source == "w":
                        i = int(smp.id.split(":s")[1].split("#")[0])
                        if "#" in smp.id and not smp.id.endswith("#0"):
                            continue
                        px, grid = ref_pixels(imgs[i][1])
                        want.append(px)
                        grids.append(grid)
                        seen += 1
                assert b.image_grid.tolist() == [list(g) for g in grids]
                assert np.array_equal(b.pixel_values, np.concatenate(want) if want else
                                      np.zeros((0, 588), np.float32))  # fmt: skip
                n_tokens = int((b.input_ids == 258).sum())
                assert n_tokens == int((b.image_grid.prod(axis=1) // 4).sum())
    assert seen > 0


# ---- bad images, bad samples -------------------------------------------------------------


def test_corrupt_image_names_file_and_member(tmp_path: Path) -> None:
    good = random_images(4, seed=1)
    samples = [(f"k{i}", {e: d, "txt": b"a caption"}) for i, (e, d) in enumerate(good)]
    samples.insert(2, ("bad", {"jpg": b"\xff\xd8 not a jpeg", "txt": b"broken"}))
    write_tar(tmp_path / "a.tar", samples)
    plan = make_plan(tmp_path, [TAR])
    with pytest.raises(SourceError, match=r"a\.tar, row 2: member bad\.jpg: cannot decode"):
        shard_items(plan)
    skip = make_plan(tmp_path, [TAR], on_error="skip")
    items = shard_items(skip)
    assert len(items) == 4 and len(items.skipped) == 1 and "bad.jpg" in str(items.skipped[0])
    assert sorted(items.keys) == ["k0", "k1", "k2", "k3"]


def test_corrupt_parquet_image_names_file_and_row(tmp_path: Path) -> None:
    imgs = random_images(5, seed=9, sizes=(20, 120))
    imgs[3] = ("png", b"\x89PNG\r\n truncated")
    image_text_parquet(tmp_path / "b.parquet", imgs)
    with pytest.raises(SourceError, match=r"b\.parquet, row 3: the image: cannot decode"):
        shard_items(make_plan(tmp_path, [PQ]))
    items = shard_items(make_plan(tmp_path, [PQ], on_error="skip"))
    assert sorted(items.row.tolist()) == [0, 1, 2, 4] and len(items.skipped) == 1
    assert "b.parquet, row 3" in str(items.skipped[0])


def test_missing_members_are_bad_records(tmp_path: Path) -> None:
    (e, d), = random_images(1)  # fmt: skip
    write_tar(tmp_path / "a.tar", [("a", {"txt": b"no image"}), ("b", {e: d}),
                                   ("c", {e: d, "json": b'{"txt": "from json"}'})])  # fmt: skip
    with pytest.raises(SourceError, match="sample 'a' has no image member"):
        shard_items(make_plan(tmp_path, [TAR]))
    items = shard_items(make_plan(tmp_path, [TAR], on_error="skip"))
    assert items.keys == ["c"] and len(items.skipped) == 2
    n = int(items.length[0])
    assert (
        items.tokens[n - 10 : n - 1].tobytes()
        == np.frombuffer(b"from json", np.uint8).astype(np.int32).tobytes()
    )


def test_image_longer_than_a_row_is_an_error_naming_it(tmp_path: Path) -> None:
    big = ("png", encode(np.zeros((600, 600, 3), np.uint8), "png"))
    imgs = [big, *random_images(2, seed=2, sizes=(10, 40))]
    image_text_parquet(tmp_path / "b.parquet", imgs)
    batch = {"tokens_per_step": 256, "max_seq_len": 128}
    with pytest.raises(SourceError, match=r"b\.parquet, row 0: the image gives \d+ image tokens"):
        shard_items(make_plan(tmp_path, [PQ], batch=batch))
    items = shard_items(make_plan(tmp_path, [PQ], batch=batch, on_error="skip"))
    assert sorted(items.row.tolist()) == [1, 2] and len(items.skipped) == 1


# ---- the block rule of a tar -------------------------------------------------------------


def test_tar_blocks_follow_the_first_members_offset(tmp_path: Path) -> None:
    from overlord.sources.files import Shard
    from overlord.sources.webdataset import WebDatasetReader, split_member

    imgs = random_images(14, seed=6, sizes=(5, 120))
    image_text_tar(tmp_path / "a.tar", imgs)
    B = 3000
    first: dict[str, int] = {}
    with tarfile.open(tmp_path / "a.tar") as tar:
        for m in tar.getmembers():
            first.setdefault(split_member(m.name)[0], m.offset)
    want: dict[int, list[int]] = {}
    for row, key in enumerate(first):
        want.setdefault(first[key] // B, []).append(row)
    reader = WebDatasetReader("w", Shard(str(tmp_path / "a.tar"), "a.tar"), "txt", None, B, False)
    got = {b.number: b.rows.tolist() for b in reader.blocks() if len(b.rows)}
    numbers = [b.number for b in WebDatasetReader(
        "w", Shard(str(tmp_path / "a.tar"), "a.tar"), "txt", None, B, False).blocks()]  # fmt: skip
    assert got == want
    assert numbers == list(range(len(numbers)))  # empty blocks between keep the count


# ---- the plan ----------------------------------------------------------------------------


def test_plan_problems(tmp_path: Path) -> None:
    src = [{"name": "w", "path": "*.tar", "format": "webdataset"},
           {"name": "j", "path": "*.jsonl", "format": "jsonl", "image_field": "img"}]  # fmt: skip
    data = {"sources": src, "batch": {"tokens_per_step": 64, "max_seq_len": 64},
            "balance": {"cost": {"alpha": 1, "beta": 0, "patch_alpha": 1.0,
                                 "encoder": {"params": 1, "layers": 1, "hidden": 1}}}}  # fmt: skip
    with pytest.raises(PlanError) as e:
        validate_plan(data)
    msg = str(e.value)
    assert "sources[0]: an image source needs the plan's vision section" in msg
    assert "sources[1].image_field: jsonl sources hold no images" in msg
    assert "balance.cost.encoder: give either encoder or patch_alpha/patch_beta" in msg


# ---- hybrid cost and balance -------------------------------------------------------------


def test_encoder_cost_from_its_shape() -> None:
    spec = validate_plan(
        {
            "sources": [{"name": "a", "path": "x", "format": "jsonl"}],
            "batch": {"tokens_per_step": 64, "max_seq_len": 64},
            "balance": {
                "cost": {
                    "model": {"params": 10, "layers": 2, "hidden": 3},
                    "encoder": {"params": 5, "layers": 4, "hidden": 7},
                }
            },
        }  # fmt: skip
    ).balance.cost
    model = CostModel.from_spec(spec)
    llm, enc = module_costs(model, np.array([10, 20]), np.array([0, 8]), 1, None)
    assert llm.tolist() == [60 * 10 + 36 * 100, 60 * 20 + 36 * 400]
    assert enc.tolist() == [0.0, 30 * 8 + 6 * 4 * 7 * 64]


def test_hybrid_is_never_worse_than_llm_only_and_better_on_a_mix() -> None:
    rng = np.random.default_rng(0)
    wins = 0
    for trial in range(30):
        n = int(rng.integers(8, 24))
        tokens = rng.integers(20, 400, n)
        patches = np.where(rng.random(n) < 0.5, rng.integers(4, 2000, n), 0)
        llm = 1.0 * tokens + 0.01 * tokens**2
        enc = 0.5 * patches + 0.002 * patches.astype(np.float64) ** 2
        dp, rpr, cap = 4, 2, 1024
        ref = np.zeros(n, np.int64)
        fill = np.zeros(dp * rpr, np.int64)
        for i, t in enumerate(tokens.tolist()):  # a reference packing: first fit
            r = int(np.flatnonzero(fill + t <= cap)[0])
            ref[i], fill[r] = r, fill[r] + t
        out = {}
        for m in (Modules.HYBRID, Modules.LLM):
            row = assign_modules(m, llm, enc, dp, rpr, kk(tokens, ref, dp, rpr, cap))
            out[m] = rank_costs(llm + enc, row, dp, rpr).max()
        assert out[Modules.HYBRID] <= out[Modules.LLM] * (1 + 1e-12), trial
        wins += out[Modules.HYBRID] < out[Modules.LLM] * 0.99
    assert wins >= 10


@settings(max_examples=80, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.integers(1, 512), st.one_of(st.just(0), st.integers(1, 3000))),
        min_size=1,
        max_size=30,
    ),
    dp=st.integers(1, 4),
    rpr=st.integers(1, 3),
    enc_beta=st.sampled_from([0.0, 1e-4, 0.01, 1.0]),
)
# kk on the sum leaves a heavier rank than kk on the LLM term here (found by a search: about
# 1 input in 250 of this test's kind), so hybrid must keep the LLM's assignment
@example(
    items=[(242, 0), (363, 1757), (359, 1517), (418, 0), (238, 2773), (323, 0)],
    dp=2,
    rpr=3,
    enc_beta=0.0,
)
def test_hybrid_is_never_worse_than_llm_only_on_the_combined_cost(
    items: list[tuple[int, int]], dp: int, rpr: int, enc_beta: float
) -> None:
    """The property: whatever the items, hybrid's most loaded rank (encoder + LLM) <= llm's."""
    tokens = np.array([t for t, _ in items], np.int64)
    patches = np.array([n for _, n in items], np.float64)
    llm = 1.0 * tokens + 0.01 * tokens.astype(np.float64) ** 2
    enc = 0.5 * patches + enc_beta * patches**2
    cap = 512
    ref, fill = np.full(len(tokens), -1, np.int64), np.zeros(dp * rpr, np.int64)
    for i, t in enumerate(tokens.tolist()):  # first fit; what does not fit is left out
        free = np.flatnonzero(fill + t <= cap)
        if len(free):
            ref[i], fill[free[0]] = free[0], fill[free[0]] + t
    keep = ref >= 0
    tokens, llm, enc, ref = tokens[keep], llm[keep], enc[keep], ref[keep]
    out = {}
    for m in (Modules.HYBRID, Modules.LLM):
        row = assign_modules(m, llm, enc, dp, rpr, kk(tokens, ref, dp, rpr, cap))
        fills = np.bincount(row, weights=tokens, minlength=dp * rpr)
        assert (fills <= cap).all()  # every row still fits
        out[m] = rank_costs(llm + enc, row, dp, rpr).max()
    assert out[Modules.HYBRID] <= out[Modules.LLM] * (1 + 1e-12)


def test_dump_and_summary_report_both_terms(tmp_path: Path) -> None:
    image_text_tar(tmp_path / "a.tar", random_images(12, seed=8, sizes=(20, 300)))
    plan = make_plan(
        tmp_path,
        [TAR],
        batch={"tokens_per_step": 2048, "max_seq_len": 1024},
        balance={"cost": {"alpha": 1.0, "beta": 0.001, "patch_alpha": 2.0, "patch_beta": 0.01}},
    )
    out = io.StringIO()
    summary = run_plan(plan, 2, dump=out, progress=False)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert len(lines) == 4
    for line in lines:
        assert line["cost_encoder"] > 0 and line["cost_llm"] > 0
        assert line["cost"] == pytest.approx(line["cost_llm"] + line["cost_encoder"])
        assert all(":s0000" in s["id"] for s in line["samples"])  # relpath:key
    costs = summary["rank_cost"]
    assert len(costs["cost_llm"]) == 2 and len(costs["cost_encoder"]) == 2
    again = io.StringIO()
    run_plan(plan.with_dp(1), 2, dump=again, progress=False)
    ids = {(x["step"], s["id"]) for x in lines for s in x["samples"]}
    assert ids == {(x["step"], s["id"]) for x in map(json.loads, again.getvalue().splitlines())
                   for s in x["samples"]}  # fmt: skip


def kk(tokens: np.ndarray, ref: np.ndarray, dp: int, rpr: int, cap: int) -> Any:
    """``assign`` with kk for these items, given a cost (what the planner passes)."""
    return lambda cost: assign(tokens, cost, ref, dp, rpr, cap, BalanceMethod.KK)


@pytest.mark.ray
@pytest.mark.integration
def test_images_from_the_data_process_are_the_embedded_images(tmp_path: Path) -> None:
    """A tar's samples are named by key: the names reach the trainer from the data process."""
    image_text_tar(tmp_path / "a.tar", random_images(12, seed=6, sizes=(20, 160)))
    plan = make_plan(tmp_path, [TAR], batch={"tokens_per_step": 2048, "max_seq_len": 512})

    def batches(runtime: str) -> list[Any]:
        with overlord.Loader(plan, runtime=runtime) as loader:
            clients = [loader.client(r) for r in range(2)]
            return [next(c) for _ in range(3) for c in clients]

    for got, want in zip(batches("process"), batches("inline"), strict=True):
        assert got.samples == want.samples and ".tar:s0000" in got.samples[0].id  # relpath:key
        assert np.array_equal(got.input_ids, want.input_ids)
        assert got.pixel_values is not None and want.pixel_values is not None
        assert np.array_equal(got.pixel_values, want.pixel_values)


@pytest.mark.integration
@pytest.mark.parametrize("site", ["actor", "trainer"])
def test_images_on_ray_are_the_embedded_images(ray_session: Any, tmp_path: Path, site: str) -> None:
    """Patches travel from SourceLoader actors as numpy arrays: the batches equal embedded ones."""
    image_text_tar(tmp_path / "a.tar", random_images(12, seed=6, sizes=(20, 160)))
    plan = make_plan(
        tmp_path,
        [TAR],
        batch={"tokens_per_step": 2048, "max_seq_len": 512},
        placement={"constructors": site, "loader_processes": 1 if site == "trainer" else None},
    )

    def batches(runtime: str) -> list[Any]:
        with overlord.Loader(plan, runtime=runtime) as loader:
            clients = [loader.client(r) for r in range(2)]
            return [next(c) for _ in range(3) for c in clients]

    for got, want in zip(batches("ray"), batches("inline")):
        assert [s.id for s in got.samples] == [s.id for s in want.samples]
        assert np.array_equal(got.input_ids, want.input_ids)
        assert np.array_equal(got.labels, want.labels)
        assert got.pixel_values is not None and want.pixel_values is not None
        assert np.array_equal(got.pixel_values, want.pixel_values)
        assert np.array_equal(got.image_grid, want.image_grid)
    assert any(len(b.pixel_values) for b in batches("inline") if b.pixel_values is not None)
