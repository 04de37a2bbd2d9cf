"""Images in the plan: the ``vision:`` section, Qwen2-VL's resize rule, and the hybrid cost.

The rule that turns an image of ``h x w`` pixels into patches and tokens (the docs'
images guide states it as the contract): with ``f = patch_size * merge_size`` and
``rnd(x) = floor(x + 0.5)``, ``h1 = max(f, rnd(h / f) * f)`` and
``w1 = max(f, rnd(w / f) * f)``; if ``h1 * w1 > max_pixels`` then, with
``b = sqrt(h * w / max_pixels)``, ``h1 = max(f, floor(h / b / f) * f)`` and
``w1 = max(f, floor(w / b / f) * f)``; else if ``h1 * w1 < min_pixels`` then,
with ``b = sqrt(min_pixels / (h * w))``, ``h1 = ceil(h * b / f) * f`` and
``w1 = ceil(w * b / f) * f``. The image has ``(h1 / p) * (w1 / p)`` patches and
``(h1 / p) * (w1 / p) / merge_size**2`` image tokens.

A vision-language model has two costs per sample: its image's, in the vision
encoder (``alpha_e * n + beta_e * n**2`` for ``n`` patches: attention within
the image), and the fused sequence's, in the LLM (today's ``alpha * L + beta *
L**2``). ``balance.modules: hybrid`` balances their sum, ``llm`` the LLM's alone
(:mod:`overlord.plan.hybrid`).
"""

from __future__ import annotations

import math
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

IMAGE_PAD = "<|image_pad|>"  # the image token of an hf tokenizer, when it has one
BYTES_IMAGE_ID = 258  # the bytes tokenizer's image token (0-255 bytes, 256 end, 257 pad)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # webdataset members that are images


class Modules(str, Enum):
    """What the balancer balances: the encoder and the LLM together, or the LLM alone."""

    HYBRID = "hybrid"
    LLM = "llm"


class VisionSpec(BaseModel):
    """How images become patches and tokens (Qwen2-VL's dynamic resolution)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    patch_size: int = Field(14, gt=0, description="side of a square patch, in pixels")
    merge_size: int = Field(
        2, gt=0, description="patches merged per side into one image token (merge_size² each)"
    )
    min_pixels: int = Field(
        56 * 56, gt=0, description="images with fewer pixels are scaled up (Qwen2-VL's rule)"
    )
    max_pixels: int = Field(
        1280 * 28 * 28,
        gt=0,
        description="images with more pixels are scaled down (Qwen2-VL's rule)",
    )
    mean: tuple[float, float, float] = Field(
        (0.48145466, 0.4578275, 0.40821073),
        description="per-channel mean subtracted after scaling to [0, 1]",
    )
    std: tuple[float, float, float] = Field(
        (0.26862954, 0.26130258, 0.27577711),
        description="per-channel standard deviation divided by after the mean",
    )
    image_token_id: int | str = Field(
        "auto",
        description="auto: 258 for the bytes tokenizer, the id of '<|image_pad|>' for hf",
    )

    @property
    def factor(self) -> int:
        """``patch_size * merge_size``: both sides of a resized image are multiples of it."""
        return self.patch_size * self.merge_size


def resized(h: int, w: int, v: VisionSpec) -> tuple[int, int]:
    """``(h1, w1)``: the size an ``h x w`` image is resized to (the rule above).

    >>> v = VisionSpec()
    >>> resized(100, 200, v), resized(10, 10, v), resized(4000, 3000, v)
    ((112, 196), (56, 56), (1148, 840))
    """
    f = v.factor
    h1 = max(f, math.floor(h / f + 0.5) * f)
    w1 = max(f, math.floor(w / f + 0.5) * f)
    if h1 * w1 > v.max_pixels:
        b = math.sqrt(h * w / v.max_pixels)
        h1 = max(f, math.floor(h / b / f) * f)
        w1 = max(f, math.floor(w / b / f) * f)
    elif h1 * w1 < v.min_pixels:
        b = math.sqrt(v.min_pixels / (h * w))
        h1 = math.ceil(h * b / f) * f
        w1 = math.ceil(w * b / f) * f
    return h1, w1


def image_tokens(grid_h: int, grid_w: int, v: VisionSpec) -> int:
    """Tokens of an image of ``grid_h x grid_w`` patches in the LLM's sequence."""
    return grid_h * grid_w // (v.merge_size * v.merge_size)


def vision_problems(data: dict[str, object]) -> list[tuple[str, str]]:
    """Problems between the sources' image fields, ``vision`` and ``balance`` (plain data)."""
    problems: list[tuple[str, str]] = []
    sources = data.get("sources")
    has_vision = data.get("vision") is not None
    for i, src in enumerate(sources if isinstance(sources, list) else []):
        if not isinstance(src, dict):
            continue
        fmt, image = src.get("format"), src.get("image_field")
        if fmt == "jsonl" and image is not None:
            problems.append((f"sources[{i}].image_field", "jsonl sources hold no images"))
        if (fmt == "webdataset" or image is not None) and not has_vision:
            problems.append((f"sources[{i}]", "an image source needs the plan's vision section"))
    v = data.get("vision")
    if isinstance(v, dict):
        tid = v.get("image_token_id", "auto")
        if isinstance(tid, str) and tid != "auto":
            problems.append(("vision.image_token_id", f"an id or 'auto', found '{tid}'"))
        lo, hi = v.get("min_pixels"), v.get("max_pixels")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            problems.append(("vision.min_pixels", f"{lo} is above max_pixels {hi}"))
    balance = data.get("balance")
    cost = balance.get("cost") if isinstance(balance, dict) else None
    patch = isinstance(cost, dict) and (cost.get("patch_alpha") or cost.get("patch_beta"))
    if isinstance(cost, dict) and cost.get("encoder") is not None and patch:
        problems.append(("balance.cost.encoder", "give either encoder or patch_alpha/patch_beta"))
    return problems
