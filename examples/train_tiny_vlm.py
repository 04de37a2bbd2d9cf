"""Train a tiny vision-language model on CPU with ``torchrun``, from overlord's image batches.

Run it (no Ray: the node's one Loader runs in rank 0's process)::

    torchrun --nproc_per_node 2 examples/train_tiny_vlm.py --steps 40

What happens:

- Rank 0 writes, once, a WebDataset corpus into ``--data-dir``: tar shards of
  generated pictures (a coloured disc or square on a coloured background, 20
  to 200 pixels a side) with captions that name the colours and the shape,
  some as ``.txt`` members and some in ``.json``. Nothing is downloaded.
- ``overlord.Loader(plan)`` (under torchrun, the node's roles run in one data
  process that rank 0 starts) gives each rank its DP rank's batches: packed
  ``input_ids`` in which each image is ``(h1/14)(w1/14)/4`` image tokens (id
  258) before its caption, ``pixel_values`` (float32, one row of 3·14·14 per
  patch, images in sample order) and ``image_grid`` (patches per image).
- The model: a patch-embedding encoder (an MLP on each patch), a 2x2 merger
  (the four patches of each merge window, concatenated, projected), and a tiny
  GPT whose image-token embeddings are replaced by the merged patch embeddings,
  in order. Attention is causal within each document (``cu_seqlens``). The
  loss is on the caption tokens only (overlord's labels are -100 wherever the
  next token is an image token), so the captions must be read off the pixels.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import overlord

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_tiny_gpt import Block, document_causal_mask  # noqa: E402

VOCAB = 259  # bytes 0-255, end of document 256, padding 257, image token 258
IMAGE_ID = 258
PATCH, MERGE = 14, 2
COLORS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220),
          "yellow": (230, 210, 40), "white": (245, 245, 245), "black": (15, 15, 15)}  # fmt: skip
PLAN = """\
seed: 3
sources:
  - {{name: pictures, path: "pictures-*.tar", format: webdataset, text_field: txt}}
tokenizer: {{kind: bytes}}
batch: {{tokens_per_step: {tokens}, max_seq_len: 256}}
world: {{dp: {dp}}}
vision: {{patch_size: 14, merge_size: 2, min_pixels: 3136, max_pixels: 12544}}
balance:
  method: kk
  modules: hybrid
  cost:
    model: {{params: 2.0e5, layers: 2, hidden: 64}}
    encoder: {{params: 4.0e4, layers: 1, hidden: 64}}
