"""Train a tiny GPT on CPU with ``torchrun`` and DDP, from overlord's node mode (or a Ray job).

Run it::

    torchrun --nproc_per_node 2 examples/train_tiny_gpt.py --steps 30 --checkpoint-dir ckpt
    torchrun --nproc_per_node 2 examples/train_tiny_gpt.py --steps 60 --checkpoint-dir ckpt \
        --resume ckpt
    torchrun --nproc_per_node 4 examples/train_tiny_gpt.py --steps 10 --cp 2
    # the data from a job on Ray instead (Ray kept on loopback, as on any shared machine)
    unshare -n sh -c 'ip link set lo up && \
        torchrun --nproc_per_node 2 examples/train_tiny_gpt.py --steps 30 --ray'

What happens:

- By default, without Ray: every rank builds the same plan and calls
  ``OverlordIterableDataset.from_plan``. Under torchrun on one node that is
  overlord's node mode: the node's roles run in one data process that rank 0
  starts (each source read once), and every rank takes its own batches (its
  CP slice with ``--cp``) from shared memory; each rank reads them through a
  ``DataLoader(num_workers=0)``.
- With ``--ray``, rank 0 starts the overlord job in its own process instead:
  ``overlord.Loader(plan, runtime="ray", job=JOB, state=...)`` starts a local
  Ray instance and the Planner, SourceLoader and one DataConstructor per DP
  rank as Ray actors; they live as long as rank 0 does. Every rank (rank 0
  too) then connects to the job with ``OverlordIterableDataset.from_job``
  (``overlord.connect``). The batches are the same either way.
- Attention is causal inside each document only: the mask is built from the
  batch's ``cu_seqlens`` (:func:`document_causal_mask`), and positions restart
  at every document (the batch's ``position_ids``).
- ``--cp N`` trains with context parallelism: ``torchrun --nproc_per_node
  dp*N``, the plan's ``world.cp = N`` (``--cp-layout zigzag|per_document``),
  each process connecting with its global rank and receiving its CP slice.
  Attention all-gathers K and V within the CP group (:class:`GatherSeq`, whose
  backward sums the gradients and keeps this rank's part) and masks with the
  slice's ``segment_ids`` and ``global_positions`` (:func:`cp_causal_mask`).
  The loss is the mean over every real token of the step (all ranks), so its
  printed value and its gradients equal those of the same plan at ``--cp 1``.
- ``--cp dynamic --cp-max C --tokens-per-cp-rank T`` trains with a CP degree
  per document (the plan's ``world.cp: dynamic``; ``torchrun --nproc_per_node
  dp*C``): each process receives its documents (short ones whole, long ones
  cut over their sub-group, ``batch.cp_groups``) as one row. Attention
  all-gathers K, V, ``global_positions`` and ``segment_ids`` over the DP
  rank's ``C`` processes and masks to the same unsliced document, causally:
  a document's keys are found only on its sub-group, so the result is the
  same as gathering over the sub-group alone (a trainer with ring attention
  would build one communicator per sub-group from ``cp_groups`` instead).
- Every ``--checkpoint-every`` steps and at the end, rank 0 writes
  ``CKPT/step-NNNNNNNN/`` with ``trainer.pt`` (model, optimizer, step) and the
  stream's state (``overlord.checkpoint.save``). ``--resume`` restores the model
  and the optimizer on every rank and starts the stream (or the job) from that
  state, so the data continues exactly where the checkpoint was taken, in
  either mode.

Without ``--plan`` it trains on ``examples/tiny_plan.yaml`` over a corpus it
writes once from Python's standard library into ``--data-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import overlord
from overlord import checkpoint
from overlord.torch import OverlordIterableDataset

HERE = Path(__file__).resolve().parent
TINY_PLAN = HERE / "tiny_plan.yaml"
CORPUS_BYTES = 400_000  # far more than 30 steps of 2048 tokens read
SHARDS = 2
VOCAB = 258  # the bytes tokenizer: 256 bytes, end of document, padding
TRAINER_FILE = "trainer.pt"


# ---- data ----------------------------------------------------------------------------------


def write_corpus(folder: Path) -> Path:
    """Write the tiny plan and its corpus into ``folder`` once; returns the plan's path.

    Documents are paragraphs of the standard library's top-level modules, in
    sorted order, so the corpus is the same on every run of one Python version.
    """
    plan = folder / "plan.yaml"
    if plan.exists():
        return plan
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        for para in text.split("\n\n"):
            para = para.strip("\n")
            if len(para) >= 40:
                docs.append(para)
                size += len(para)
        if size >= CORPUS_BYTES:
            break
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    (tmp / "data").mkdir()
    for k in range(SHARDS):
        part = docs[k * len(docs) // SHARDS : (k + 1) * len(docs) // SHARDS]
        lines = "".join(json.dumps({"text": d}) + "\n" for d in part)
        (tmp / "data" / f"stdlib-{k}.jsonl").write_text(lines)
    shutil.copyfile(TINY_PLAN, tmp / "plan.yaml")
    try:
        tmp.rename(folder)  # atomic: a folder that exists is complete
    except OSError:
        shutil.rmtree(tmp)  # another run wrote it first
    return plan


# ---- model ---------------------------------------------------------------------------------


def document_causal_mask(cu_seqlens: torch.Tensor, rows: int, seq_len: int) -> torch.Tensor:
    """Boolean mask (rows, 1, seq_len, seq_len): True where token i may attend to token j.

    ``cu_seqlens`` holds the segment boundaries over the flattened rows (each
    row's padding tail is a segment of its own), so a token attends to the
    tokens of its own segment up to itself: block-diagonal and causal.
    """
    flat = torch.arange(rows * seq_len, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens, flat, right=True).view(rows, seq_len)
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (same & causal).unsqueeze(1)


def document_keys(
    segment_ids: torch.Tensor, global_positions: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Each token's unsliced document, ``row * (seq_len + 1) + segment`` (-1: padding added).

    Segment ids restart at every row of the unsliced batch; under ``cp: dynamic``
    a local row mixes documents of several unsliced rows, so the row is part of
    the key (``global_positions // seq_len``). A row's padding tail is a
    document of its own, as in the unsliced batch.
    """
    row = torch.div(global_positions, seq_len, rounding_mode="floor")
    keys = row * (seq_len + 1) + segment_ids
    return torch.where(global_positions >= 0, keys, torch.full_like(keys, -1))


def cp_causal_mask(
    segment_ids: torch.Tensor, global_positions: torch.Tensor, cp_rank: int, cp_size: int
) -> torch.Tensor:
    """Mask (rows, 1, W, cp * W) of a CP slice's queries over its CP group's gathered keys.

    ``segment_ids`` and ``global_positions`` are the whole group's, gathered
    (rows, cp * W), rank after rank. A query attends to the keys of its own
    segment (in its row) whose unsliced position is not after its own: the
    unsliced batch's document-causal mask. Padding added for CP (position -1)
    attends to itself only, so that no row of the softmax is empty.
    """
    width = global_positions.shape[1] // cp_size
    total = global_positions.shape[1]
    lo = cp_rank * width
    q_seg, q_pos = segment_ids[:, lo : lo + width], global_positions[:, lo : lo + width]
    same = q_seg[:, :, None] == segment_ids[:, None, :]
    causal = global_positions[:, None, :] <= q_pos[:, :, None]
    real = (q_pos[:, :, None] >= 0) & (global_positions[:, None, :] >= 0)
    itself = torch.zeros(width, total, dtype=torch.bool, device=segment_ids.device)
    itself[torch.arange(width), lo + torch.arange(width)] = True
    return ((same & causal & real) | itself).unsqueeze(1)


class GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 2) within a CP group; backward: sum, keep own part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int, rank: int) -> torch.Tensor:
        """(rows, heads, W, d) on each rank -> (rows, heads, cp * W, d), rank after rank."""
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.width = group, rank, x.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        """Every rank's queries contributed to these keys: sum, then this rank's part."""
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        lo = ctx.rank * ctx.width
        return grad[:, :, lo : lo + ctx.width], None, None, None


