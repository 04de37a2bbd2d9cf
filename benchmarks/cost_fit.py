"""Does overlord's cost model predict measured GPU step time? One row at a time, then a balance.

What is measured: forward plus backward of a stack of ``--layers`` transformer
blocks of a 7B-like dense model (hidden 4096, 32 heads of 128, SwiGLU MLP of
11008, RMSNorm, no rotary; bf16 on CUDA) on one packed row of ``T =
max_seq_len`` tokens: input random activations ``[1, T, 4096]`` that require
grad, loss ``out.float().square().mean()``, then ``backward()``. Attention is
causal and document-masked: each document of the row attends only to itself,
as a trainer does with ``cu_seqlens``. Attention, by ``--attn`` (``auto``
takes the first that works, checked against ``sdpa-loop`` on a small row):

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention on
  ``cu_seqlens``), where the installed torch has it: what trainers use;
- ``flex``: ``flex_attention`` under ``torch.compile`` with a block mask that
  is causal and same-document (built before timing, once per row);
- ``sdpa-loop``: ``scaled_dot_product_attention(is_causal=True)`` per
  document slice (exact, but a Python loop; the CPU path).

It imports ``overlord.plan`` (numpy and pydantic). On a GPU machine that has
torch but not pydantic, carry its wheels and put them on the path first, e.g.
``pip download --no-deps --only-binary=:all: -d .whl pydantic==2.14.4
pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions``
(for that machine's Python and platform), then ``pip install --no-deps
--target /tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site:. python3 -m
benchmarks.cost_fit``.

Each time is the median of ``--reps`` repetitions timed with CUDA events
(``perf_counter`` on CPU), after warm-up (more for the first row of a shape,
where ``torch.compile`` runs).

The rows: for each context, a ladder of rows of equal documents (one document
of the whole row, two halves, ... down to 128 tokens), a row of 32-token
documents, and rows drawn from the long-tailed sources of
``benchmarks/_lib/synthetic.py`` (the mixture by token share, and web, code and
papers alone), documents split at the context as ``long_docs: split`` does,
packed in order, the last one cut to fit. So every row holds exactly T tokens
(S1 = sum L = T) and S2 = sum L**2 spans T*32 .. T**2. (Attention kernels work
in tiles of 64-128 tokens, so documents shorter than a tile cost more than
their L**2: the 32-token rows show how much.)

The model under test (``overlord/plan/cost.py``): a document of L tokens costs
``alpha * L + beta * L**2`` with ``alpha = 6 * params`` and ``beta = 6 *
layers * hidden``; here params is the parameter count of the measured block
stack, so a row costs ``alpha * S1 + beta * S2``. Fits, over all contexts
together (S1 is constant within a context):

(a) overlord's model with one free scale, ``t = k * (alpha*S1 + beta*S2)``
    (k by least squares on relative error); R^2, mean and max absolute
    percentage error, overall and per context; ``1 / k`` is the model FLOP/s
    achieved. Per context, a free line ``t = u + v * S2`` gives the measured
    weight of attention against the model's: ``(v * S1 / u) / (beta / alpha)``
    (1 when overlord's beta/alpha is right; the fixed overhead lowers it).
(b) a free ``t = a*S1 + b*S2 + c``, fitted by ``overlord.plan.cost.fit_cost``
    (``CostModel.fit``; least squares on relative error; c only with two or
    more token counts): R^2,
    ``b / a`` against overlord's ``beta / alpha``, and the fixed overhead c.
    Flash attention does about 7 L**2 * hidden FLOPs per layer forward and
    backward with recomputation against the model's 6, at a lower FLOP rate
    than the matmuls, so b/a above beta/alpha is expected.

(c) End to end: ``--balance-steps`` steps of ``--balance-dp`` ranks x
``--balance-rpr`` rows at each ``--balance-contexts`` context, from overlord's
own reference packing (``select_step`` over the synthetic sources, as
``benchmarks/balance_e2e.py``), assigned with ``overlord.plan.balance.assign``
by ``kk`` and by ``none`` (the baseline), with overlord's cost model of the
measured stack. Every row is measured: at its own length (a varlen trainer,
whose padding costs nothing, as the model assumes), or with ``flex``, which is
compiled per length, padded to T with 64-token padding documents. A rank's
time is the sum of its rows; the measured speed-up (max rank, none / kk) is set
next to the model's predicted one and to the one fit (b) predicts, and each
rank's measured time against overlord's model scaled by fit (a)'s k.

Run from the repository root (GPU: a few minutes; ``--budget-s``, counted from
after the imports, stops measuring new rows in time and still writes
everything; the balance steps are measured after a third of the fit rows)::

    python -m benchmarks.cost_fit --out /tmp/cost_fit
    python -m benchmarks.cost_fit --quick --device cpu   # plumbing only, under a minute

Writes ``cost_fit.json``, ``cost_fit.md`` (every row) and ``cost_fit.png``
(measured against predicted) into ``--out`` (default ``$OUT``, else
``benchmarks/``); prints the summary tables last.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._lib.synthetic import SOURCES, consume, doc_lengths, split_docs, weights, windows
from overlord.plan import balance as bal
from overlord.plan.cost import CostModel, fit_cost
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod, CostSpec

HERE = os.path.dirname(os.path.abspath(__file__))

LOOKAHEAD = 64  # as benchmarks/balance_e2e.py
PAD_DOC = 64  # padding documents of balance rows that are not full
TINY_DOC = 32
MIN_LADDER = 128


# ---------------------------------------------------------------------------- model


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


# ------------------------------------------------------------------------ attention
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


# ---------------------------------------------------------------------------- rows


@dataclass
class Row:
    context: int
    kind: str
    lengths: list[int]
    group: str = "fit"  # fit | balance
    ms: float = float("nan")
    ms_all: list[float] = field(default_factory=list)
    pred_a: float | None = None  # ms, by fit (a)
    pred_b: float | None = None  # ms, by fit (b)
    n_real: int | None = None  # the first n_real lengths are documents, the rest padding

    @property
    def real(self) -> list[int]:
        return self.lengths if self.n_real is None else self.lengths[: self.n_real]

    @property
    def s1(self) -> int:
        return int(sum(self.lengths))

    @property
    def s2(self) -> int:
        return int(sum(n * n for n in self.lengths))


def doc_probabilities(shares: np.ndarray) -> np.ndarray:
    """Per-document source probabilities whose expected token shares are ``shares``."""
    mean_len = np.array([s.median * math.exp(s.sigma**2 / 2) for s in SOURCES])
    p = shares / mean_len
    return p / p.sum()


def mixed_row(cap: int, probs: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Documents drawn from the sources, split at ``cap``, packed in order; the last one cut."""
    out: list[int] = []
    while sum(out) < cap:
        src = int(rng.choice(len(SOURCES), p=probs))
        for piece in split_docs(doc_lengths(SOURCES[src], 1, rng), cap).tolist():
            room = cap - sum(out)
            if room <= 0:
                break
            out.append(min(int(piece), room))
    return out


