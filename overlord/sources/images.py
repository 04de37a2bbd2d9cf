"""Images to pixels, patches and tokens, in the SourceLoader (the rule: overlord.plan.vision).

An image is decoded by Pillow, converted to RGB (``Image.convert("RGB")``),
resized to ``(w1, h1)`` (:func:`overlord.plan.vision.resized`) with
``Image.BICUBIC`` and cut into ``patch_size`` squares, row-major over the
``(h1/p, w1/p)`` grid, each flattened in ``(channel, y, x)`` order. A loader
holds the patches as uint8 (a quarter of float32's memory, and of what
crosses to the constructor); :func:`normalize` makes them float32 ``x / 255``,
then ``(x - mean) / std`` per channel, in the DataConstructor.

In the token sequence an image is ``image_tokens`` copies of the image token
id, before its text: :func:`fuse_images` prepends them to each record's text
tokens. Pillow is the ``vision`` extra: ``pip install 'overlord-data[vision]'``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from overlord.errors import PlanError, SourceError
from overlord.plan.vision import BYTES_IMAGE_ID, IMAGE_PAD, VisionSpec, image_tokens, resized
from overlord.sources.window import Piece, Window


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("image sources need Pillow: pip install 'overlord-data[vision]'") from e
    return Image


def image_patches(data: bytes, v: VisionSpec) -> np.ndarray:
    """The uint8 patches ``(h1/p, w1/p, 3*p*p)`` of one encoded image.

    Raises whatever Pillow raises for bytes it cannot decode.
    """
    Image = _pillow()
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    h1, w1 = resized(rgb.height, rgb.width, v)
    pixels = np.asarray(rgb.resize((w1, h1), Image.BICUBIC))  # (h1, w1, 3) uint8
    p = v.patch_size
    gh, gw = h1 // p, w1 // p
    grid = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3)  # (gy, gx, c, y, x)
    return grid.reshape(gh, gw, 3 * p * p)


def normalize(patches: np.ndarray, v: VisionSpec) -> np.ndarray:
    """float32 ``(x / 255 - mean) / std`` of uint8 patches ``(n, 3*p*p)``, per channel.

    The rule's operations in its order, in float32, each in place in the one
    output array: the same bits as the expression, without its three
    temporaries (a 64k-patch step's are 150 MB each, and their first touch
    cost more than the arithmetic).
    """
    pp = v.patch_size * v.patch_size
    mean = np.repeat(np.asarray(v.mean, dtype=np.float32), pp)
    std = np.repeat(np.asarray(v.std, dtype=np.float32), pp)
    out = patches.astype(np.float32)
    np.divide(out, np.float32(255), out=out)
    np.subtract(out, mean, out=out)
    np.divide(out, std, out=out)
    return out


def image_token_id(v: VisionSpec, tokenizer: Any) -> int:
    """The id an image token has: the plan's, or ``auto`` (258 for bytes, hf: ``<|image_pad|>``)."""
    if isinstance(v.image_token_id, int):
        return v.image_token_id
    from overlord.sources.tokenizers import BytesTokenizer

    if isinstance(tokenizer, BytesTokenizer):
        return BYTES_IMAGE_ID
    found = tokenizer.token_id(IMAGE_PAD) if hasattr(tokenizer, "token_id") else None
    if found is None:
        raise PlanError(
            [
                (
                    "vision.image_token_id",
                    f"auto: the tokenizer has no token '{IMAGE_PAD}'; give the id of the "
                    "token that stands for an image patch group",
                )
            ]
        )
    return int(found)


@dataclass
class Fused:
    """Records' image tokens prepended to their text tokens, and their patches."""

    tokens: np.ndarray  # int32, documents back to back
    offsets: np.ndarray  # int64, one more than there are documents
    text_len: np.ndarray  # int64 per document: its text's tokens (0: empty)
    ok: np.ndarray  # bool per document: its image decoded and fits a row
    patches: list[np.ndarray | None]  # uint8 (gh, gw, 3*p*p) per document
    skipped: list[SourceError] = field(default_factory=list)


