"""Pre-tokenized shards: flat token arrays (``format: tokens``) and Megatron's indexed datasets.

Large pretraining runs tokenize once and train from token files. Two layouts are read:

- **tokens**: one flat 1-D array of ids per file, a ``.npy`` file (its header gives the dtype
  and where the ids start) or a raw file of ``dtype`` ids (``uint16``, ``uint32``, ``int32``;
  ``.bin`` by custom). A document ends at the source's ``eos_id``, which belongs to the
  document it ends; a trailing run without it is the file's last document. A document's row is
  its place in the file, counted from 0.
- **megatron**: the pair Megatron-LM's ``IndexedDatasetBuilder`` writes. The ``.idx`` file:
  the 9 bytes ``MMIDIDX`` and two zero bytes, version 1 (``<Q``), a dtype code (``<B``: 1 uint8,
  2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6 and 7 are floats, not ids), the sequence
  count and the document-index count (``<Q`` each), then every sequence's length (int32), its
  byte offset in ``.bin`` (int64), and the document index (int64): document ``d`` is sequences
  ``[doc[d], doc[d+1])``, in order. The source's path pattern matches the ``.idx`` files; the
  ``.bin`` beside each holds the ids. A document's row is ``d``.

The order rule is the text sources' (:mod:`overlord.sources.shard`), with a token file's bytes
in place of a JSONL file's: block ``k`` holds the documents that *start* in bytes
``[k*B, (k+1)*B)`` of the ids (of ``.bin``, for megatron), ``B`` being
``shuffle.block_bytes``. A block is read by ranges: the ids from its first document's start
to its last document's end, never the file; where a flat file's documents start comes from
one pass that counts each block's eos ids (one integer per block, kept for the next epoch).
So a loader's memory follows the blocks it holds, not the file's size.

A block's records are its documents' ids as int32 bytes (one Arrow binary value each), which
:class:`TokenIds` reads back as ids where a text source is tokenized. A document that is its
eos alone is *empty* (a text of no token, in the text sources' words): not a sample, counted.
"""

from __future__ import annotations

import io
import os
import struct
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from overlord.blocks import KeptBlocks
from overlord.errors import SourceError
from overlord.plan.spec import Format, SourceSpec, TokenDtype
from overlord.sources.files import Shard
from overlord.sources.records import RecordBlock, ShardReader
from overlord.sources.remote import file_size, is_url

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    8: np.uint16,
}
_MEGATRON_FLOATS = {6: "float64", 7: "float32"}
_SCAN_TOKENS = 4 << 20  # ids counted at once by the eos pass
_FIRST_REST = 4096  # ids read first of a document's rest past its block (then twice as many)
# reads of ids kept to be used again from this size (shorter ones come from the heap)
KEPT_READ_BYTES = 128 << 10
# blocks of ids read (a window's blocks are read before it is made, then let go), and
# the masks of their eos ids (one at a time per reading thread)
_READS = KeptBlocks(keep=16)
_MASKS = KeptBlocks(keep=2)