def fit_rows(cap: int, n: int, rng: np.random.Generator) -> list[Row]:
    """``n`` rows of ``cap`` tokens, extremes first, then ladder and mixed rows interleaved."""
    ladder, length = [], cap
    while length >= MIN_LADDER:
        ladder.append(Row(cap, f"equal-{length}", [length] * (cap // length)))
        length //= 2
    tiny = Row(cap, f"equal-{TINY_DOC}", [TINY_DOC] * (cap // TINY_DOC))
    # the mixture, and each source alone but books (a row of books is one chunk of T)
    mixes = [("mix", weights())] + [
        (s.name, np.eye(len(SOURCES))[i]) for i, s in enumerate(SOURCES) if s.name != "books"
    ]
    mixed: list[Row] = []
    seen = {tuple(r.lengths) for r in [*ladder, tiny]}
    for i in range(max(0, n - len(ladder) - 1)):
        name, shares = mixes[i % len(mixes)]
        for _ in range(20):  # a row like one already there (one full chunk, say) adds nothing
            lengths = mixed_row(cap, doc_probabilities(shares), rng)
            if tuple(lengths) not in seen:
                break
        seen.add(tuple(lengths))
        mixed.append(Row(cap, f"docs-{name}", lengths))
    rest: list[Row] = []
    middle = ladder[1:-1]
    for i in range(max(len(middle), len(mixed))):
        rest += mixed[i : i + 1] + middle[i : i + 1]
    return ([ladder[0], ladder[-1], tiny] + rest)[:n]


def pad_row(lengths: list[int], cap: int) -> list[int]:
    left = cap - sum(lengths)
    return (
        list(lengths) + [PAD_DOC] * (left // PAD_DOC) + ([left % PAD_DOC] if left % PAD_DOC else [])
    )


@dataclass
class BalanceStep:
    context: int
    step: int
    dp: int
    rpr: int
    items: list[int]
    predicted: dict[str, float]  # makespan by overlord's model, per method
    rows: dict[str, list[Row]]  # the dp * rpr rows of each method, in global row order
    real_tokens: dict[str, list[int]]  # real (not padding) tokens of each row


def balance_steps(
    cap: int, dp: int, rpr: int, steps: int, cm: Any, seed: int, pad: bool
) -> list[BalanceStep]:
    """Steps of overlord's reference packing, assigned by ``kk`` and by ``none``.

    ``pad``: rows not full are padded to ``cap`` tokens (for flex, compiled per
    row length); otherwise a row is run at its own length, as a varlen trainer
    does, and an empty row costs nothing.
    """
    wins = windows(cap, seed)
    mix = MixState.zeros(len(wins))
    out = []
    for s in range(steps):
        sel = select_step(wins, weights(), mix, dp * rpr, cap, LOOKAHEAD)
        consume(wins, sel)
        tok = np.asarray(sel.tokens, dtype=np.int64)
        ref_row = np.asarray(sel.ref_row, dtype=np.int64)
        cost = cm.cost(tok)
        step = BalanceStep(cap, s, dp, rpr, tok.tolist(), {}, {}, {})
        for method in (BalanceMethod.NONE, BalanceMethod.KK):
            row = bal.assign(tok, cost, ref_row, dp, rpr, cap, method)
            m = method.value
            step.predicted[m] = float(bal.rank_costs(cost, row, dp, rpr).max())
            step.rows[m], step.real_tokens[m] = [], []
            for j in range(dp * rpr):
                docs = tok[row == j].tolist()
                step.real_tokens[m].append(int(sum(docs)))
                row_ = Row(cap, f"{m}-s{s}-r{j}", pad_row(docs, cap) if pad else docs, "balance")
                row_.n_real = len(docs)
                if not row_.lengths:
                    row_.ms = 0.0
                step.rows[m].append(row_)
        out.append(step)
    return out


# -------------------------------------------------------------------------- timing


class Timer:
    def __init__(
        self,
        stack: Stack,
        s: Shape,
        device: torch.device,
        dtype: torch.dtype,
        flex: Flex | None,
        max_tokens: int,
    ):
        self.stack, self.s, self.device, self.dtype, self.flex = stack, s, device, dtype, flex
        g = torch.Generator(device="cpu").manual_seed(0)
        # random activations, [1, max_tokens, hidden]; a row of T tokens takes the first T
        self.base = torch.randn(1, max_tokens, s.hidden, generator=g).to(device, dtype)
        self.cuda = device.type == "cuda"

    def _step(self, x: torch.Tensor, ctx: RowCtx) -> None:
        self.stack(x, ctx).float().square().mean().backward()

    def _clear(self, x: torch.Tensor) -> None:
        x.grad = None
        self.stack.zero_grad(set_to_none=True)

    def measure(self, lengths: list[int], warmup: int, reps: int) -> list[float]:
        """Milliseconds of forward + backward, ``reps`` times, after ``warmup`` untimed runs."""
        x = self.base[:, : sum(lengths)].detach().requires_grad_(True)
        ctx = row_ctx(lengths, self.device, self.flex)  # the block mask too: not timed
        for _ in range(warmup):
            self._clear(x)
            self._step(x, ctx)
        times = []
        for _ in range(reps):
            self._clear(x)
            if self.cuda:
                torch.cuda.synchronize()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                self._step(x, ctx)
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)))
            else:
                t0 = time.perf_counter()
                self._step(x, ctx)
                times.append(1e3 * (time.perf_counter() - t0))
        self._clear(x)
        return times


# ----------------------------------------------------------------------------- fits


def r2(t: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((t - t.mean()) ** 2).sum())
    return 1.0 - float(((t - pred) ** 2).sum()) / ss if ss > 0 else float("nan")


def errors(t: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    ape = np.abs(pred - t) / t
    return {"r2": r2(t, pred), "mape": float(ape.mean()), "max_ape": float(ape.max())}


def fit_scale(x: np.ndarray, t: np.ndarray) -> float:
    """k minimizing sum ((k x - t) / t)**2."""
    return float((x / t).sum() / ((x / t) ** 2).sum())


def fits(rows: list[Row], alpha: float, beta: float) -> dict[str, Any]:
    """Fits (a) and (b) over the measured fit rows; sets every measured row's predictions."""
    ok = [r for r in rows if r.group == "fit" and math.isfinite(r.ms)]
    if len(ok) < 2:
        return {}
    s1 = np.array([r.s1 for r in ok], dtype=np.float64)
    s2 = np.array([r.s2 for r in ok], dtype=np.float64)
    t = np.array([r.ms for r in ok])
    ctxs = np.array([r.context for r in ok])
    x = alpha * s1 + beta * s2
    k = fit_scale(x, t)
    fa: dict[str, Any] = {"k_ms_per_flop": k, "tflops": 1e-9 / k, **errors(t, k * x), "n": len(ok)}
    per: dict[str, Any] = {}
    for c in sorted(set(ctxs.tolist())):
        m = ctxs == c
        entry: dict[str, Any] = {"n": int(m.sum()), **errors(t[m], k * x[m])}
        if len(set(s2[m].tolist())) >= 2:  # t = u + v * S2 within the context
            v, u = np.polyfit(s2[m], t[m], 1, w=1 / t[m])  # least relative error
            entry["attn_weight"] = float((v * c / u) / (beta / alpha))
            entry["line_r2"] = r2(t[m], u + v * s2[m])
        per[str(c)] = entry
    fa["per_context"] = per
    # (b) is overlord's CostModel.fit; with one token count (S1) the overhead c cannot be
    # told from a, so it is left out (a absorbs it)
    identifiable = len(set(s1.tolist())) >= 2
    try:
        got = fit_cost([r.lengths for r in ok], t, intercept=identifiable)
        a, b, c0 = got.model.alpha, got.model.beta, got.intercept
        fb: dict[str, Any] = {"a_ms_per_token": a, "b_ms_per_token2": b, "c_ms": c0}
    except ValueError as e:  # e.g. a negative beta from noisy CPU times: reported, not fitted
        print(f"note: fit (b) failed: {e}")
        a = b = c0 = float("nan")
        fb = {"error": str(e), "a_ms_per_token": a, "b_ms_per_token2": b, "c_ms": c0}
    fb |= {
        **errors(t, a * s1 + b * s2 + c0),
        "b_over_a": float(b / a) if a else float("nan"),
        "model_beta_over_alpha": beta / alpha,
        "identifiable": identifiable,
    }
    fb["ratio_to_model"] = fb["b_over_a"] / (beta / alpha)
    for r in rows:
        if math.isfinite(r.ms):
            r.pred_a = k * (alpha * r.s1 + beta * r.s2)
            r.pred_b = float(a * r.s1 + b * r.s2 + c0)
    return {"a": fa, "b": fb}


def balance_results(
    steps: list[BalanceStep], alpha: float, beta: float, fitted: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per step: each rank's measured time (the sum of its rows) against the predictions.

    overlord's model sees real documents only; fit (b) is applied to the rows as run
    (padding included). Returns the steps and totals over all of them.
    """
    fa, fb = fitted.get("a"), fitted.get("b")
    out: list[dict[str, Any]] = []
    ms_all, model_all = [], []
    for st in steps:
        if not all(math.isfinite(r.ms) for m in st.rows for r in st.rows[m]):
            continue  # not every row measured: no makespan
        entry: dict[str, Any] = {
            "context": st.context,
            "step": st.step,
            "dp": st.dp,
            "rows_per_rank": st.rpr,
            "items": len(st.items),
        }
        starts = np.arange(0, st.dp * st.rpr, st.rpr)
        for m, rows in st.rows.items():
            rank_ms = np.add.reduceat(np.array([r.ms for r in rows]), starts)
            model = np.array(
                [alpha * sum(r.real) + beta * sum(n * n for n in r.real) for r in rows]
            )
            rank_model = np.add.reduceat(model, starts)
            entry[m] = {
                "rank_ms": rank_ms.tolist(),
                "rank_model": rank_model.tolist(),
                "max_ms": float(rank_ms.max()),
                "mean_ms": float(rank_ms.mean()),
                "predicted_max": st.predicted[m],
                "unfilled_tokens": int(st.context * len(rows) - sum(st.real_tokens[m])),
            }
            ms_all += rank_ms.tolist()
            model_all += rank_model.tolist()
            if fb:  # an empty row is not run
                a, b, c = fb["a_ms_per_token"], fb["b_ms_per_token2"], fb["c_ms"]
                run = np.array([a * r.s1 + b * r.s2 + c if r.lengths else 0.0 for r in rows])
                entry[m]["fit_b_max_ms"] = float(np.add.reduceat(run, starts).max())
        entry["measured_speedup"] = entry["none"]["max_ms"] / entry["kk"]["max_ms"]
        entry["predicted_speedup"] = st.predicted["none"] / st.predicted["kk"]
        if fb:
            entry["fit_b_speedup"] = entry["none"]["fit_b_max_ms"] / entry["kk"]["fit_b_max_ms"]
        out.append(entry)
    total: dict[str, Any] = {}
    if out:
        total = {
            "steps": len(out),
            "measured_speedup": sum(b["none"]["max_ms"] for b in out)
            / sum(b["kk"]["max_ms"] for b in out),
            "predicted_speedup": sum(b["none"]["predicted_max"] for b in out)
            / sum(b["kk"]["predicted_max"] for b in out),
        }
        t, x = np.array(ms_all), np.array(model_all)
        if len(t) >= 3 and t.std() > 0 and x.std() > 0:
            total["rank_pearson_r"] = float(np.corrcoef(x, t)[0, 1])
        if fa:  # each rank's time by fit (a)'s k, fitted on the fit rows alone
            total["rank_a"] = errors(t, fa["k_ms_per_flop"] * x)
    return out, total


# ---------------------------------------------------------------------------- output


def clean(o: Any) -> Any:
    """JSON-safe: non-finite floats become null, numpy scalars Python numbers."""
    if isinstance(o, dict):
        return {str(k): clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def ctx_label(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def summary_md(res: dict[str, Any]) -> str:
    cfg, fa, fb = res["config"], res["fits"].get("a"), res["fits"].get("b")
    lines = [
        "# Cost model against measured step time\n",
        f"{cfg['device_name']}, torch {cfg['torch']}, {cfg['dtype']}, attention `{cfg['attn']}` "
        f"({cfg['attn_check']}); {cfg['layers']} block(s) of hidden {cfg['hidden']}, "
        f"{cfg['heads']} heads, MLP {cfg['inter']}; P = {cfg['params']:,} parameters; "
        f"alpha = 6P = {cfg['alpha']:.4g}, beta = 6*layers*hidden = {cfg['beta']:.4g}; "
        f"median of {cfg['reps']} reps; {cfg['rows_measured']} rows measured in "
        f"{cfg['elapsed_s']:.0f} s"
        + (" (stopped by --budget-s)" if cfg["stopped_early"] else "")
        + ".\n",
    ]
    if cfg["attn_fallbacks"]:
        lines.append("Attention fallbacks: " + "; ".join(cfg["attn_fallbacks"]) + "\n")
    if fa and fb:
        lines += [
            "## Fits over all contexts\n",
            "| model | R^2 | mean abs % err | max abs % err | parameters |",
            "|---|---:|---:|---:|---|",
            f"| (a) k * (alpha S1 + beta S2) | {fa['r2']:.4f} | {100 * fa['mape']:.1f}% "
            f"| {100 * fa['max_ape']:.1f}% | 1/k = {fa['tflops']:.3g} model TFLOP/s |",
            f"| (b) a S1 + b S2 + c | {fb['r2']:.4f} | {100 * fb['mape']:.1f}% "
            f"| {100 * fb['max_ape']:.1f}% | b/a = {fb['b_over_a']:.3g} vs beta/alpha = "
            f"{fb['model_beta_over_alpha']:.3g} (x{fb['ratio_to_model']:.2f}); "
            f"c = {fb['c_ms']:.2f} ms"
            + ("" if fb["identifiable"] else " (one token count: c not fitted, a absorbs it)")
            + (f"; the fit failed: {fb['error']}" if "error" in fb else "")
            + " |",
            "",
            "## Per context, model (a) with the global k\n",
            "| context | rows | t min-max ms | S2/T^2 min-max | R^2 (a) | mean abs % err "
            "| max abs % err | attention weight measured/model |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [r for r in res["rows"] if r["group"] == "fit" and r["ms"] is not None]
        for c, e in fa["per_context"].items():
            mine = [r for r in rows if r["context"] == int(c)]
            ts = [r["ms"] for r in mine]
            sq = [r["S2"] / int(c) ** 2 for r in mine]
            w = f"{e['attn_weight']:.2f}" if e.get("attn_weight") is not None else "-"
            r2c = f"{e['r2']:.3f}" if e.get("r2") is not None else "-"
            lines.append(
                f"| {ctx_label(int(c))} | {e['n']} | {min(ts):.1f}-{max(ts):.1f} "
                f"| {min(sq):.4f}-{max(sq):.3f} | {r2c} | {100 * e['mape']:.1f}% "
                f"| {100 * e['max_ape']:.1f}% | {w} |"
            )
    else:
        lines.append("Too few rows measured to fit.\n")
    if res["balance"]:
        lines += [
            "\n## End to end: max-rank time, kk against none (measured rows)\n",
            "| context | step | DP x rows | items | none max ms | kk max ms | measured speed-up "
            "| model predicted | fit (b) predicted | none/kk mean ms | unfilled tokens none/kk |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for b in res["balance"]:
            fbs = f"{b['fit_b_speedup']:.3f}x" if "fit_b_speedup" in b else "-"
            lines.append(
                f"| {ctx_label(b['context'])} | {b['step']} | {b['dp']} x {b['rows_per_rank']} "
                f"| {b['items']} | {b['none']['max_ms']:.1f} | {b['kk']['max_ms']:.1f} "
                f"| {b['measured_speedup']:.3f}x | {b['predicted_speedup']:.3f}x | {fbs} "
                f"| {b['none']['mean_ms']:.1f}/{b['kk']['mean_ms']:.1f} "
                f"| {b['none']['unfilled_tokens']}/{b['kk']['unfilled_tokens']} |"
            )
        tot = res["balance_total"]
        how = "padded to T" if cfg["balance_rows_padded"] else "run at their own length"
        lines.append(
            f"\nAll {tot['steps']} step(s): measured {tot['measured_speedup']:.3f}x, "
            f"model {tot['predicted_speedup']:.3f}x (sums of makespans, none / kk). "
            f"Rows not full were {how}."
        )
        if "rank_a" in tot:
            ra = tot["rank_a"]
            r = tot.get("rank_pearson_r")
            lines.append(
                f"Per rank ({2 * sum(b['dp'] for b in res['balance'])}: both methods, all steps), "
                f"measured time "
                f"against overlord's model x k of fit (a): mean abs error {100 * ra['mape']:.1f}%, "
                f"max {100 * ra['max_ape']:.1f}%"
                + (f", Pearson r {r:.3f}" if r is not None else "")
                + ".\n"
            )
    else:
        lines.append("\nBalance check: not measured (budget or failures).\n")
    return "\n".join(lines)


def rows_md(res: dict[str, Any]) -> str:
    lines = [
        "## Every row\n",
        "| group | context | kind | docs | S2/T^2 | ms | (a) ms | (b) ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        f = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("ms", "pred_a", "pred_b")]
        lines.append(
            f"| {r['group']} | {ctx_label(r['context'])} | {r['kind']} | {r['n_docs']} "
            f"| {r['S2'] / r['context'] ** 2:.4f} | {f[0]} | {f[1]} | {f[2]} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("note: no matplotlib, no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rows = [r for r in res["rows"] if r.get("pred_a") is not None]
    if not rows:
        return
    fa, fb = res["fits"]["a"], res["fits"]["b"]
    ctxs = sorted({r["context"] for r in rows})
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(ctxs)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, key, title in (
        (
            axes[0],
            "pred_a",
            f"(a) overlord's model x k: R^2 {fa['r2']:.3f}, mean err {100 * fa['mape']:.1f}%",
        ),
        (
            axes[1],
            "pred_b",
            f"(b) a S1 + b S2 + c: R^2 {fb['r2']:.3f}, "
            f"b/a = {fb['ratio_to_model']:.2f} x beta/alpha",
        ),
    ):
        for c, col in zip(ctxs, colors):
            for group, marker in (("fit", "o"), ("balance", "x")):
                mine = [r for r in rows if r["context"] == c and r["group"] == group]
                if mine:
                    ax.scatter(
                        [r[key] for r in mine],
                        [r["ms"] for r in mine],
                        color=col,
                        marker=marker,
                        s=18,
                        label=ctx_label(c) + (" (balance rows)" if group == "balance" else ""),
                    )
        lo = min(min(r["ms"], r[key]) for r in rows) * 0.9
        hi = max(max(r["ms"], r[key]) for r in rows) * 1.1
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("predicted ms")
        ax.set_ylabel("measured ms (forward + backward)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8, title="context")
    cfg = res["config"]
    fig.suptitle(
        f"forward + backward of {cfg['layers']} block(s) of hidden {cfg['hidden']}, "
        f"{cfg['attn']} attention, {cfg['dtype']}, {cfg['device_name']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bf16 on CUDA")
    ap.add_argument(
        "--attn",
        default="auto",
        choices=("auto", "varlen", "varlen-contiguous", "flex", "sdpa-loop"),
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--rows", type=int, default=24, help="fit rows per context")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per row")
    ap.add_argument(
        "--warmup-first", type=int, default=3, help="untimed runs, first row of a shape"
    )
    ap.add_argument("--balance-contexts", default="16384", help="'' for no balance check")
    ap.add_argument("--balance-dp", type=int, default=8)
    ap.add_argument("--balance-rpr", type=int, default=2)
    ap.add_argument("--balance-steps", type=int, default=4)
    ap.add_argument("--balance-reps", type=int, default=3)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="stop measuring new rows after this many seconds from the start",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny model and contexts (plumbing)")
    ap.add_argument("--out", default=os.environ.get("OUT") or HERE)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.inter, args.layers = 256, 4, 688, 1
        args.contexts, args.rows, args.reps, args.warmup_first = "512,1024", 6, 2, 1
        args.balance_contexts, args.balance_dp, args.balance_rpr = "1024", 4, 2
        args.balance_steps, args.balance_reps = 1, 1
        args.budget_s = min(args.budget_s, 40.0)
    return args


def choose_attn(
    args: argparse.Namespace,
    s: Shape,
    device: torch.device,
    dtype: torch.dtype,
    max_tokens: int,
    check_t: int,
) -> tuple[str, AttnFn, Flex | None, str, list[str]]:
    """The first attention of the chain that runs and matches ``sdpa-loop``, and why not others."""
    order = ["varlen", "varlen-contiguous", "flex", "sdpa-loop"]
    if args.attn != "auto":
        chain = order[order.index(args.attn) :]
    else:
        chain = order if device.type == "cuda" else ["sdpa-loop"]
    fallbacks: list[str] = []
    for name in chain:
        try:
            flex = None
            if name.startswith("varlen"):
                fn: AttnFn = make_varlen(contiguous=name == "varlen-contiguous")
            elif name == "flex":
                flex = Flex(max_tokens, device)
                fn = flex
            else:
                fn = attn_sdpa_loop
            note = (
                check_attn(fn, flex, s, check_t, device, dtype)
                if name != "sdpa-loop"
                else "the reference"
            )
            return name, fn, flex, note, fallbacks
        except Exception as e:  # any failure: try the next one
            msg = f"{name} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            print(f"attention: {msg}; trying the next")
            fallbacks.append(msg)
    raise RuntimeError("no attention implementation works: " + "; ".join(fallbacks))


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    s = Shape(args.hidden, args.heads, args.inter, args.layers)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    bal_contexts = [int(c) for c in args.balance_contexts.split(",") if c]
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    if args.quick and device.type == "cpu":
        torch.set_num_threads(1)  # plumbing only: steady on a shared machine

    max_tokens = max(contexts + bal_contexts)
    name, fn, flex, note, fallbacks = choose_attn(
        args, s, device, dtype, max_tokens, min(contexts + bal_contexts)
    )
    print(f"attention: {name} ({note})", flush=True)
    stack = Stack(s, fn).to(device, dtype)
    params = sum(p.numel() for p in stack.parameters())
    cm = CostModel.from_spec(
        CostSpec(model={"params": float(params), "layers": s.layers, "hidden": s.hidden})
    )
    timer = Timer(stack, s, device, dtype, flex, max_tokens)

    # the order of work: a third of each context's rows (round robin), the balance check,
    # then the rest; --budget-s cuts the tail (a balance step not measured in full is
    # left out of the balance results)
    rng = np.random.default_rng(args.seed)
    per_ctx = {c: fit_rows(c, args.rows, rng) for c in contexts}
    first = max(3, -(-args.rows // 3))
    pad = name == "flex"  # flex is compiled per row length: run balance rows padded to T
    steps = [
        st
        for c in bal_contexts
        for st in balance_steps(
            c, args.balance_dp, args.balance_rpr, args.balance_steps, cm, args.seed, pad
        )
    ]
    jobs: list[tuple[Row, int]] = []
    for lo, hi in ((0, first), (first, args.rows)):
        for i in range(lo, hi):
            jobs += [(per_ctx[c][i], args.reps) for c in contexts if i < len(per_ctx[c])]
        if lo == 0:
            jobs += [(r, args.balance_reps) for st in steps for m in st.rows for r in st.rows[m]]

    warmed: set[int] = set()
    last_s: dict[int, float] = {}
    cache: dict[tuple[int, ...], list[float]] = {}
    stopped_early, failures, measured = False, 0, 0
    for row, reps in jobs:
        if not row.lengths:  # an empty row of a balance step: nothing to run
            continue
        key = tuple(row.lengths)
        if key in cache:  # the same row under both methods, or a padded twin
            row.ms_all = cache[key]
            row.ms = float(np.median(row.ms_all))
            continue
        elapsed = time.perf_counter() - t_start
        if elapsed + last_s.get(row.context, 0.0) > args.budget_s:
            stopped_early = True
            continue
        warm = args.warmup if row.context in warmed else args.warmup_first
        t0 = time.perf_counter()
        try:
            row.ms_all = timer.measure(row.lengths, warm, reps)
        except Exception as e:  # report, go on with the other rows
            failures += 1
            why = " ".join(str(e).split())[:500]
            print(f"row {row.kind} at {row.context} failed: {type(e).__name__}: {why}", flush=True)
            if failures >= 3:
                print("three rows failed: stopping", flush=True)
                stopped_early = True
                break
            continue
        warmed.add(row.context)
        last_s[row.context] = time.perf_counter() - t0
        row.ms = float(np.median(row.ms_all))
        cache[key] = row.ms_all
        measured += 1
        print(
            f"[{time.perf_counter() - t_start:6.1f}s] {ctx_label(row.context):>4} {row.group:7} "
            f"{row.kind:16} docs={len(row.lengths):4d} S2/T^2={row.s2 / row.context**2:.4f} "
            f"{row.ms:8.2f} ms",
            flush=True,
        )

    all_rows = [r for c in contexts for r in per_ctx[c]] + [
        r for st in steps for m in st.rows for r in st.rows[m]
    ]
    fitted = fits(all_rows, cm.alpha, cm.beta)
    balance, balance_total = balance_results(steps, cm.alpha, cm.beta, fitted)
    res: dict[str, Any] = {
        "config": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__,
            "dtype": str(dtype).replace("torch.", ""),
            "attn": name,
            "attn_check": note,
            "attn_fallbacks": fallbacks,
            "hidden": s.hidden,
            "heads": s.heads,
            "inter": s.inter,
            "layers": s.layers,
            "params": params,
            "alpha": cm.alpha,
            "beta": cm.beta,
            "contexts": contexts,
            "reps": args.reps,
            "warmup": args.warmup,
            "warmup_first": args.warmup_first,
            "balance_reps": args.balance_reps,
            "balance_rows_padded": pad,
            "budget_s": args.budget_s,
            "rows_measured": measured,
            "row_failures": failures,
            "stopped_early": stopped_early,
            "quick": args.quick,
        },
        "rows": [
            {
                "group": r.group,
                "context": r.context,
                "kind": r.kind,
                "n_docs": len(r.lengths),
                "S1": r.s1,
                "S2": r.s2,
                "ms": r.ms,
                "ms_all": r.ms_all,
                "pred_a": r.pred_a,
                "pred_b": r.pred_b,
                "n_real": r.n_real,
                "lengths": r.lengths,
            }
            for r in all_rows
        ],
        "fits": fitted,
        "balance": balance,
        "balance_total": balance_total,
    }
    res["config"]["elapsed_s"] = time.perf_counter() - t_start
    res = clean(res)
    with open(os.path.join(args.out, "cost_fit.json"), "w") as f:
        json.dump(res, f, indent=1)
    summary = summary_md(res)
    with open(os.path.join(args.out, "cost_fit.md"), "w") as f:
        f.write(summary + "\n" + rows_md(res))
    if fitted:
        plot(res, os.path.join(args.out, "cost_fit.png"))
    print("\n" + summary)
    names = ("cost_fit.json", "cost_fit.md", "cost_fit.png")
    print("Written: " + ", ".join(os.path.join(args.out, n) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
