"""The rows measured: the fit rows of each context, and the balance steps overlord plans."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks._lib.synthetic import SOURCES, consume, doc_lengths, split_docs, weights, windows
from overlord.plan import balance as bal
from overlord.plan.select import MixState, select_step
from overlord.plan.spec import BalanceMethod

LOOKAHEAD = 64  # as benchmarks/balance_e2e.py
PAD_DOC = 64  # padding documents of balance rows that are not full
TINY_DOC = 32
MIN_LADDER = 128


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