class CP:
    """The CP group of this process: the ranks that share its DP rank's rows."""

    def __init__(self, group: Any, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather ``x`` (rows, W) along the sequence, without gradients."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cp: CP | None = None) -> torch.Tensor:
        """One block over ``x`` (rows, seq, d_model) with attention mask ``mask``.

        With ``cp``, ``x`` is this rank's slice, and the keys and values are the group's.
        """
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (rows, heads, seq, head_dim)
        if cp is not None:
            k = GatherSeq.apply(k, cp.group, cp.size, cp.rank)
            v = GatherSeq.apply(v, cp.group, cp.size, cp.rank)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small decoder: token and (per-document) position embeddings, blocks, tied head."""

    def __init__(self, max_seq_len: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, batch: dict[str, torch.Tensor], cp: CP | None = None) -> torch.Tensor:
        """Logits (rows, seq, vocab) of an overlord batch (with ``cp``: of this rank's slice)."""
        ids = batch["input_ids"]
        if cp is None:
            mask = document_causal_mask(batch["cu_seqlens"], *ids.shape)
        else:
            segments, positions = (cp.gather(batch[k]) for k in ("segment_ids", "global_positions"))
            documents = document_keys(segments, positions, self.pos.num_embeddings)
            mask = cp_causal_mask(documents, positions, cp.rank, cp.size)
        x = self.tok(ids) + self.pos(batch["position_ids"])
        for block in self.blocks:
            x = block(x, mask, cp)
        return self.ln(x) @ self.tok.weight.T


# ---- checkpoints ---------------------------------------------------------------------------


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: OverlordIterableDataset,
) -> Path:
    """Write ``root/step-NNNNNNNN/`` (trainer state and the job's state) atomically.

    The stream's state is a small JSON file that ``overlord serve --resume`` reads too.
    """
    final = root / f"step-{step:08d}"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}-"))
    trainer = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(trainer, tmp / TRAINER_FILE)
    state = data.overlord_state()  # the stream's state as of this rank's position
    assert state["step"] == step, (state["step"], step)
    checkpoint.save(tmp, state)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def find_checkpoint(path: Path) -> Path:
    """A step folder: ``path`` itself, or the newest ``step-*`` folder in it."""
    if (path / TRAINER_FILE).exists():
        return path
    steps = sorted(p for p in path.glob("step-*") if (p / TRAINER_FILE).exists())
    if not steps:
        sys.exit(
            f"--resume {path}: no checkpoint there (a step-NNNNNNNN folder with {TRAINER_FILE}); "
            "pass the --checkpoint-dir of an earlier run"
        )
    return steps[-1]


