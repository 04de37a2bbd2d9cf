"""Image-text shards for tests, benchmarks and examples: generated, never downloaded.

Images are drawn with numpy (gradients, noise, stripes) in several modes and
sizes, and encoded by Pillow; :func:`shipped_photos` adds the photographs that
matplotlib ships as sample data (``grace_hopper.jpg`` and others), when it is
installed.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("jpg", "png", "webp")


def draw(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """An RGB uint8 image with structure (gradients, stripes) and noise."""
    y, x = np.mgrid[0:h, 0:w]
    f = rng.uniform(0.01, 0.2, size=3)
    img = np.stack(
        [
            127 + 100 * np.sin(f[0] * x + f[1] * y),
            255 * x / max(1, w - 1),
            255 * ((x // max(1, int(8 / f[2])) + y // 7) % 2),
        ],
        axis=-1,
    )
    img += rng.normal(0, 12, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str, mode: str = "RGB") -> bytes:
    """Encode an RGB array as ``fmt`` (jpg, png, webp), after converting it to ``mode``."""
    from PIL import Image

    img = Image.fromarray(pixels, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    out = io.BytesIO()
    img.save(out, format={"jpg": "JPEG", "jpeg": "JPEG"}.get(fmt, fmt.upper()))
    return out.getvalue()


def shipped_photos() -> list[tuple[str, bytes]]:
    """Real photographs and drawings shipped with matplotlib's sample data (name, bytes)."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - depends on the install
        return []
    root = Path(matplotlib.get_data_path()) / "sample_data"
    names = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")
    return [(n, (root / n).read_bytes()) for n in names if (root / n).exists()]


def random_images(
    n: int, seed: int = 0, sizes: tuple[int, int] = (8, 400)
) -> list[tuple[str, bytes]]:
    """``n`` generated images ``(extension, bytes)``: varied sizes, formats and modes."""
    rng = np.random.default_rng(seed)
    out = []
    modes = ("RGB", "L", "RGBA", "P")
    for i in range(n):
        h, w = (int(v) for v in rng.integers(sizes[0], sizes[1], size=2))
        fmt = FORMATS[i % len(FORMATS)]
        mode = modes[i % len(modes)]
        if fmt == "jpg" and mode in ("RGBA", "P"):
            mode = "RGB"
        out.append((fmt, encode(draw(rng, h, w), fmt, mode)))
    return out


def write_tar(path: str | Path, samples: Iterable[tuple[str, dict[str, bytes]]]) -> None:
    """A WebDataset tar: every sample's members ``key.ext``, in order."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def caption(i: int) -> str:
    """A short caption, one to a few sentences long."""
    return f"image {i}: " + "a picture of something. " * (1 + i % 5)


def image_text_tar(
    path: str | Path, images: list[tuple[str, bytes]], json_every: int = 3, start: int = 0
) -> None:
    """A tar of ``images`` with captions, every ``json_every``-th one in a ``.json`` member."""
    samples = []
    for i, (ext, data) in enumerate(images):
        j = start + i
        text: dict[str, bytes] = (
            {"json": json.dumps({"txt": caption(j)}).encode()}
            if json_every and i % json_every == json_every - 1
            else {"txt": caption(j).encode()}
        )
        samples.append((f"s{j:06d}", {ext: data, **text}))
    write_tar(path, samples)


def image_text_parquet(
    path: str | Path, images: list[tuple[str, bytes]], row_group_size: int = 4
) -> None:
    """A Parquet file with columns ``text`` and ``image`` (encoded bytes)."""
    table = pa.table(
        {
            "text": pa.array([caption(i) for i in range(len(images))], pa.string()),
            "image": pa.array([d for _, d in images], pa.binary()),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)