shuffle: {{block_bytes: 65536, window_blocks: 4}}
"""


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    """An RGB image as the bytes of a ``fmt`` file (png, jpg)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format={"jpg": "JPEG"}.get(fmt, fmt.upper()))
    return out.getvalue()


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    """A WebDataset tar: every sample's members ``key.ext``, in order."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_corpus(folder: Path, shards: int = 2, per_shard: int = 400) -> None:
    """Tar shards of pictures with captions that describe them (written once)."""
    if (folder / "pictures-0.tar").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = list(COLORS)
    for k in range(shards):
        samples = []
        for i in range(per_shard):
            fg, bg = rng.choice(len(names), 2, replace=False)
            h, w = (int(v) for v in rng.integers(20, 200, 2))
            img = np.empty((h, w, 3), np.uint8)
            img[:] = COLORS[names[bg]]
            y, x = np.mgrid[0:h, 0:w]
            cy, cx, r = h / 2, w / 2, min(h, w) / 3
            disc = bool(rng.integers(2))
            inside = ((y - cy) ** 2 + (x - cx) ** 2 < r * r) if disc else (
                (abs(y - cy) < r) & (abs(x - cx) < r))  # fmt: skip
            img[inside] = COLORS[names[fg]]
            text = f"a {names[fg]} {'disc' if disc else 'square'} on {names[bg]}."
            fmt = ("png", "jpg")[i % 2]
            key = f"{k:02d}{i:05d}"
            member = {"json": f'{{"txt": "{text}"}}'.encode()} if i % 3 == 0 else {
                "txt": text.encode()}  # fmt: skip
            samples.append((key, {fmt: encode(img, fmt), **member}))
        write_tar(folder / f"pictures-{k}.tar", samples)


class TinyVLM(nn.Module):
    """Patch encoder, 2x2 merger, and a tiny GPT that takes the merged patches as tokens."""

    def __init__(self, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.patch = nn.Sequential(nn.Linear(3 * PATCH * PATCH, d), nn.GELU(), nn.Linear(d, d))
        self.merge = nn.Linear(MERGE * MERGE * d, d)
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for w in self.parameters():
            if w.dim() == 2:
                nn.init.normal_(w, std=0.02)

    def image_tokens(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """One embedding per merge window, per image in order, windows row-major."""
        emb = self.patch(pixels)
        out, at = [], 0
        for gh, gw in grid.tolist():
            x = emb[at : at + gh * gw].view(gh // MERGE, MERGE, gw // MERGE, MERGE, -1)
            x = x.permute(0, 2, 1, 3, 4).reshape((gh // MERGE) * (gw // MERGE), -1)
            out.append(self.merge(x))
            at += gh * gw
        return torch.cat(out) if out else emb[:0]

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits (rows, seq, vocab)."""
        ids = b["input_ids"]
        x = self.tok(ids) + self.pos(b["position_ids"])
        where = ids == IMAGE_ID
        img = self.image_tokens(b["pixel_values"], b["image_grid"])
        assert int(where.sum()) == len(img), "one merged patch per image token"
        x = x.masked_scatter(where.unsqueeze(-1), img.to(x.dtype))
        mask = document_causal_mask(b["cu_seqlens"], *ids.shape)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln(x) @ self.tok.weight.T


def main(argv: list[str] | None = None) -> None:
    """Train; rank 0 prints each step's loss and the first and last averages."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", type=int, default=4, help="rows of 256 tokens per rank and step")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "overlord-vlm")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--average", type=int, default=5)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        write_corpus(args.data_dir)
        (args.data_dir / "plan.yaml").write_text(
            PLAN.format(tokens=size * args.rows * 256, dp=size)
        )
    dist.barrier()
    plan = overlord.load_plan(args.data_dir / "plan.yaml")
    torch.manual_seed(0)
    model = TinyVLM(args.d_model, 2, 4, plan.batch.max_seq_len)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses, t0 = [], time.perf_counter()
    loader = overlord.Loader(plan)  # node mode under torchrun: one data process reads for all
    client = loader.client(dist.get_rank(), stop_step=args.steps)
    for batch in client:
        b = {k: torch.from_numpy(v) for k, v in batch.arrays().items()}
        b["input_ids"], b["position_ids"] = b["input_ids"].long(), b["position_ids"].long()
        assert batch.pixel_values is not None and batch.image_grid is not None
        b["pixel_values"] = torch.from_numpy(batch.pixel_values)
        b["image_grid"] = torch.from_numpy(batch.image_grid)
        logits = ddp(b)
        labels = b["labels"].long().flatten()
        summed = F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100, reduction="sum")
        count = torch.tensor([float((labels != -100).sum())], dtype=torch.float64)
        dist.all_reduce(count)
        loss = summed * (size / count.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        total = loss.detach().clone() / size
        dist.all_reduce(total)
        losses.append(float(total))
        if rank == 0:
            n_img = len(batch.image_grid)
            print(f"step {batch.step} loss {losses[-1]:.4f} images {n_img}", flush=True)
    loader.close()
    if rank == 0:
        k = min(args.average, max(1, len(losses) // 2))
        first, last = np.mean(losses[:k]), np.mean(losses[-k:])
        print(f"loss first {first:.4f} last {last:.4f} ({time.perf_counter() - t0:.1f} s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
