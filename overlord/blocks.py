"""Blocks of memory used again once nothing holds them: their reference count says when.

A process that builds one large array after another (a batch a step, a window of
ids a few steps) writes into the same few blocks instead of mapping fresh memory
each time. In a process whose allocator hands blocks of 128 KiB and more back to
the system when freed (:func:`overlord.runtime.hosting.lean_allocators`: a data
process, a loader process), a fresh block costs a page fault per page. On this
project's machine, allocating and writing 0.25 MiB cost 296 us in such a process and
33 us in a block used again; 16 MiB (in huge pages) cost 5.4 ms against 1.4.

A block is free when its only holder is its :class:`KeptBlocks` list: every view of it
(a slice, a tensor made from one, an Arrow buffer over one) holds the block, so a
block is never handed out while something that reads it lives, whatever went through
it. Thread-safe.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


class KeptBlocks:
    """int32 blocks kept to be used again: at most ``keep`` of a shape, and ``keep`` of any length.

    More are made and freed as before (:meth:`get`, :meth:`flat`).
    """

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._kept: dict[tuple[int, ...], list[np.ndarray]] = {}
        self._flat: list[np.ndarray] = []  # blocks of :meth:`flat`, of any length
        self._lock = threading.Lock()

    def get(self, shape: tuple[int, ...]) -> np.ndarray:
        """An int32 block of ``shape``, uninitialized: a free kept one, else a new one."""
        with self._lock:
            kept = self._kept.setdefault(shape, [])
            free = _free(kept)
            if free:
                return kept[free[0]]
            block = np.empty(shape, dtype=np.int32)
            if len(kept) < self.keep:
                kept.append(block)
            return block

    def flat(self, n: int) -> np.ndarray:
        """An int32 array of ``n`` elements, uninitialized: the start of a free kept block.

        For arrays whose length moves from one to the next: the smallest free block that
        holds ``n``, else a new one an eighth longer (kept in place of a smaller free one
        when ``keep`` are kept already).
        """
        with self._lock:
            kept = self._flat
            free = _free(kept)
            fits = [i for i in free if len(kept[i]) >= n]
            if fits:
                return kept[min(fits, key=lambda i: len(kept[i]))][:n]
            block = np.empty(n + n // 8, dtype=np.int32)
            if len(kept) < self.keep:
                kept.append(block)
            elif free:
                kept[min(free, key=lambda i: len(kept[i]))] = block  # a free one too small
            return block[:n]

    def flat_bytes(self, nbytes: int) -> np.ndarray:
        """:meth:`flat` as ``nbytes`` bytes (uint8), to be viewed as any dtype or read into."""
        return self.flat(-(-nbytes // 4)).view(np.uint8)[:nbytes]


def _free(kept: list[np.ndarray]) -> list[int]:
    """The indexes of the blocks of ``kept`` that nothing else holds (no view of them lives).

    A free block's holders are the list and getrefcount's argument: read by index, with
    no loop name bound to the block (``enumerate``'s reused tuple would hold one too).
    """
    return [i for i in range(len(kept)) if sys.getrefcount(kept[i]) == 2]
