"""Document-masked causal attention over a packed row: varlen, flex, SDPA per document."""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.cost_fit.model import AttnFn, RowCtx, Shape

# q, k, v: [T, heads, head_dim]; each returns [T, heads, head_dim]


def attn_sdpa_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RowCtx) -> torch.Tensor:
    out, s = [], 0
    for n in ctx.lengths:
        e = s + n
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True
        )
        out.append(o.transpose(0, 1))
        s = e
    return torch.cat(out, dim=0)


def make_varlen(contiguous: bool = False) -> AttnFn:
    """``varlen_attn``, causal; raises where the installed torch has none.

    q, k and v are strided views of the fused QKV output; ``contiguous`` copies
    them first, for a kernel that would not take them as they are.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch > 2.10: (-1, 0) is causal
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:  # torch 2.10
        causal = {"is_causal": True}
    else:
        raise RuntimeError(f"varlen_attn{inspect.signature(varlen_attn)}: no causal argument")

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RowCtx) -> torch.Tensor:
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = varlen_attn(q, k, v, ctx.cu, ctx.cu, ctx.max_len, ctx.max_len, **causal)
        return out[0] if isinstance(out, tuple) else out

    return attn


class Flex:
    """``flex_attention`` under ``torch.compile``, with a causal same-document block mask.

    The mask function reads one buffer of document ids (the longest row's
    size), updated in place per row, so it is the same function for every row
    and the compiled attention is not recompiled for a new mask (a block mask
    holds until the next one is built); ``dynamic=False`` compiles once per row
    length.
    """

    def __init__(self, max_tokens: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        cfg = torch._dynamo.config
        for name, value in (("recompile_limit", 64), ("cache_size_limit", 64)):
            if hasattr(cfg, name):
                setattr(cfg, name, value)
        for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
            if hasattr(cfg, name):  # never fall back to eager flex (it materializes T x T)
                setattr(cfg, name, True)
        self.create_block_mask = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.device = device
        self.doc = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        doc = self.doc

        def same_doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

        self.mask_mod = same_doc_causal

    def block_mask(self, lengths: list[int]) -> Any:
        t = sum(lengths)
        ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        self.doc[:t].copy_(torch.from_numpy(ids))
        return self.create_block_mask(self.mask_mod, None, None, t, t, device=self.device)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RowCtx
    ) -> torch.Tensor:
        o = self.flex(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=ctx.block_mask,
        )
        return o[0].transpose(0, 1)


def row_ctx(lengths: list[int], device: torch.device, flex: Flex | None) -> RowCtx:
    cu = torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int32, device=device)
    ctx = RowCtx(list(lengths), cu, max(lengths))
    if flex is not None:
        ctx.block_mask = flex.block_mask(lengths)
    return ctx


def check_attn(
    fn: AttnFn, flex: Flex | None, s: Shape, t: int, device: torch.device, dtype: torch.dtype
) -> str:
    """Output and gradients of ``fn`` against ``sdpa-loop`` on a row of ``t`` tokens."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = [t // 2 + 7, t // 4 - 3, t - (t // 2 + 7) - (t // 4 - 3)]
    ctx = row_ctx(lengths, device, flex)
    # laid out as in Block: views of one [T, 3, heads, head_dim] tensor
    qkv = torch.randn(t, 3, s.heads, s.head_dim, generator=g).to(device, dtype)
    grad = torch.randn(t, s.heads, s.head_dim, generator=g).to(device, dtype)
    results = []
    for f in (fn, attn_sdpa_loop):
        x = qkv.clone().requires_grad_(True)
        q, k, v = x.unbind(1)
        out = f(q, k, v, ctx)
        (out.float() * grad.float()).sum().backward()
        assert x.grad is not None
        results.append((out.detach().float(), x.grad.float()))
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(results[0], results[1])]
    if not all(math.isfinite(e) and e < 2e-2 for e in errs):
        raise RuntimeError(
            f"differs from sdpa-loop: relative error out {errs[0]:.3g}, grad {errs[1]:.3g}"
        )
    return f"matches sdpa-loop (relative error out {errs[0]:.1e}, grads {errs[1]:.1e})"
