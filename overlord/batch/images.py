"""A batch's images: gathered from the loaders' payloads, in sample order, made float32.

Loaders hold an item's image as uint8 patches (``overlord.sources.images``);
the DataConstructor puts the images of a rank's samples one after the other
(a sample has at most one: the first item of an image-text record), makes
them float32 and normalized, and sets ``labels`` to -100 on image tokens:
at every position that holds one, and wherever the label is one (no loss
predicts an image token). ``labels[t]`` is the token after ``t``, so the
caption's first token is not a label of the image's last token: the caption
is learned from its second token on, with the whole image in context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from overlord.batch import Batch
from overlord.plan.vision import VisionSpec
from overlord.sources.images import normalize


class BatchImages:
    """What ``take`` answered about images, for a rank's ``n`` samples."""

    def __init__(self, n: int):
        self.grid = np.zeros((n, 2), dtype=np.int32)
        self.pixels: list[np.ndarray | None] = [None] * n
        self.keys: list[str | None] = [None] * n

    def add(self, mine: np.ndarray, got: dict[str, Any]) -> None:
        """A loader's answer for samples ``mine`` (a text source's has no images)."""
        if "grid" not in got:
            return
        grid = got["grid"]
        at = np.concatenate(([0], np.cumsum(grid[:, 0].astype(np.int64) * grid[:, 1])))
        for i, j in enumerate(mine.tolist()):
            self.grid[j] = grid[i]
            self.pixels[j] = got["pixels"][at[i] : at[i + 1]]
        if "keys" in got:
            raw = got["keys"].tobytes()
            ends = np.cumsum(got["key_lengths"]).tolist()
            for j, lo, hi in zip(mine.tolist(), [0] + ends[:-1], ends):
                self.keys[j] = raw[lo:hi].decode()

    def finish(self, batch: Batch, v: VisionSpec, rp: dict[str, Any], image_id: int) -> None:
        """Set the batch's images, its labels on image tokens and its cost terms."""
        has = (self.grid[:, 0] * self.grid[:, 1]) > 0
        parts = [p for p, h in zip(self.pixels, has.tolist()) if h and p is not None]
        width = 3 * v.patch_size * v.patch_size
        raw = np.concatenate(parts) if parts else np.zeros((0, width), np.uint8)
        batch.pixel_values = normalize(raw, v)
        batch.image_grid = self.grid[has]
        if batch.labels is not None:
            batch.labels[batch.labels == image_id] = -100
            if batch.input_ids is not None:
                batch.labels[batch.input_ids == image_id] = -100
        if "cost_llm" in rp:
            batch.cost_llm, batch.cost_encoder = rp["cost_llm"], rp["cost_encoder"]
