"""Synthetic documents for the planner and balance benchmarks (no I/O).

Four sources with long-tailed, lognormal lengths in tokens (median and sigma
per source), split at ``max_seq_len`` the way ``long_docs: split`` does: a
document longer than the row becomes full chunks of ``max_seq_len`` tokens and
a remainder. Each source is served through a :class:`Window`, which has the
``tokens`` list and ``peek(i) -> int`` method that
:func:`overlord.plan.select.select_step` reads, and a ``take`` that removes
the chosen items, as the planner's cursor does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from overlord.plan.cost import CostModel
from overlord.plan.select import select_step


@dataclass(frozen=True)
class SourceShape:
    name: str
    median: float  # tokens
    sigma: float  # of log(length)
    weight: float  # share of tokens in the mixture


# web pages are short, code files longer, papers long, books very long (and rare by count)
SOURCES = (
    SourceShape("web", 600, 1.0, 0.50),
    SourceShape("code", 1500, 1.2, 0.20),
    SourceShape("papers", 8000, 0.7, 0.20),
    SourceShape("books", 60000, 0.8, 0.10),
)


def doc_lengths(shape: SourceShape, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` document lengths (tokens, at least 16) drawn from the source's lognormal."""
    x = rng.lognormal(np.log(shape.median), shape.sigma, n)
    return np.maximum(16, x.round()).astype(np.int64)


def split_docs(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Items after ``long_docs: split``: documents over ``cap`` become chunks, in order."""
    n_chunks = np.maximum(1, -(-lengths // cap))
    doc = np.repeat(np.arange(len(lengths)), n_chunks)
    first = np.concatenate(([0], np.cumsum(n_chunks)[:-1]))
    k = np.arange(len(doc)) - np.repeat(first, n_chunks)
    return np.minimum(cap, lengths[doc] - k * cap)


class Window:
    """A source's pending items; drawn in blocks ("shards") from its length distribution."""

    def __init__(self, shape: SourceShape, cap: int, seed: int, block: int = 4096):
        self.shape, self.cap, self.block = shape, cap, block
        self.rng = np.random.default_rng(seed)
        # drawn as numpy arrays, held as Python ints, as the planner's cursor holds them
        self.pending: list[int] = []

    def _more(self) -> None:
        new = split_docs(doc_lengths(self.shape, self.block, self.rng), self.cap)
        self.pending += new.tolist()

    @property
    def tokens(self) -> list[int]:
        """The pending items' tokens fetched so far (what the selector reads)."""
        return self.pending

    def peek(self, i: int) -> int:
        while i >= len(self.pending):
            self._more()
        return self.pending[i]

    def take(self, indices: list[int]) -> None:
        """Remove the pending items a step placed."""
        if not indices:
            return
        taken = set(indices)
        self.pending = [t for j, t in enumerate(self.pending) if j not in taken]


def consume(wins: list[Window], sel: Any) -> None:
    """Take a step's chosen items (a :class:`Selection`) out of their windows."""
    for s, win in enumerate(wins):
        win.take([p for src, p in zip(sel.source, sel.pending_index) if src == s])


def next_step(
    wins: list[Window],
    weights: np.ndarray,
    mix: Any,
    rows: int,
    cap: int,
    lookahead: int,
    model: CostModel,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Select one global step, take its items out of the windows; (tokens, ref_row, cost)."""
    sel = select_step(wins, weights, mix, rows, cap, lookahead)
    consume(wins, sel)
    tokens = np.asarray(sel.tokens, dtype=np.int64)
    return tokens, np.asarray(sel.ref_row, dtype=np.int64), model.cost(tokens)


def windows(cap: int, seed: int) -> list[Window]:
    """One window per source of :data:`SOURCES`."""
    return [Window(s, cap, seed * 1000 + i) for i, s in enumerate(SOURCES)]


def weights() -> np.ndarray:
    """The mixture's token shares, in source order."""
    w = np.array([s.weight for s in SOURCES])
    return w / w.sum()


def model_7b() -> CostModel:
    """The 7B cost model: alpha = 6N, beta = 6 * layers * hidden."""
    return CostModel(alpha=6.0 * 7e9, beta=6.0 * 32 * 4096)
