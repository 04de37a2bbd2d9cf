"""The measured transformer block stack: shape, packed-row context, blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    inter: int
    layers: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class RowCtx:
    """What an attention implementation needs about one packed row."""

    lengths: list[int]
    cu: torch.Tensor  # int32 cu_seqlens on the device
    max_len: int
    block_mask: Any = None


AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RowCtx], torch.Tensor]


class Block(nn.Module):
    """Pre-norm transformer block: attention (fused QKV) and a SwiGLU MLP, no biases."""

    def __init__(self, s: Shape, attn: AttnFn):
        super().__init__()
        norm = getattr(nn, "RMSNorm", nn.LayerNorm)
        self.s, self.attn = s, attn
        self.norm1, self.norm2 = norm(s.hidden), norm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
        self.proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.gate_up = nn.Linear(s.hidden, 2 * s.inter, bias=False)
        self.down = nn.Linear(s.inter, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, ctx: RowCtx) -> torch.Tensor:  # x: [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.s.heads, self.s.head_dim).unbind(1)
        x = x + self.proj(self.attn(q, k, v, ctx).reshape(t, self.s.hidden))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Stack(nn.Module):
    def __init__(self, s: Shape, attn: AttnFn):
        super().__init__()
        self.blocks = nn.ModuleList(Block(s, attn) for _ in range(s.layers))

    def forward(self, x: torch.Tensor, ctx: RowCtx) -> torch.Tensor:  # x: [1, T, hidden]
        h = x[0]
        for b in self.blocks:
            h = b(h, ctx)
        return h[None]
