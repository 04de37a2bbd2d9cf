"""A window of a shard's records, held a piece at a time (:mod:`overlord.sources.shard` reads it).

A *window* is ``shuffle.window_blocks`` blocks of a shard's records,
transformed, blank ones taken out and permuted: the unit the source's order
shuffles within. A loader tokenizes it a *piece* (consecutive records of the
window, about :data:`PIECE_BYTES`) at a time, so each piece's records are held
in arrays of their own (:class:`Piece`) and let go of once the piece is cut
into items: a window being cut holds what is left of it, not all of it. A
standby loader holds its pieces' text compressed (:class:`Packed`) until it
cuts them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from overlord.errors import SourceError

PIECE_BYTES = 256 << 10  # text tokenized at once: tens of ms of work at most
PACK_CODEC = "zstd"  # a standby's pieces, held compressed until cut
FIRST_PIECE_BYTES = 16 << 10  # a window's first piece: its first items come fast


class Piece(NamedTuple):
    """The records of one piece of a window, in arrays of their own."""

    texts: pa.Array  # large_string
    images: pa.Array | None = None  # large_binary per record: image-text sources only
    keys: pa.Array | None = None  # large_string per record: a tar's image members


class Packed(NamedTuple):
    """A piece held compressed (a standby's, until it is cut): its text's bytes in zstd."""

    records: int
    offsets: pa.Buffer  # the text's int64 offsets, as they were
    data: pa.Buffer  # the text's bytes, compressed
    size: int  # the text's bytes
    images: pa.Array | None = None
    keys: pa.Array | None = None

    @classmethod
    def of(cls, piece: Piece) -> Packed | Piece:
        """``piece`` compressed (a piece with nulls or an offset stays as it is)."""
        _, offsets, data = piece.texts.buffers()
        if piece.texts.null_count or piece.texts.offset or data is None:
            return piece
        packed = pa.compress(data, codec=PACK_CODEC, asbytes=False)
        return cls(len(piece.texts), offsets, packed, data.size, piece.images, piece.keys)

    def unpacked(self) -> Piece:
        """The piece's arrays, its text decompressed."""
        data = pa.decompress(self.data, self.size, codec=PACK_CODEC, asbytes=False)
        texts = pa.Array.from_buffers(pa.large_string(), self.records, [None, self.offsets, data])
        return Piece(texts, self.images, self.keys)


@dataclass
class Window:
    """The records of one window, in the source's order: transformed, not blank, permuted.

    Its records are held a piece (:attr:`cut`) at a time, each piece in arrays of
    its own, so that a loader lets go of a piece's text (and images) once it is
    cut (:meth:`release`): a window being cut holds what is left of it, not all
    of it.
    """

    epoch: int
    shard_pos: int
    file_index: int
    number: int
    rows: np.ndarray  # int64: the row of each record in its file
    offsets: np.ndarray  # int64, one more than records: where each record's bytes start
    cut: list[tuple[int, int]]  # its pieces, :func:`piece_bounds` of ``PIECE_BYTES``
    pieces: list[Piece | Packed | None]  # the arrays of each piece of ``cut``; None once released
    skipped: list[SourceError] = field(default_factory=list)
    records: int = 0  # records its blocks hold: good, empty and bad
    empty: int = 0  # blank texts: not samples
    has_images: bool = False  # an image-text source's window
    source: str = ""
    name: str = ""  # the file, for errors

    def __len__(self) -> int:
        return len(self.rows)

    def text_bytes(self, lo: int, hi: int) -> int:
        """Bytes of records ``[lo, hi)``: their text's, and their images'."""
        return int(self.offsets[hi] - self.offsets[lo])

    def arrays(self, lo: int, hi: int) -> Piece:
        """The arrays of records ``[lo, hi)``, from the pieces not released."""
        first = bisect.bisect_right(self.cut, (lo, len(self.rows) + 1)) - 1
        got: list[Piece] = []
        for k in range(max(first, 0), len(self.cut)):
            a, b = self.cut[k]
            if a >= hi:
                break
            held = self.pieces[k]
            if held is None:
                raise RuntimeError(
                    f"records {a}-{b} of window {self.number} of {self.name} were released"
                )
            piece = held.unpacked() if isinstance(held, Packed) else held
            s, e = max(lo, a) - a, min(hi, b) - a
            got.append(Piece(*(None if x is None else x.slice(s, e - s) for x in piece)))
        if len(got) == 1:
            return got[0]
        if not got:
            return Piece(EMPTY_TEXTS, *((EMPTY_BINARY, EMPTY_TEXTS) if self.has_images else ()))
        return Piece(*(None if x[0] is None else pa.concat_arrays(list(x)) for x in zip(*got)))

    def pack(self) -> None:
        """Hold its pieces' text compressed until each is cut (a standby's window)."""
        self.pieces = [Packed.of(p) if isinstance(p, Piece) else p for p in self.pieces]

    def release(self, lo: int, hi: int) -> None:
        """Let go of the pieces wholly inside records ``[lo, hi)``."""
        k = bisect.bisect_left(self.cut, (lo, 0))
        while k < len(self.cut) and self.cut[k][1] <= hi:
            self.pieces[k] = None
            k += 1

    @property
    def released(self) -> bool:
        """Whether every piece was let go (the window holds no records' bytes)."""
        return all(p is None for p in self.pieces)


EMPTY_TEXTS = pa.array([], pa.large_string())
EMPTY_BINARY = pa.array([], pa.large_binary())


def piece_bounds(offsets: np.ndarray, piece_bytes: int) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of records (byte ``offsets``) holding about ``piece_bytes`` each.

    The first pieces are smaller (from ``FIRST_PIECE_BYTES``, doubling): a window's
    first items are ready soon after it is read.

    >>> piece_bounds(np.arange(0, 100_001, 1000), 64 << 10)
    [(0, 17), (17, 50), (50, 100)]
    """
    n = len(offsets) - 1
    if n <= 0:
        return []
    offs = offsets - offsets[0]
    size, at, targets = min(FIRST_PIECE_BYTES, piece_bytes), 0, []
    while at + size < offs[-1]:
        at += size
        targets.append(at)
        size = min(2 * size, piece_bytes)
    cuts = np.searchsorted(offs, np.asarray(targets, dtype=np.int64))
    bounds = np.unique(np.concatenate(([0], np.clip(cuts, 1, n), [n])))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