# ---- training ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", type=Path, help="data plan (default: tiny_plan.yaml, generated)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "overlord-tiny-gpt-py{}{}".format(*sys.version_info),
        help="where the default plan's corpus is written once",
    )
    p.add_argument("--steps", type=int, default=30, help="train up to this global step")
    p.add_argument("--checkpoint-dir", type=Path, help="write checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--resume", type=Path, help="a checkpoint dir (newest step) or step folder")
    p.add_argument(
        "--ray", action="store_true",
        help="read from an overlord job on Ray that rank 0 starts (default: node mode, no Ray)",
    )  # fmt: skip
    p.add_argument("--job", help="with --ray: name of the overlord job (default: a fresh one)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--average", type=int, default=5, help="steps averaged for first/last loss")
    p.add_argument(
        "--cp", type=cp_arg, default=1,
        help="context-parallel size (processes per DP rank), or 'dynamic' (--cp-max of them)",
    )  # fmt: skip
    p.add_argument(
        "--cp-layout", choices=("per_document", "zigzag"), default="per_document",
        help="how each DP rank's rows are cut among its CP ranks",
    )  # fmt: skip
    p.add_argument("--cp-max", type=int, default=2, help="with --cp dynamic: the plan's cp_max")
    p.add_argument(
        "--tokens-per-cp-rank", type=int, default=64,
        help="with --cp dynamic: the plan's tokens_per_cp_rank",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.dynamic = args.cp == "dynamic"
    args.cp_size = args.cp_max if args.dynamic else args.cp  # CP ranks per DP rank
    return args


def cp_arg(text: str) -> int | str:
    """``--cp``: a positive integer or ``dynamic``."""
    if text == "dynamic":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer or 'dynamic', found '{text}'")
    return value


def make_plan(args: argparse.Namespace, world: overlord.World) -> overlord.Plan:
    """The data plan for this run's mesh (the same on every rank)."""
    plan = overlord.load_plan(args.plan or write_corpus(args.data_dir))
    # the stream does not depend on the mesh: any dp and cp resume it
    data = plan.model_dump(mode="json")
    data["world"] = {"dp": world.dp, "cp": world.cp}
    data["batch"]["cp_layout"] = args.cp_layout if world.cp > 1 else None
    if args.dynamic:
        data["world"].update(cp="dynamic", tokens_per_cp_rank=args.tokens_per_cp_rank)
        data["world"]["cp_max"] = world.cp
        data["batch"]["cp_layout"] = None
    return overlord.validate_plan(data, base_dir=plan.base_dir)


def join_job(
    args: argparse.Namespace, plan: overlord.Plan, rank: int, state: dict[str, Any] | None
) -> tuple[OverlordIterableDataset, overlord.Loader | None]:
    """``--ray``: rank 0 starts the job (alive while its Loader is open); every rank connects."""
    from overlord.serve import wait_for_job

    loader = None
    info: list[Any] = [None]
    if rank == 0:
        # only for the address that the other ranks connect to; they import Ray when they
        # connect, after overlord has chosen how they authenticate
        import ray

        job = args.job or f"tiny-gpt-{uuid.uuid4().hex[:8]}"
        loader = overlord.Loader(plan, runtime="ray", job=job, state=state)
        address = os.environ.get("RAY_ADDRESS") or ray.get_runtime_context().gcs_address
        info = [{"job": loader.job, "address": address}]
    dist.broadcast_object_list(info, src=0)
    job, address = info[0]["job"], info[0]["address"]
    if rank != 0:
        wait_for_job(job, address=address)
    ds = OverlordIterableDataset.from_job(
        job, address=address, stop_step=args.steps, global_rank=rank
    )
    return ds, loader


def leave_job(rank: int, loader: overlord.Loader | None) -> None:
    """``--ray``: every rank leaves the Ray cluster before rank 0 stops the job (and its Ray)."""
    dist.barrier()
    if rank != 0:
        import ray

        ray.shutdown()
    dist.barrier()
    if loader is not None:
        loader.close()


def main(argv: list[str] | None = None) -> None:
    """Train; rank 0 prints the log."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topology = overlord.World.detect(cp=args.cp_size)  # WORLD_SIZE = dp * cp
    dp, at = topology.dp, topology.coords(rank)
    cp = None
    if args.cp_size > 1:  # every rank makes every group, in the same order
        groups = [dist.new_group(topology.ranks_of(d)) for d in range(dp)]
        cp = CP(groups[at.dp], args.cp_size, at.cp)
    torch.manual_seed(args.seed)
    say = print if rank == 0 else (lambda *a, **k: None)

    resume = find_checkpoint(args.resume) if args.resume else None
    data_state = checkpoint.load(resume) if resume else None
    if rank == 0 and not args.plan:
        write_corpus(args.data_dir)  # once, before any rank reads it
    dist.barrier()
    plan = make_plan(args, topology)
    loader = None
    if args.ray:
        ds, loader = join_job(args, plan, rank, data_state)
    else:  # node mode: the node's data process builds; each rank gets its own batches
        ds = OverlordIterableDataset.from_plan(plan, stop_step=args.steps)

    model = TinyGPT(plan.batch.max_seq_len, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if resume is not None and data_state is not None:
        saved = torch.load(resume / TRAINER_FILE, weights_only=True)
        if saved["step"] != data_state["step"]:
            sys.exit(f"{resume}: trainer step {saved['step']} != data step {data_state['step']}")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        # node mode: the stream starts there; a job: checks that it started there
        ds.load_state_dict(data_state)
        say(f"resumed from step {saved['step']}: model, optimizer and data ({resume})")
    ddp = DistributedDataParallel(model)
    mode = args.cp_layout if cp else "no CP"
    if args.dynamic:
        mode = f"dynamic, cp_max {args.cp_max}, {args.tokens_per_cp_rank} tokens per CP rank"
    where = "a job on Ray" if args.ray else "node mode"
    say(
        f"{where}: dp {dp} x cp {args.cp_size} ({mode}), "
        f"{sum(p.numel() for p in model.parameters())} parameters, "
        f"steps {ds.step}..{args.steps - 1}",
        flush=True,
    )

    losses: list[float] = []
    last_saved = ds.step
    t_train = time.perf_counter()
    for batch in DataLoader(ds, batch_size=None, num_workers=0):
        step = ds.step - 1  # the step of the batch just received
        logits = ddp(batch, cp)
        labels = batch["labels"].flatten()
        summed = F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100, reduction="sum")
        # the mean over every real token of the step, on every rank: whatever the mesh cuts
        count = torch.tensor([float((labels != -100).sum())], dtype=torch.float64)
        dist.all_reduce(count)
        loss = summed * (topology.size / count.item())  # DDP averages over the world's ranks
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # for the log: the step's loss, and a digest of every rank's tokens
        digest = zlib.crc32(batch["input_ids"].numpy().tobytes())
        stats = torch.tensor([summed.item(), float(digest)], dtype=torch.float64)
        dist.all_reduce(stats)
        losses.append(stats[0].item() / count.item())
        say(f"step {step} loss {losses[-1]:.6f} data {int(stats[1].item()):09x}", flush=True)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            if rank == 0:
                path = save_checkpoint(args.checkpoint_dir, step + 1, model, opt, ds)
                say(f"checkpoint {path}", flush=True)
            last_saved = step + 1
    if args.checkpoint_dir and ds.step != last_saved and rank == 0:
        say(f"checkpoint {save_checkpoint(args.checkpoint_dir, ds.step, model, opt, ds)}")
    train_s = time.perf_counter() - t_train

    ds.close()  # on every rank: node mode's rank 0 stops the node's Loader
    if args.ray:
        leave_job(rank, loader)
    dist.barrier()
    dist.destroy_process_group()
    if losses:
        k = min(args.average, len(losses))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        say(
            f"loss first {first:.4f} last {last:.4f} (mean of {k} steps each); "
            f"{len(losses)} steps in {train_s:.1f} s, {time.perf_counter() - t0:.1f} s in all"
        )
        if not math.isfinite(last):
            sys.exit("the loss is not finite")


if __name__ == "__main__":
    main()
