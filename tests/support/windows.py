"""Helpers shared by the pure planning tests: a source's pending items as a plain array."""

from __future__ import annotations

import numpy as np


class ArrayWindow:
    """A source's pending items: an endless cycle over an array of lengths."""

    def __init__(self, lengths: np.ndarray):
        self.source = [int(x) for x in lengths]
        self.read = 0
        self.pending: list[int] = []

    @property
    def tokens(self) -> list[int]:
        return self.pending

    def peek(self, i: int) -> int:
        while i >= len(self.pending):
            self.pending.append(self.source[self.read % len(self.source)])
            self.read += 1
        return self.pending[i]

    def take(self, indices: list[int]) -> None:
        gone = set(indices)
        self.pending = [x for i, x in enumerate(self.pending) if i not in gone]


def windows(rng: np.random.Generator, n_sources: int, cap: int, n: int = 4000) -> list[ArrayWindow]:
    """``n_sources`` windows of lognormal lengths in ``[1, cap]``, longer for a later source."""
    return [
        ArrayWindow(np.clip(rng.lognormal(5 + s, 1.2, n).astype(int), 1, cap))
        for s in range(n_sources)
    ]


class ColumnWindow:
    """A source's pending items that hands out the columns a step's plan needs of those taken.

    An endless cycle over an array of lengths, as :class:`ArrayWindow`; the
    ``i``-th item read has key ``(0, 0, i)``, loader slot ``i % loaders`` and
    record row ``i``.
    """

    def __init__(self, lengths: np.ndarray, loaders: int = 2):
        self.source = [int(x) for x in lengths]
        self.loaders = loaders
        self.read = 0
        self.pending: list[int] = []
        self.ids: list[int] = []  # the read order of each pending item

    @property
    def tokens(self) -> list[int]:
        return self.pending

    def peek(self, i: int) -> int:
        while i >= len(self.pending):
            self.pending.append(self.source[self.read % len(self.source)])
            self.ids.append(self.read)
            self.read += 1
        return self.pending[i]

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The taken items' rows (``overlord.plan.step.TAKEN_ROWS``), as a cursor answers."""
        ids = np.array([self.ids[int(i)] for i in indices], dtype=np.int64)
        tokens = np.array([self.pending[int(i)] for i in indices], dtype=np.int64)
        gone = {int(i) for i in indices}
        self.pending = [x for i, x in enumerate(self.pending) if i not in gone]
        self.ids = [x for i, x in enumerate(self.ids) if i not in gone]
        zeros = np.zeros(len(ids), dtype=np.int64)
        # epoch, shard_pos, index, tokens, loader, file_index, row, chunk, patches
        return np.stack([zeros, zeros, ids, tokens, ids % self.loaders, zeros, ids, zeros - 1,
                         zeros])  # fmt: skip
