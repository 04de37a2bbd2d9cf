"""Images: decoding throughput per core, and hybrid against LLM-only balance.

1. **Decode + resize + patchify per core.** overlord's path (``image_patches``,
   the uint8 patches a SourceLoader holds, then ``normalize``, the float32 the
   constructor makes) against a plain Pillow loop doing the same work written
   the obvious way (open, RGB, BICUBIC resize, float32 / 255, normalize,
   reshape into patches), on one thread, the same images, best of ``--repeat``.
   Also the whole SourceLoader path on one thread: a WebDataset tar read as a
   stream, samples grouped, images decoded and patched, captions tokenized and
   fused (``load_shard_items``). Images: generated (thumbnails to about
   1000 px, JPEG/PNG/WebP) and matplotlib's sample photographs.
2. **Hybrid against LLM-only balance.** Steps of a mix of image-text items
   (images from thumbnails to ``max_pixels``, captions of 10 to 300 tokens) and
   text documents (up to ``max_seq_len``), costed with a 7B LLM (alpha = 6N,
   beta = 6 * layers * hidden) and a 600M encoder of 32 layers, hidden 1280;
   assigned with ``kk`` by ``assign_modules`` with ``modules: hybrid`` and
   ``llm``. Reported: the most loaded rank's encoder + LLM cost over the lower
   bound ``max(total / dp, largest item)``, mean and p95 over the steps, and
   the per-rank-loader baseline (``none``).

The autoscaler sizing an image source beside text sources is
``benchmarks/vision_autoscale.py``.

Run from the repository root::

    .venv/bin/python -m benchmarks.vision            # about a minute
    .venv/bin/python -m benchmarks.vision --quick
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from overlord.ops.vision_data import (
    draw,
    encode,
    image_text_tar,
    shipped_photos,
)
from overlord.plan import balance as bal
from overlord.plan.hybrid import assign_modules
from overlord.plan.spec import BalanceMethod, validate_plan
from overlord.plan.vision import Modules, VisionSpec, resized
from overlord.sources.catalog import list_files
from overlord.sources.images import image_patches, normalize
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import BytesTokenizer


def corpus(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    out = [(name.rsplit(".", 1)[1], data) for name, data in shipped_photos()]
    fmts = ("jpg", "jpg", "png", "webp")  # mostly JPEG, as in web image-text data
    for i in range(n):
        side = int(np.exp(rng.uniform(np.log(32), np.log(1000))))
        h, w = side, int(side * rng.uniform(0.5, 2.0))
        out.append((fmts[i % len(fmts)], encode(draw(rng, h, w), fmts[i % len(fmts)])))
    return out


def plain_pillow(data: bytes, v: VisionSpec) -> np.ndarray:
    """The same work, written the obvious way."""
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    h1, w1 = resized(img.height, img.width, v)
    x = np.asarray(img.resize((w1, h1), Image.BICUBIC), dtype=np.float32) / 255
    x = (x - np.asarray(v.mean, np.float32)) / np.asarray(v.std, np.float32)
    p = v.patch_size
    x = x.reshape(h1 // p, p, w1 // p, p, 3).transpose(0, 2, 4, 1, 3)
    return x.reshape(-1, 3 * p * p)


def overlord_path(data: bytes, v: VisionSpec) -> np.ndarray:
    u8 = image_patches(data, v)
    return normalize(u8.reshape(-1, u8.shape[-1]), v)


def best(fn, images, v, repeat):  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _, data in images:
            fn(data, v)
        times.append(time.perf_counter() - t0)
    return min(times)


def throughput(n: int, repeat: int) -> None:
    v = VisionSpec()
    images = corpus(n)
    pixels = sum(int(np.prod(resized(*_hw(d), v))) for _, d in images)
    for _, d in images[:5]:
        assert np.array_equal(plain_pillow(d, v), overlord_path(d, v))
    t_plain = best(plain_pillow, images, v, repeat)
    t_ovl = best(overlord_path, images, v, repeat)
    with tempfile.TemporaryDirectory() as tmp:
        image_text_tar(Path(tmp) / "a.tar", images)
        plan = validate_plan(
            {
                "sources": [
                    {"name": "w", "path": "a.tar", "format": "webdataset", "text_field": "txt"}
                ],
                "batch": {"tokens_per_step": 8192, "max_seq_len": 8192},
                "vision": {},
            },
            base_dir=tmp,
        )
        spec = plan.sources[0]
        files = list_files("w", ["a.tar"], tmp)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            items = load_shard_items(plan, spec, files, BytesTokenizer(), 0, 0)
            times.append(time.perf_counter() - t0)
        assert len(items) == len(images)
        t_loader = min(times)
    mb = sum(len(d) for _, d in images) / 1e6
    print(f"decode + resize + patchify, one thread: {len(images)} images, {mb:.1f} MB encoded, "
          f"{pixels / 1e6:.1f} Mpixel after resize")  # fmt: skip
    for name, t in (("plain Pillow loop", t_plain), ("overlord (uint8 patches + normalize)", t_ovl),
                    ("overlord SourceLoader path (tar stream)", t_loader)):  # fmt: skip
        print(f"  {name:42s} {len(images) / t:8.1f} images/s  {pixels / t / 1e6:6.1f} Mpx/s  "
              f"{t_plain / t:5.2f}x plain")  # fmt: skip


def _hw(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.height, img.width


def balance(steps: int, dp: int, seq: int, image_share: float) -> None:
    rng = np.random.default_rng(1)
    v = VisionSpec()
    llm_a, llm_b = 6 * 7.0e9, 6 * 32 * 4096
    enc_a, enc_b = 6 * 6.0e8, 6 * 32 * 1280
    rpr = 2
    res: dict[str, list[float]] = {"hybrid": [], "llm": [], "none": []}
    for _ in range(steps):
        tokens, patches = [], []
        budget = dp * rpr * seq
        while sum(tokens) < budget * 0.97:
            if rng.random() < image_share:
                side = np.exp(rng.uniform(np.log(40), np.log(2000)))
                h1, w1 = resized(int(side), int(side * rng.uniform(0.5, 2)), v)
                n = (h1 // 14) * (w1 // 14)
                t = n // 4 + int(rng.integers(10, 300))
            else:
                n, t = 0, int(min(seq, np.exp(rng.uniform(np.log(50), np.log(4 * seq)))))
            if sum(tokens) + t > budget:
                break
            tokens.append(t)
            patches.append(n)
        tok, pat = np.array(tokens), np.array(patches, dtype=np.float64)
        llm = llm_a * tok + llm_b * tok.astype(np.float64) ** 2
        enc = enc_a * pat + enc_b * pat**2
        ref = _first_fit(tok, dp * rpr, seq)
        keep = ref >= 0
        tok, llm, enc, ref = tok[keep], llm[keep], enc[keep], ref[keep]
        total = llm + enc
        lb = bal.lower_bound(total, dp)
        for name, modules in (("hybrid", Modules.HYBRID), ("llm", Modules.LLM)):
            row = assign_modules(modules, llm, enc, dp, rpr, _kk(tok, ref, dp, rpr, seq))
            res[name].append(bal.rank_costs(total, row, dp, rpr).max() / lb)
        res["none"].append(bal.rank_costs(total, ref, dp, rpr).max() / lb)
    print(f"balance, DP {dp}, max_seq_len {seq}, image share of items {image_share:.0%}, "
          f"{steps} steps: (encoder + LLM) of the most loaded rank / lower bound")  # fmt: skip
    for name, r in res.items():
        print(f"  {name:7s} mean {np.mean(r):.4f}  p95 {np.percentile(r, 95):.4f}")
    gain = np.mean(res["llm"]) / np.mean(res["hybrid"])
    print(f"  hybrid over llm-only: {gain:.3f}x on the step time the model predicts")


def _first_fit(tokens: np.ndarray, rows: int, cap: int) -> np.ndarray:
    fill = np.zeros(rows, np.int64)
    out = np.full(len(tokens), -1, np.int64)
    for i, t in enumerate(tokens.tolist()):
        free = np.flatnonzero(fill + t <= cap)
        if len(free):
            out[i] = free[0]
            fill[free[0]] += t
    return out


def _kk(tokens: np.ndarray, ref: np.ndarray, dp: int, rpr: int, seq: int) -> Any:
    """``assign`` with kk for these items, given a cost (what the planner passes)."""
    return lambda cost: bal.assign(tokens, cost, ref, dp, rpr, seq, BalanceMethod.KK)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    throughput(40 if a.quick else 150, 2 if a.quick else 3)
    for dp, seq, share in ((8, 8192, 0.5), (8, 4096, 0.7), (32, 8192, 0.5)):
        balance(5 if a.quick else 30, dp, seq, share)


if __name__ == "__main__":
    main()