class _Ranges:
    """Byte ranges of one file: ``os.pread`` on a local file, seek and read on a URL.

    Reading by ranges keeps nothing of the file mapped or cached in this process: what a
    block needs is read into a buffer of its own and freed with it. The ids of a local
    file (:meth:`read_ids`) are read into kept blocks, used again once nothing holds them
    (:class:`~overlord.blocks.KeptBlocks`): a window's reads then do not fault in fresh
    pages in a process whose allocator hands large blocks back.
    """

    def __init__(self, source: str, shard: Shard):
        self.source, self.name = source, shard.name
        if is_url(shard.url):
            self._file: Any = shard.open(source)
            self._fd = -1
            self.size = file_size(self._file, shard.url)
        else:
            self._file = None
            self._fd = os.open(shard.url, os.O_RDONLY)
            self.size = os.fstat(self._fd).st_size

    def read(self, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)``; a file that ends before ``hi`` is a :class:`SourceError`."""
        if hi <= lo:
            return b""
        if self._fd >= 0:
            parts, at = [], lo
            while at < hi:
                got = os.pread(self._fd, min(hi - at, 1 << 30), at)
                if not got:
                    break
                parts.append(got)
                at += len(got)
            data = b"".join(parts) if len(parts) != 1 else parts[0]
        else:
            self._file.seek(lo)
            data = self._file.read(hi - lo)
        if len(data) != hi - lo:
            raise self._truncated(lo + len(data), hi)
        return data

    def read_ids(self, lo: int, hi: int) -> np.ndarray:
        """Bytes ``[lo, hi)`` as uint8, in a kept block (a local file); as :meth:`read`."""
        if self._fd < 0 or hi - lo < KEPT_READ_BYTES:  # a short read: the heap's, as bytes
            return np.frombuffer(self.read(lo, hi), np.uint8)
        out = _READS.flat_bytes(hi - lo)
        at = lo
        while at < hi:
            got = os.preadv(self._fd, [out[at - lo :].data], at)
            if not got:
                raise self._truncated(at, hi)
            at += got
        return out

    def _truncated(self, end: int, hi: int) -> SourceError:
        return SourceError(
            self.source, self.name, None, f"the file ends at byte {end}, "
            f"before byte {hi} that its index names: it is truncated"
        )  # fmt: skip

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        elif self._file is not None:
            self._file.close()
            self._file = None


class BlockIds(NamedTuple):
    """A block's documents as read: ranges of its ids in the file's dtype, not copied yet.

    Document ``i`` is ids ``[starts[i], ends[i])`` of ``data`` and ``rest`` end to end
    (``rest``: the ids of the block's last document past the block, if it runs on). The
    ranges are in order and do not overlap; ids outside every range (an eos alone, a gap in
    a Megatron ``.bin``) belong to no document. :func:`_records` makes the block's Arrow
    records of them; :mod:`overlord.sources.token_window` gathers a window's pieces from
    them directly.
    """

    number: int  # the block's place in the file
    rows: np.ndarray  # int64: each document's row
    data: np.ndarray  # the block's ids, from its first document's start
    rest: np.ndarray  # the last document's ids past ``data`` (often none)
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64


def _no_ids(number: int, dtype: np.dtype[Any]) -> BlockIds:
    none = np.zeros(0, np.int64)
    return BlockIds(number, none, np.zeros(0, dtype), np.zeros(0, dtype), none, none)


def _fits_int32(number: int, parts: tuple[np.ndarray, ...]) -> None:
    """Raise :class:`_TooLarge` for an id that int32 cannot hold (in a uint32 or int64 file)."""
    for part in parts:
        wide = part.dtype.itemsize > 4 or part.dtype == np.uint32
        if wide and len(part) and part.max() > 2**31 - 1:
            raise _TooLarge(f"an id above {2**31 - 1} in block {number}: ids are int32")


def _records(block: BlockIds) -> RecordBlock:
    """The block's documents as records: each one's ids as int32 bytes (one Arrow value).

    Its ids are widened to int32 in one copy. Every block holds int32 ids whatever the
    file's dtype, so that a window's records read the same way whichever file they came
    from.
    """
    number, rows, starts, ends = block.number, block.rows, block.starts, block.ends
    parts = (block.data, block.rest) if len(block.rest) else (block.data,)
    if not len(rows):
        return RecordBlock(number, rows, pa.array([], pa.large_binary()))
    lengths = ends - starts
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(lengths * 4, out=offsets[1:])
    covered = len(starts) and starts[0] == 0 and np.array_equal(starts[1:], ends[:-1])
    size = int(ends[-1]) if covered else sum(len(p) for p in parts)
    ids = np.empty(size, np.int32)
    at = 0
    for part in parts:
        n = min(len(part), size - at)
        ids[at : at + n] = part[:n]
        at += n
    if not covered:  # mark each range's ids: +1 where a range starts, -1 where it ends
        mark = np.zeros(len(ids) + 1, np.int64)
        np.add.at(mark, starts, 1)
        np.add.at(mark, ends, -1)
        ids = ids[np.cumsum(mark[:-1]) > 0]
    texts = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(starts), [None, pa.py_buffer(offsets), pa.py_buffer(ids)]
    )
    return RecordBlock(number, rows.astype(np.int64), texts)


def joined(parts: list[np.ndarray], dtype: type | np.dtype[Any]) -> np.ndarray:
    """``parts`` end to end as ``dtype`` (one part as it is, where it is of ``dtype``)."""
    if len(parts) == 1:
        return parts[0].astype(dtype, copy=False)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


class _TooLarge(ValueError):
    """An id that a uint32 or int64 file holds and int32 cannot."""


class FlatTokenFile(ShardReader):
    """A flat array of ids, read by blocks; documents end at ``eos_id``."""

    n_blocks: int  # known from the file's size

    def __init__(
        self,
        source: str,
        shard: Shard,
        dtype: TokenDtype | None,
        eos_id: int,
        block_bytes: int,
        cache: dict[Any, Any],
    ):
        self.source, self.shard, self.name, self.eos = source, shard, shard.name, eos_id
        self.file = _Ranges(source, shard)
        self.dtype, self.start = self._header(dtype)
        itemsize = self.dtype.itemsize
        if (self.file.size - self.start) % itemsize:
            raise self._error(
                f"{self.file.size - self.start} bytes of ids are not a whole number of "
                f"{self.dtype.name} ids: the file is truncated, or its dtype is not "
                f"{self.dtype.name}"
            )
        self.n = (self.file.size - self.start) // itemsize
        self.per_block = max(1, block_bytes // itemsize)
        self.blocks_in_file = -(-self.n // self.per_block)
        self.n_blocks = self.blocks_in_file
        self._cache = cache
        self._key = ("tokens", shard.url, self.file.size, self.dtype.str, eos_id, self.per_block)

    @property
    def eos_before(self) -> np.ndarray:
        """How many eos ids lie before each block's first id (one pass, on first use, kept)."""
        if self._key not in self._cache:
            self._cache[self._key] = self._eos_before_blocks()
        counts: np.ndarray = self._cache[self._key]
        return counts

    def _error(self, message: str) -> SourceError:
        return SourceError(self.source, self.name, None, message)

    def _header(self, dtype: TokenDtype | None) -> tuple[np.dtype[Any], int]:
        """The ids' dtype and the byte they start at: from a ``.npy`` header, else the plan."""
        if self.name.endswith(".npy"):
            head = self.file.read(0, min(self.file.size, 4096))
            try:
                f = io.BytesIO(head)
                version = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, fortran, found = read(f)
            except (ValueError, EOFError) as e:
                raise self._error(f"not a .npy file ({e})") from None
            if len(shape) != 1:
                raise self._error(f"a token file is 1-D, this .npy file has shape {shape}")
            if found.name not in {d.value for d in TokenDtype}:
                raise self._error(
                    f"its ids are {found.name}: expected one of "
                    + ", ".join(d.value for d in TokenDtype)
                )
            if dtype is not None and found.name != dtype.value:
                raise self._error(
                    f"the plan's dtype is {dtype.value} but the .npy header says {found.name}"
                )
            return found, f.tell()  # a big-endian file reads as such, then converts
        if dtype is None:
            raise self._error("a raw token file needs the source's dtype (uint16|uint32|int32)")
        return np.dtype(dtype.value), 0

    def ids(self, lo: int, hi: int, kept: bool = True) -> np.ndarray:
        """Ids ``[lo, hi)`` of the file (clipped to its end); ``kept``: in a kept block."""
        size = self.dtype.itemsize
        lo_byte, hi_byte = self.start + lo * size, self.start + min(hi, self.n) * size
        if not kept:  # a read once (the eos pass over the file): no block kept for it
            return np.frombuffer(self.file.read(lo_byte, hi_byte), self.dtype)
        return self.file.read_ids(lo_byte, hi_byte).view(self.dtype)

    def _eos_before_blocks(self) -> np.ndarray:
        """One pass over the file: how many eos ids lie before each block, and in all."""
        counts = np.zeros(self.blocks_in_file + 1, np.int64)
        step = max(self.per_block, (_SCAN_TOKENS // self.per_block) * self.per_block)
        for lo in range(0, self.n, step):
            ids = self.ids(lo, lo + step, kept=False)
            hits = np.flatnonzero(ids == self.eos) + lo
            np.add.at(counts, hits // self.per_block + 1, 1)
        return np.cumsum(counts)

    def through_eos(self, start: int) -> np.ndarray:
        """The ids from ``start`` through the first eos at or after it (or to the file's end)."""
        return joined(self._rest(start), self.dtype)

    def _rest(self, start: int) -> list[np.ndarray]:
        """:meth:`through_eos` as the chunks read, each twice the last: most rests are short.

        A block's last document is read on past the block: its chunks are the block's
        ``rest`` (one array; joined where there are several).
        """
        chunks, at = [], start
        step, most = _FIRST_REST, max(self.per_block, 1 << 16)
        while at < self.n:
            chunk = self.ids(at, at + step)
            hit = np.flatnonzero(chunk == self.eos)
            if len(hit):
                chunks.append(chunk[: int(hit[0]) + 1])
                break
            chunks.append(chunk)
            at += step
            step = min(2 * step, most)
        return chunks

    def end_of(self, start: int) -> int:
        """One past the eos that ends the document starting at ``start`` (or the file's end)."""
        return start + len(self.through_eos(start))

    def block(self, k: int) -> RecordBlock:
        """The documents that start in block ``k``, with their rows (places in the file)."""
        return _records(self.block_ids(k))

    def block_ids(self, k: int) -> BlockIds:
        """Block ``k``'s documents as ranges of its ids (see :meth:`block`).

        The block's ids are read once: a document starts after each eos, so the only eos
        past the block's last start is its last id, else the last document runs on past the
        block and only its rest is read.
        """
        lo, hi = k * self.per_block, min(self.n, (k + 1) * self.per_block)
        before = max(lo - 1, 0)
        head = self.ids(before, hi)
        # a document starts after each eos, and at 0
        scan = head[: hi - 1 - before]
        hit = np.equal(scan, self.eos, out=_MASKS.flat_bytes(len(scan)).view(np.bool_))
        eos = np.flatnonzero(hit) + before
        del hit  # its block goes back
        starts = eos + 1
        starts = starts[starts >= lo]
        if lo == 0:
            starts = np.concatenate(([0], starts))
        if not len(starts):
            return _no_ids(k, self.dtype)
        rows = self.eos_before[k] + np.searchsorted(eos[eos >= lo], starts - 1, side="right")
        data = head[int(starts[0]) - before :]  # every document starts in it
        rest = np.zeros(0, self.dtype)
        if not (len(head) and head[-1] == self.eos and hi - 1 >= starts[-1]):
            chunks = self._rest(hi)  # and the last document's rest
            rest = joined(chunks, self.dtype)
        ends = np.append(starts[1:], int(starts[0]) + len(data) + len(rest))
        rel_start, rel_end = starts - starts[0], ends - starts[0]
        alone = (rel_end - rel_start == 1) & (data[rel_start] == self.eos)
        rel_end = np.where(alone, rel_start, rel_end)  # an eos alone: an empty document
        try:
            _fits_int32(k, (data, rest))
        except _TooLarge as e:
            raise self._error(str(e)) from None
        return BlockIds(k, rows, data, rest, rel_start, rel_end)

    def close(self) -> None:
        """Close the file of ids."""
        self.file.close()


class MegatronFile(ShardReader):
    """An ``.idx`` + ``.bin`` pair of Megatron-LM's indexed dataset, read by blocks of ``.bin``."""

    n_blocks: int  # known from the index

    def __init__(self, source: str, shard: Shard, block_bytes: int):
        self.source, self.shard, self.name = source, shard, shard.name
        if not shard.name.endswith(".idx"):
            raise self._error("format megatron reads .idx files (the path pattern matches them)")
        index = _Ranges(source, shard)
        try:
            self._read_index(index)
        finally:
            index.close()
        bin_shard = Shard(shard.url[:-4] + ".bin", shard.name[:-4] + ".bin",
                          shard.storage_options, shard.retries)  # fmt: skip
        try:
            self.file = _Ranges(source, bin_shard)
        except FileNotFoundError:
            raise self._error(f"its .bin file is missing: {bin_shard.name}") from None
        itemsize = self.dtype.itemsize
        if len(self.sizes):
            needed = int(self.pointers[-1]) + int(self.sizes[-1]) * itemsize
            if self.file.size < needed:
                raise self._error(
                    f"{bin_shard.name} has {self.file.size} bytes, its index needs {needed}: "
                    "the .bin file is truncated"
                )
        self.block_bytes = block_bytes
        # the block the last document starts in is the last block
        self.n_blocks = int(self.doc_start[-1]) // block_bytes + 1 if len(self.doc_start) else 0

    def _error(self, message: str) -> SourceError:
        return SourceError(self.source, self.name, None, message)

    def _read_index(self, index: _Ranges) -> None:
        head = index.read(0, min(index.size, 34))
        if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
            raise self._error("not a Megatron index: it does not start with MMIDIDX")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1:
            raise self._error(f"Megatron index version {version}: expected 1")
        if code in _MEGATRON_FLOATS:
            raise self._error(f"its dtype is {_MEGATRON_FLOATS[code]}: ids are integers")
        if code not in MEGATRON_DTYPES:
            raise self._error(f"unknown Megatron dtype code {code}")
        self.dtype = np.dtype(MEGATRON_DTYPES[code])
        end = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if index.size < end:
            raise self._error(f"the index has {index.size} bytes, its header needs {end}")
        body = index.read(34, end)
        self.sizes = np.frombuffer(body, np.int32, n_seq, 0)
        self.pointers = np.frombuffer(body, np.int64, n_seq, n_seq * 4)
        docs = np.frombuffer(body, np.int64, n_doc, n_seq * 12)
        if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            raise self._error("its document index does not cover its sequences in order")
        # each document's byte range in .bin: from its first sequence to its last one's end;
        # a document of no sequence sits, empty, where the next one starts
        seq_end = self.pointers + self.sizes.astype(np.int64) * self.dtype.itemsize
        total = int(seq_end[-1]) if n_seq else 0
        first, after = docs[:-1], docs[1:]
        padded = np.append(self.pointers, total)
        self.doc_start = padded[first].astype(np.int64)
        ends = np.append(seq_end, total)
        self.doc_end = np.where(after > first, ends[np.maximum(after - 1, 0)], self.doc_start)

    def block(self, k: int) -> RecordBlock:
        """The documents whose first byte lies in block ``k`` of ``.bin``, in file order."""
        return _records(self.block_ids(k))

    def block_ids(self, k: int) -> BlockIds:
        """Block ``k``'s documents as ranges of its ids (see :meth:`block`)."""
        lo, hi = k * self.block_bytes, (k + 1) * self.block_bytes
        d0, d1 = np.searchsorted(self.doc_start, [lo, hi], side="left")
        if d0 == d1:
            return _no_ids(k, self.dtype)
        rows = np.arange(d0, d1, dtype=np.int64)
        first, end = int(self.doc_start[d0]), int(self.doc_end[d0:d1].max())
        size = self.dtype.itemsize
        data = self.file.read_ids(first, end)[: (end - first) // size * size].view(self.dtype)
        starts = (self.doc_start[d0:d1] - first) // size
        ends = (self.doc_end[d0:d1] - first) // size
        try:
            _fits_int32(k, (data,))
        except _TooLarge as e:
            raise self._error(str(e)) from None
        return BlockIds(k, rows, data, np.zeros(0, self.dtype), starts, ends)

    def close(self) -> None:
        """Close the file of ids."""
        self.file.close()


TokenReader = FlatTokenFile | MegatronFile  # a pre-tokenized shard's reader


def open_token_shard(
    spec: SourceSpec, shard: Shard, block_bytes: int, cache: dict[Any, Any]
) -> TokenReader:
    """The reader of one pre-tokenized shard (``spec.format`` tokens or megatron)."""
    if spec.format is Format.MEGATRON:
        return MegatronFile(spec.name, shard, block_bytes)
    assert spec.eos_id is not None  # checked by plan validation
    return FlatTokenFile(spec.name, shard, spec.dtype, spec.eos_id, block_bytes, cache)


class TokenIds:
    """The "tokenizer" of a pre-tokenized source: its records are int32 ids already.

    >>> raw = pa.array([np.array([5, 6, 2], np.int32).tobytes(), b""], pa.large_binary())
    >>> tokens, offsets = TokenIds(vocab_size=100).encode(raw)
    >>> tokens.tolist(), offsets.tolist()
    ([5, 6, 2], [0, 3, 3])
    """

    def __init__(self, vocab_size: int, pad_id: int = 0):
        self.vocab_size, self.pad_id = vocab_size, pad_id

    def encode(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Records' ids (int32, back to back) and offsets (int64, one more than records)."""
        n = len(texts)
        if n == 0:
            return np.zeros(0, np.int32), np.zeros(1, np.int64)
        _, off_buf, data_buf = texts.buffers()
        offs = np.frombuffer(off_buf, np.int64)[texts.offset : texts.offset + n + 1]
        if data_buf is None:
            return np.zeros(0, np.int32), np.zeros(n + 1, np.int64)
        # a view of the piece's buffer (it keeps the buffer alive), not a copy of every id
        ids = np.frombuffer(data_buf, np.uint8)[offs[0] : offs[-1]].view(np.int32)
        return ids, (offs - offs[0]) // 4
