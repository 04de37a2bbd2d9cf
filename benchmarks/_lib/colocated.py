"""The colocated loader of ``benchmarks/memory.py``: its per-source state, corpus and dataset.

A *state* is what one colocated DataLoader worker holds for each source, beside the
source's open file and its line index (``parse_state``):

- ``index``: nothing more. A document is found by its line offset and read with a seek
  (Megatron-style indexed reading; no shuffle buffer).
- ``shuffle:<N>MB``: a shuffle buffer of N MiB of the source's records (raw JSONL lines).
  A document is taken from a random slot, decoded and tokenized, and the slot refilled
  from the file (HuggingFace's ``shuffle(buffer_size)`` and webdataset's ``shuffle``,
  sized in bytes). overlord holds the same shuffle state once per source: its window is
  ``block_bytes x window_blocks`` = N MiB of the same records (``overlord_shuffle``).
- ``images`` or ``images:<N>MB`` (default 16): the sources are image-text WebDataset tars
  (``make_image_corpus``) and the worker holds a read-ahead (shuffle) buffer of N MiB of
  *decoded* samples per source: each image decoded, converted to RGB, resized by the vision
  rule and cut into float32 normalized patches (``decode_patches``: plain Pillow, the same
  operations as ``overlord.sources.images``; the test checks they give the same array),
  with its caption. overlord holds the same sources with the plan's ``vision:`` section and
  a shuffle window of about as many images (``images_shuffle``), encoded; its read-ahead
  holds uint8 patches.

Pure helpers (``parse_state``, ``overlord_shuffle``, ``images_shuffle``, ``linear``) are
unit-tested in ``tests/test_bench_memory.py``.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 2**20
BASES = ["stdlib", "tests", "docs", "licenses"]  # demo sources; source k clones BASES[k % 4]
BASE_WEIGHT = {"stdlib": 4.0, "tests": 3.0, "docs": 2.0, "licenses": 1.0}
EOS = "<|endoftext|>"  # the BPE tokenizer's end-of-document token
INDEX_BLOCK = 64 * 1024  # overlord's window at ``index`` state: one block of 64 KiB
IMAGE_BLOCK = 64 * 1024  # overlord's block of an image tar at ``images`` state
IMAGE_ID = 258  # the image token of both designs (the bytes tokenizer's; any id of the BPE's)
IMAGE_DEFAULT_MB = 16  # ``images`` alone: 16 MiB of decoded float32 patches per source


@dataclass(frozen=True)
class State:
    """Per-source state of a colocated worker: ``kind`` and, for ``shuffle``, its bytes."""

    kind: str  # "index" | "shuffle" | "images"
    bytes: int = 0

    @property
    def label(self) -> str:
        return self.kind if self.kind == "index" else f"{self.kind}:{self.bytes // MiB}MB"


def parse_state(text: str) -> State:
    """``index``, ``shuffle:<N>MB``, ``images`` or ``images:<N>MB`` as a ``State``.

    N is a positive whole number of MiB; ``images`` alone is ``images:16MB``.
    """
    t = text.strip().lower()
    if t == "index":
        return State("index")
    if t == "images":
        return State("images", IMAGE_DEFAULT_MB * MiB)
    m = re.fullmatch(r"(shuffle|images):(\d+)\s*mi?b", t)
    if m is None or int(m.group(2)) == 0:
        raise ValueError(
            f"--state {text!r}: expected 'index', 'shuffle:<N>MB', 'images' or "
            "'images:<N>MB' with N a positive whole number of MiB (e.g. shuffle:16MB)"
        )
    return State(m.group(1), int(m.group(2)) * MiB)


def overlord_shuffle(state: State) -> dict[str, int]:
    """overlord's ``shuffle`` section holding ``state`` once per source.

    ``shuffle``: a window of the same bytes (1 MiB blocks); ``index``: one block of
    64 KiB (overlord has no index-only mode: this is its smallest sensible window).
    """
    if state.kind == "index":
        return {"block_bytes": INDEX_BLOCK, "window_blocks": 1}
    return {"block_bytes": MiB, "window_blocks": max(1, state.bytes // MiB)}


def images_shuffle(state: State, decoded_bytes: float, sample_bytes: float) -> dict[str, int]:
    """overlord's ``shuffle`` section holding about as many images as a worker's buffer.

    A colocated worker's buffer of ``state.bytes`` holds ``state.bytes / decoded_bytes``
    images (``decoded_bytes``: a sample's mean float32 patches); overlord's window holds
    them encoded, ``sample_bytes`` each (the mean tar bytes of a sample), in blocks of
    ``IMAGE_BLOCK``: at least one image and one block.
    """
    if state.kind != "images" or decoded_bytes <= 0 or sample_bytes <= 0:
        raise ValueError(f"images_shuffle: an images state and positive sizes, not {state}")
    images = max(1, round(state.bytes / decoded_bytes))
    blocks = max(1, math.ceil(images * sample_bytes / IMAGE_BLOCK))
    return {"block_bytes": IMAGE_BLOCK, "window_blocks": blocks}


def linear(points: list[tuple[float, float]], x: float) -> float:
    """The least-squares line through ``points`` at ``x``; one point: that point's y.

    Used to carry a measured memory figure from the number of sources that fits on this
    machine to the one of the target (memory grows by a fixed amount per source).
    """
    if not points:
        raise ValueError("no points to extrapolate from")
    xs = {p[0] for p in points}
    if len(xs) == 1:
        if x not in xs:
            raise ValueError(f"one measured x ({next(iter(xs))}) cannot give a line to x={x}")
        return sum(p[1] for p in points) / len(points)
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sum((p[0] - mx) ** 2 for p in points)
    return my + slope * (x - mx)


# ---- corpus ---------------------------------------------------------------------------------


def _demo_texts(folder: Path) -> list[str]:
    import pyarrow.parquet as pq

    texts: list[str] = []
    for f in sorted(folder.iterdir()):
        if f.suffix == ".parquet":
            texts += [t for t in pq.read_table(f, columns=["content"]).column(0).to_pylist() if t]
            continue
        raw = f.read_bytes()
        raw = gzip.decompress(raw) if f.name.endswith(".gz") else raw
        texts += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    return texts


def make_corpus(root: Path, max_sources: int, file_bytes: int) -> list[dict[str, Any]]:
    """S sources over 4 JSONL files of at least ``file_bytes`` each, and their line indexes.

    Base file k holds the records of demo source k (Python's own files), repeated in a
    seeded order until it is ``file_bytes`` long; source k is a folder holding a symlink
    to base file ``k % 4`` (shards large enough for two windows of the largest state).
    """
    import numpy as np

    from overlord.ops.demo import build_corpus

    build_corpus(root / "demo")
    (root / "base").mkdir(parents=True, exist_ok=True)
    train = open(root / "train.jsonl", "w")  # noqa: SIM115 (closed below)
    for k, base in enumerate(BASES):
        texts = _demo_texts(root / "demo" / base)
        for t in texts[::2]:  # what the BPE tokenizer is trained on (every 8th of these)
            train.write(json.dumps({"text": t}) + "\n")
        rng, size = random.Random(k), 0
        path = root / "base" / f"{base}.jsonl"
        with open(path, "wb") as out:
            while size < file_bytes:
                rng.shuffle(texts)
                for t in texts:
                    line = (json.dumps({"text": t}) + "\n").encode()
                    out.write(line)
                    size += len(line)
        raw = np.fromfile(path, dtype=np.uint8)
        offsets = np.concatenate(([0], np.flatnonzero(raw == 10) + 1)).astype(np.int64)
        np.save(root / "base" / f"{base}.npy", offsets)
    train.close()
    sources = []
    for k in range(max_sources):
        base = BASES[k % len(BASES)]
        folder = root / "sources" / f"s{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "part-0.jsonl"
        if not link.exists():
            link.symlink_to(root / "base" / f"{base}.jsonl")
        sources.append(
            {
                "name": f"s{k:03d}",
                "file": str(link),
                "index": str(root / "base" / f"{base}.npy"),
                "weight": BASE_WEIGHT[base],
            }
        )
    return sources


# ---- the colocated worker's dataset ---------------------------------------------------------


class Encoder:
    """A worker's tokenizer: UTF-8 bytes (end 256), or a ``tokenizers`` file (end ``EOS``)."""

    def __init__(self, path: str | None):
        import numpy as np

        self.np = np
        self.tok: Any = None
        if path:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(path)  # one per worker process, as people write it
            self.eos = self.tok.token_to_id(EOS)

    def __call__(self, text: str) -> Any:
        np = self.np
        if self.tok is None:
            return np.append(np.frombuffer(text.encode(), np.uint8).astype(np.int32), 256)
        return np.array([*self.tok.encode(text, add_special_tokens=False).ids, self.eos], np.int32)


class SourceReader:
    """One source as a colocated worker holds it: its file, line index and ``State``."""

    def __init__(self, spec: dict[str, Any], state: State, seed: list[int]):
        import numpy as np

        self.fh = open(spec["file"], "rb")  # noqa: SIM115 (held open)
        self.index = np.load(spec["index"])
        self.rng = np.random.default_rng(seed)
        self.state = state
        self.rows = len(self.index) - 1
        if state.kind == "index":
            self.order, self.next = self.rng.permutation(self.rows), 0
            return
        self.buffer: list[bytes] = []
        self.row = int(self.rng.integers(self.rows))  # where its sequential read starts
        self.fh.seek(int(self.index[self.row]))
        held = 0
        while held < state.bytes:  # filled before the first document, as HF's buffer is
            line = self._line()
            self.buffer.append(line)
            held += len(line)

    def close(self) -> None:
        self.fh.close()

    def _line(self) -> bytes:
        if self.row == self.rows:
            self.row = 0
            self.fh.seek(0)
        self.row += 1
        return self.fh.readline()

    def next_text(self) -> str:
        if self.state.kind == "index":
            if self.next == self.rows:
                self.order, self.next = self.rng.permutation(self.rows), 0
            row = int(self.order[self.next])
            self.next += 1
            self.fh.seek(int(self.index[row]))
            line = self.fh.read(int(self.index[row + 1] - self.index[row]))
        else:
            slot = int(self.rng.integers(len(self.buffer)))
            line, self.buffer[slot] = self.buffer[slot], self._line()
        text: str = json.loads(line)["text"]
        return text


def baseline_batches(
    sources: list[dict[str, Any]],
    state: State,
    tokenizer: str | None,
    rows: int,
    seq: int,
    rank: int,
    seed: int,
) -> Iterator[Any]:
    """What each DataLoader worker runs: open every source, mix by weight, pack rows."""
    import numpy as np
    import torch
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    wid = info.id if info is not None else 0
    encode = Encoder(tokenizer)
    readers = [SourceReader(s, state, [seed, rank, wid, k]) for k, s in enumerate(sources)]
    weights = np.array([s["weight"] for s in sources], dtype=np.float64)
    p = weights / weights.sum()
    rng = np.random.default_rng([seed, rank, wid])
    need = rows * seq
    carry = np.zeros(0, dtype=np.int32)
    while True:
        parts, have = [carry], len(carry)
        while have < need:  # concatenate documents and cut rows: GPT-style packing
            doc = encode(readers[int(rng.choice(len(readers), p=p))].next_text())
            parts.append(doc)
            have += len(doc)
        flat = np.concatenate(parts)
        carry = flat[need:].copy()
        ids = torch.from_numpy(flat[:need].astype(np.int64)).view(rows, seq)
        labels = torch.roll(ids, -1, dims=1)
        positions = torch.arange(seq, dtype=torch.int32).expand(rows, seq).contiguous()
        yield {"input_ids": ids, "labels": labels, "position_ids": positions, "tokens": need}


# ---- images ---------------------------------------------------------------------------------

IMAGES_PER_BASE = 160  # samples per base tar (at least two of the largest buffer's images)
IMAGE_SIDES = (48, 640)  # generated images' shorter..longer sides, log-uniform; aspect 1:2..2:1


def decode_patches(data: bytes, v: Any) -> Any:
    """A colocated worker's image: plain Pillow, float32 normalized patches ``(n, 3*p*p)``.

    Open, RGB, resize to the vision rule's size (``resized``) with BICUBIC, ``/ 255``,
    ``(x - mean) / std`` per channel, patches row-major in ``(channel, y, x)`` order: the
    operations of ``overlord.sources.images`` (``image_patches`` then ``normalize``),
    written the obvious way (``benchmarks/vision.py``'s ``plain_pillow``).
    """
    import numpy as np
    from PIL import Image

    from overlord.plan.vision import resized

    img = Image.open(io.BytesIO(data)).convert("RGB")
    h1, w1 = resized(img.height, img.width, v)
    x = np.asarray(img.resize((w1, h1), Image.BICUBIC), dtype=np.float32) / np.float32(255)
    x = (x - np.asarray(v.mean, np.float32)) / np.asarray(v.std, np.float32)
    p = v.patch_size
    x = x.reshape(h1 // p, p, w1 // p, p, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(x.reshape(-1, 3 * p * p))


def make_image_corpus(
    root: Path, max_sources: int, per_base: int = IMAGES_PER_BASE
) -> list[dict[str, Any]]:
    """S image-text sources over 4 WebDataset tars of ``per_base`` generated JPEGs each.

    Base tar k holds JPEGs drawn by ``overlord.ops.vision_data`` (gradients, stripes,
    noise) of mixed sizes (sides log-uniform in ``IMAGE_SIDES``, seeded by k) with their
    captions (``key.jpg`` + ``key.txt``); source k is a folder ``isources/sNNN`` holding a
    symlink to base tar ``k % 4``. Built once per run of the benchmark, in its work dir;
    each source carries ``decoded_bytes`` (its mean float32 patches per sample, by the
    vision rule) and ``sample_bytes`` (its tar's bytes per sample).
    """
    import numpy as np

    from overlord.ops.vision_data import draw, encode, image_text_tar
    from overlord.plan.vision import VisionSpec, resized

    v = VisionSpec()
    base_dir = root / "ibase"
    base_dir.mkdir(parents=True, exist_ok=True)
    stats = []
    for k, base in enumerate(BASES):
        path = base_dir / f"{base}.tar"
        rng = np.random.default_rng(100 + k)
        images, decoded = [], 0
        for _ in range(per_base):
            side = int(np.exp(rng.uniform(np.log(IMAGE_SIDES[0]), np.log(IMAGE_SIDES[1]))))
            h, w = side, max(8, int(side * rng.uniform(0.5, 2.0)))
            images.append(("jpg", encode(draw(rng, h, w), "jpg")))
            h1, w1 = resized(h, w, v)
            decoded += h1 * w1 * 3 * 4
        if not path.exists():
            image_text_tar(path, images, json_every=0)
        stats.append((decoded / len(images), path.stat().st_size / len(images)))
    sources = []
    for k in range(max_sources):
        b = k % len(BASES)
        folder = root / "isources" / f"s{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "part-0.tar"
        if not link.exists():
            link.symlink_to(base_dir / f"{BASES[b]}.tar")
        sources.append(
            {
                "name": f"s{k:03d}",
                "file": str(link),
                "images": per_base,
                "weight": BASE_WEIGHT[BASES[b]],
                "decoded_bytes": stats[b][0],
                "sample_bytes": stats[b][1],
            }
        )
    return sources


class ImageReader:
    """One image source as a colocated worker holds it: its tar stream and decoded buffer.

    The buffer holds ``state.bytes`` of decoded samples (float32 patches and caption),
    filled before the first sample; a sample comes from a random slot, refilled with the
    next sample of the tar (read as a stream, from a random sample on; wraps around).
    """

    def __init__(self, spec: dict[str, Any], state: State, seed: list[int], v: Any):
        import numpy as np

        self.path, self.v = spec["file"], v
        self.rng = np.random.default_rng(seed)
        self._samples = self._stream()
        for _ in range(int(self.rng.integers(spec["images"]))):
            next(self._samples)
        self.buffer: list[tuple[Any, str]] = []
        held = 0
        while held < state.bytes:
            got = self._decoded()
            self.buffer.append(got)
            held += got[0].nbytes

    def _stream(self) -> Iterator[tuple[bytes, str]]:
        import tarfile

        while True:
            with tarfile.open(self.path, "r|") as tar:
                image, key = b"", None
                for info in tar:
                    k, _, ext = info.name.partition(".")
                    f = tar.extractfile(info)
                    data = f.read() if f is not None else b""
                    if ext == "jpg":
                        image, key = data, k
                    elif ext == "txt" and k == key:
                        yield image, data.decode()

    def _decoded(self) -> tuple[Any, str]:
        data, text = next(self._samples)
        return decode_patches(data, self.v), text

    def next_sample(self) -> tuple[Any, str]:
        slot = int(self.rng.integers(len(self.buffer)))
        got, self.buffer[slot] = self.buffer[slot], self._decoded()
        return got

    def held(self) -> int:
        return sum(int(x[0].nbytes) for x in self.buffer)


def image_batches(
    sources: list[dict[str, Any]],
    state: State,
    tokenizer: str | None,
    rows: int,
    seq: int,
    rank: int,
    seed: int,
) -> Iterator[Any]:
    """What each DataLoader worker runs at ``images``: every source's decoded buffer, mixed.

    A sample is its image's tokens (``IMAGE_ID``, one per ``merge_size**2`` patches), then
    its caption's and the end token; samples are packed into rows as text documents are,
    and a batch carries the float32 patches of the samples that start in it.
    """
    import numpy as np
    import torch
    from torch.utils.data import get_worker_info

    from overlord.plan.vision import VisionSpec

    v = VisionSpec()
    info = get_worker_info()
    wid = info.id if info is not None else 0
    encode = Encoder(tokenizer)
    readers = [ImageReader(s, state, [seed, rank, wid, k], v) for k, s in enumerate(sources)]
    weights = np.array([s["weight"] for s in sources], dtype=np.float64)
    p = weights / weights.sum()
    rng = np.random.default_rng([seed, rank, wid])
    need, merge = rows * seq, v.merge_size**2
    carry = np.zeros(0, dtype=np.int32)
    while True:
        parts, have, pixels = [carry], len(carry), []
        while have < need:
            patches, text = readers[int(rng.choice(len(readers), p=p))].next_sample()
            image = np.full(len(patches) // merge, IMAGE_ID, np.int32)
            doc = np.concatenate([image, encode(text)])
            parts.append(doc)
            pixels.append(patches)
            have += len(doc)
        flat = np.concatenate(parts)
        carry = flat[need:].copy()
        ids = torch.from_numpy(flat[:need].astype(np.int64)).view(rows, seq)
        labels = torch.roll(ids, -1, dims=1)
        positions = torch.arange(seq, dtype=torch.int32).expand(rows, seq).contiguous()
        yield {
            "input_ids": ids,
            "labels": labels,
            "position_ids": positions,
            "pixel_values": torch.from_numpy(np.concatenate(pixels)),
            "tokens": need,
        }