def fuse_images(
    window: Window,
    lo: int,
    piece: Piece,
    tokens: np.ndarray,
    offsets: np.ndarray,
    v: VisionSpec,
    image_id: int,
    max_seq_len: int,
    skip: bool,
) -> Fused:
    """Decode the images of ``piece`` (records ``lo`` on of ``window``) and prepend their tokens.

    A record whose image cannot be decoded, or whose image tokens alone exceed
    ``max_seq_len``, is a bad record (``SourceError`` naming the file, the row
    and the tar member; skipped and counted under ``on_error: skip``).
    """
    assert piece.images is not None
    text_len = np.diff(offsets)
    n = len(text_len)
    n_img = np.zeros(n, dtype=np.int64)
    ok = np.ones(n, dtype=bool)
    patches: list[np.ndarray | None] = [None] * n
    skipped: list[SourceError] = []
    images = piece.images
    keys = piece.keys.to_pylist() if piece.keys is not None else None
    for i in range(n):
        if text_len[i] == 0:
            continue  # empty: not a sample, its image is not decoded
        what = f"member {keys[i]}" if keys is not None else "the image"
        reason = None
        try:
            got = image_patches(images[i].as_py(), v)
        except Exception as e:  # Pillow raises many types for bad bytes
            reason = f"{what}: cannot decode the image ({type(e).__name__}: {e})"
        else:
            n_img[i] = image_tokens(got.shape[0], got.shape[1], v)
            if n_img[i] > max_seq_len:
                reason = (
                    f"{what} gives {n_img[i]} image tokens ({got.shape[0]}x{got.shape[1]} "
                    f"patches), more than batch.max_seq_len {max_seq_len}; lower "
                    "vision.max_pixels or raise max_seq_len"
                )
            else:
                patches[i] = got
        if reason is not None:
            err = SourceError(window.source, window.name, int(window.rows[lo + i]), reason)
            if not skip:
                raise err
            skipped.append(err)
            ok[i], n_img[i] = False, 0
    fused_len = text_len + n_img
    out_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(fused_len, out=out_off[1:])
    out = np.full(int(out_off[-1]), image_id, dtype=np.int32)
    # each text token moves by its document's image tokens and the earlier ones
    shift = np.repeat(out_off[:-1] + n_img - offsets[:-1], text_len)
    out[shift + np.arange(len(tokens))] = tokens
    return Fused(out, out_off, text_len, ok, patches, skipped)


def image_payload(
    items: Any,
    patches: list[np.ndarray | None],
    doc_of: np.ndarray,
    chunk: np.ndarray,
    members: list[str] | None,
    kept: np.ndarray,
    width: int,
) -> None:
    """Give ``items`` (a piece's ShardItems) their images: the first item of each document.

    ``patches`` holds each kept document's patches, ``doc_of`` each item's
    document among them, ``chunk`` its chunk number; ``members`` are the
    piece's records' tar members (``kept``: the kept records among them);
    ``width`` is ``3 * patch_size**2``.
    """
    from overlord.sources.webdataset import split_member

    n = len(doc_of)
    first = chunk == 0
    grid = np.zeros((n, 2), dtype=np.int32)
    blocks = []
    for j in np.flatnonzero(first).tolist():
        got = patches[int(doc_of[j])]
        assert got is not None
        grid[j] = got.shape[:2]
        blocks.append(got.reshape(-1, got.shape[2]))
    count = (grid[:, 0] * grid[:, 1]).astype(np.int64)
    items.patches = count.astype(np.int32)
    items.grid = grid
    items.patch_start = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    items.pixels = np.concatenate(blocks) if blocks else np.zeros((0, width), np.uint8)
    if members is not None:
        items.keys = [split_member(members[int(kept[d])])[0] for d in doc_of.tolist()]
