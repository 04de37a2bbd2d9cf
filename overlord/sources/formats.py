"""Reading a shard's text records block by block: JSONL (plain, .gz, .zst) and Parquet.

A shard is never read whole. Block ``k`` of a JSONL file holds the lines that
*start* in bytes ``[k*B, (k+1)*B)`` of the file (of its decompressed bytes, for
``.gz`` and ``.zst``), ``B`` being ``shuffle.block_bytes``; a file of ``S``
bytes has ``ceil(S / B)`` blocks, and a line longer than ``B`` leaves the
blocks it spans empty. Block ``k`` of a Parquet file is its row group ``k``.
A plain JSONL file or a Parquet file can be read at any block
(:meth:`ShardReader.block`); a compressed file only in order
(:meth:`ShardReader.blocks`), as a stream.

Where a plain JSONL file's blocks start, and the row each starts at, come from
one pass over the file that counts its lines (a few MB at a time; the index
is a few integers per block and is kept for the next epoch).

Rows are 0-based: the line of a JSONL file (blank lines included in the
count, though they hold no record), the row of a Parquet file. Arrow's
vectorized JSON reader parses a block; when a block has bad records, a slower
per-line pass finds each one so that its error names the exact row.

A compressed JSONL file that ends before its compressed stream does (a
truncated ``.gz`` or ``.zst``, e.g. a copy cut short) is a bad record at the
cut: under ``on_error: skip`` every complete line before the cut is read, and
the cut counts as one skipped record (its row is the first line not complete;
how many records the lost part held cannot be known); under ``fail`` it raises
:class:`SourceError` naming the file, when the stream reaches the cut. gzip is
decoded with ``zlib``, which hands out every byte before the cut; Arrow's zstd
decoder hands out whole pieces (1 MiB with Arrow 26), so the records of the
piece the cut falls in are lost with it too.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from overlord.errors import SourceError
from overlord.plan.spec import Format
from overlord.sources.files import Shard
from overlord.sources.remote import file_size

_CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_SPACE = np.array([9, 11, 12, 13, 32], dtype=np.uint8)  # what bytes.strip() removes, but "\n"
_READ = 1 << 20  # compressed bytes read at once
_SCAN = 8 << 20  # bytes counted at once by the line index
_ZSTD_PIECE = 1 << 20  # bytes asked of Arrow's zstd decoder at once
_INFLATE = 1 << 20  # decompressed bytes a gzip input yields at once


@dataclass
class RecordBlock:
    """The good records of one block, in file order, and its bad ones."""

    number: int  # the block's place in the file
    rows: np.ndarray  # int64, 0-based row of each record
    texts: pa.Array  # large_string, one per record
    skipped: list[SourceError] = field(default_factory=list)  # bad records (on_error=skip)
    # image-text records (overlord.sources.webdataset): encoded images, and a tar's members
    images: pa.Array | None = None  # large_binary, one per record
    keys: pa.Array | None = None  # large_string: each record's image member (tars only)

    @property
    def records(self) -> int:
        """Records of the block: good and bad."""
        return len(self.rows) + len(self.skipped)


def _empty_block(number: int) -> RecordBlock:
    return RecordBlock(number, np.zeros(0, np.int64), pa.array([], pa.large_string()))


class ShardReader:
    """One open shard. ``n_blocks`` is None for a compressed file (known only at its end)."""

    source: str
    shard: Shard
    n_blocks: int | None = None

    def block(self, k: int) -> RecordBlock:
        """Block ``k`` (a file that can seek)."""
        raise TypeError(f"{type(self).__name__} reads its blocks in order only")

    def blocks(self) -> Iterator[RecordBlock]:
        """Every block, in file order."""
        assert self.n_blocks is not None
        for k in range(self.n_blocks):
            yield self.block(k)

    def close(self) -> None:
        """Close the file."""


# ---- JSONL -------------------------------------------------------------------------------


def _line_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive, without the newline) of every line."""
    buf = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    ends = nl
    if len(buf) and buf[-1] != 10:
        ends = np.append(nl, len(buf))
    starts = np.concatenate(([0], nl + 1))[: len(ends)]
    return starts.astype(np.int64), ends.astype(np.int64)


def parse_lines(
    source: str,
    name: str,
    data: bytes,
    text_field: str,
    skip: bool,
    row0: int,
    number: int,
    max_bytes: int | None = None,
) -> RecordBlock:
    """The records of whole JSONL lines; ``row0`` is the row of the first line.

    A line longer than ``max_bytes`` is a bad record (its row named), not parsed.
    """
    starts, ends = _line_bounds(data)
    too_long: list[SourceError] = []
    if max_bytes is not None and len(data) > max_bytes:
        long = np.flatnonzero(ends - starts > max_bytes)
        if len(long):
            too_long = [_too_long(source, name, row0 + int(i), int(ends[i] - starts[i]),
                                  max_bytes, skip) for i in long]  # fmt: skip
            keep = np.ones(len(data), dtype=bool)
            for i in long.tolist():  # the line goes, its newline stays: rows keep their numbers
                keep[starts[i] : ends[i]] = False
            data = np.frombuffer(data, np.uint8)[keep].tobytes()
            starts, ends = _line_bounds(data)
    block = _parse(source, name, data, text_field, skip, row0, number, starts, ends)
    block.skipped = sorted([*block.skipped, *too_long], key=lambda e: e.row or 0)
    return block


def _too_long(source: str, name: str, row: int, size: int, limit: int, skip: bool) -> SourceError:
    """The error of a record larger than ``loading.max_record_bytes`` (raised unless ``skip``)."""
    err = SourceError(
        source, name, row, f"a record of {size} bytes, more than loading.max_record_bytes "
        f"({limit}): not read"
    )  # fmt: skip
    if not skip:
        raise err
    return err


def _parse(
    source: str,
    name: str,
    data: bytes,
    text_field: str,
    skip: bool,
    row0: int,
    number: int,
    starts: np.ndarray,
    ends: np.ndarray,
) -> RecordBlock:
    """The records of whole JSONL lines whose bounds are ``starts`` and ``ends``."""
    # a line holding only "\r", tabs or spaces is blank too; Arrow skips those, so do we.
    # Only a line that starts with whitespace can be one: check just those.
    lengths = ends - starts
    nonblank = np.flatnonzero(lengths > 0)
    buf = np.frombuffer(data, dtype=np.uint8)
    maybe = nonblank[np.isin(buf[starts[nonblank]], _SPACE)]
    blank = [i for i in maybe.tolist() if not data[starts[i] : ends[i]].strip()]
    if blank:
        nonblank = np.setdiff1d(nonblank, blank)
    if len(nonblank) == 0:
        return _empty_block(number)
    schema = pa.schema([(text_field, pa.large_string())])
    opts = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        table = pa_json.read_json(io.BytesIO(data), parse_options=opts)
        col = table.column(text_field).combine_chunks()
        col.validate(full=True)  # Arrow's JSON reader lets invalid UTF-8 through
        if len(col) == len(nonblank) and col.null_count == 0:
            return RecordBlock(number, nonblank + row0, col)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    rows: list[int] = []
    texts: list[str] = []
    skipped: list[SourceError] = []
    for i in nonblank.tolist():
        reason = None
        try:
            record = json.loads(data[starts[i] : ends[i]])
        except (ValueError, UnicodeDecodeError) as e:
            reason = f"malformed JSON ({e})"
        except RecursionError:  # a record's own fault, like any other: on_error decides
            reason = "malformed JSON (nested too deeply to parse)"
        else:
            if not isinstance(record, dict):
                reason = f"expected a JSON object, found {type(record).__name__}"
            elif text_field not in record:
                keys = sorted(record)[:8]
                reason = f"no field '{text_field}' (the record has {keys})"
            elif not isinstance(record[text_field], str):
                kind = type(record[text_field]).__name__
                reason = f"field '{text_field}' is {kind}, expected a string"
        if reason is None:
            rows.append(row0 + i)
            texts.append(record[text_field])
            continue
        err = SourceError(source, name, row0 + i, reason)
        if not skip:
            raise err
        skipped.append(err)
    return RecordBlock(
        number, np.asarray(rows, dtype=np.int64), pa.array(texts, pa.large_string()), skipped
    )


def line_index(f: BinaryIO, size: int, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each block of a plain JSONL file starts, and its first row; the file's end last.

    Block ``k`` starts at the first line start at or after ``k * B``: one
    past the first newline at or after ``k * B - 1``. Its first row is the
    number of newlines before that start.
    """
    n = -(-size // block_bytes)
    starts = np.full(n + 1, size, np.int64)
    rows = np.zeros(n + 1, np.int64)
    starts[0] = 0
    k, seen, pos = 1, 0, 0
    f.seek(0)
    while k < n:
        chunk = f.read(_SCAN)
        if not chunk:
            break
        nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + pos
        pos += len(chunk)
        # thresholds that fall before this chunk's end; their newline is here, or later
        hi = min(n, (pos + 1) // block_bytes + 1)
        ks = np.arange(k, max(k, hi))
        j = np.searchsorted(nl, ks * block_bytes - 1)
        found = int(np.count_nonzero(j < len(nl)))  # a prefix: j grows with the threshold
        starts[k : k + found] = nl[j[:found]] + 1
        rows[k : k + found] = seen + j[:found] + 1
        k += found
        seen += len(nl)
    rows[k:] = seen
    return starts, rows


class _PlainJsonl(ShardReader):
    def __init__(
        self,
        source: str,
        shard: Shard,
        text_field: str,
        block_bytes: int,
        skip: bool,
        cache: dict[Any, Any],
        max_bytes: int | None = None,
    ):
        self.source, self.shard, self.text_field, self.skip = source, shard, text_field, skip
        self.block_bytes, self.max_bytes = block_bytes, max_bytes
        self._f = shard.open(source)
        size = file_size(self._f, shard.url)
        key = (shard.url, int(size), block_bytes)
        if key not in cache:
            cache[key] = line_index(self._f, int(size), block_bytes)
        self._starts, self._rows = cache[key]
        self.n_blocks = len(self._starts) - 1

    def block(self, k: int) -> RecordBlock:
        """The lines that start in block ``k``; one too long is named, never read whole.

        Every line of the block but its last ends before the block's nominal end
        (the next line starts there), so a block longer than ``block_bytes`` plus
        ``max_bytes`` ends with a line longer than ``max_bytes``: only the lines
        before it are read.
        """
        lo, hi = int(self._starts[k]), int(self._starts[k + 1])
        if lo == hi:
            return _empty_block(k)
        row0 = int(self._rows[k])
        M, long_at = self.max_bytes, None
        if M is not None and hi - lo > self.block_bytes + M:
            long_at, hi = hi, max(lo, min(hi, (k + 1) * self.block_bytes))
        data = self._read(lo, hi)
        if long_at is not None:
            data = data[: data.rfind(b"\n") + 1]  # the complete lines before the long one
        block = parse_lines(
            self.source, self.shard.name, data, self.text_field, self.skip, row0, k, M
        )
        if long_at is not None and M is not None:
            row = row0 + data.count(b"\n")
            size = long_at - lo - len(data)  # the line, and its newline if it has one
            size -= self._read(long_at - 1, long_at) == b"\n"
            block.skipped.append(_too_long(self.source, self.shard.name, row, size, M, self.skip))
        return block

    def _read(self, lo: int, hi: int) -> bytes:
        self._f.seek(lo)
        data: bytes = self._f.read(hi - lo)
        if len(data) != hi - lo:
            raise OSError(f"the file is shorter than when it was indexed ({lo + len(data)} bytes)")
        return data

    def close(self) -> None:
        self._f.close()


class _Truncated:
    """Whether a decompressed stream ended before its compressed stream did."""

    cut = False


def _gunzip(f: BinaryIO, state: _Truncated) -> Iterator[bytes]:
    """Every decompressed byte of a gzip file (all its members), a piece at a time."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    started = False  # the current member has had input
    try:
        while raw := f.read(_READ):
            while raw:
                if not started:
                    if not raw.strip(b"\0"):  # trailing zero padding, as gzip tolerates
                        break
                    started = True
                # at most a piece at a time: a small input may inflate a thousandfold
                out = d.decompress(raw, _INFLATE)
                if out:
                    yield out
                if d.eof:
                    raw = d.unused_data
                    d, started = zlib.decompressobj(16 + zlib.MAX_WBITS), False
                else:
                    raw = d.unconsumed_tail  # what the cap left of this input, else nothing
        if started and not d.eof:
            if tail := d.flush():
                yield tail
            state.cut = True
    except zlib.error as e:
        raise OSError(f"corrupt gzip data: {e}") from None


def _unzstd(f: BinaryIO, state: _Truncated) -> Iterator[bytes]:
    """Every byte Arrow can decode of a zstd file, a piece at a time."""
    stream = pa.CompressedInputStream(pa.PythonFile(f, mode="r"), "zstd")
    try:
        while piece := stream.read(_ZSTD_PIECE):
            yield piece
    except OSError as e:
        if "truncated" not in str(e).lower():
            raise
        state.cut = True


def _pass_line(pieces: Iterator[bytes]) -> tuple[int, bytes, bool]:
    """Pass over the rest of a line without keeping it.

    Returns its bytes' count, what follows its newline, and whether the stream ended
    first (a last line without a newline).
    """
    passed = 0
    for piece in pieces:
        at = piece.find(b"\n")
        if at >= 0:
            return passed + at, piece[at + 1 :], False
        passed += len(piece)
    return passed, b"", True


class _CompressedJsonl(ShardReader):
    """A compressed JSONL file, cut into blocks as it is decompressed."""

    def __init__(
        self,
        source: str,
        shard: Shard,
        codec: str,
        text_field: str,
        block_bytes: int,
        skip: bool,
        max_bytes: int | None = None,
    ):
        self.source, self.shard, self.text_field, self.skip = source, shard, text_field, skip
        self.codec, self.block_bytes, self.max_bytes = codec, block_bytes, max_bytes
        self._f = shard.open(source)

    def blocks(self) -> Iterator[RecordBlock]:
        B, M, state = self.block_bytes, self.max_bytes, _Truncated()
        pieces = (_gunzip if self.codec == "gzip" else _unzstd)(self._f, state)
        buf = bytearray()
        at = 0  # decompressed offset of buf[0]: a line start
        tail = 0  # where the last line of buf starts (one past its last newline)
        row, k, eof = 0, 0, False
        while True:
            if at >= (k + 1) * B:  # a long line spans block k: no line starts in it
                yield _empty_block(k)
                k += 1
                continue
            # block k ends one past the first newline at or after (k + 1) * B - 1
            cut, long = -1, False
            while not eof:
                cut = buf.find(b"\n", max(0, (k + 1) * B - 1 - at))
                if cut >= 0:
                    break
                if M is not None and len(buf) - tail > M:
                    long = True  # block k's last line is too long: it is passed over
                    break
                piece = next(pieces, None)
                if piece is None:
                    eof = True
                else:
                    last = piece.rfind(b"\n")
                    if last >= 0:
                        tail = len(buf) + last + 1
                    buf += piece
            if long and M is not None:
                data = bytes(buf[:tail])  # the complete lines before the long one
                block = parse_lines(
                    self.source, self.shard.name, data, self.text_field, self.skip, row, k, M
                )
                row += data.count(b"\n")
                passed, rest, ended = _pass_line(pieces)
                size = len(buf) - tail + passed
                block.skipped.append(_too_long(self.source, self.shard.name, row, size, M,
                                               self.skip))  # fmt: skip
                row += 0 if ended else 1
                at += tail + size + (0 if ended else 1)
                buf, eof = bytearray(rest), ended
                tail = buf.rfind(b"\n") + 1
                yield block
                k += 1
                continue
            if eof and cut < 0 and k * B >= at + len(buf):
                break
            end = cut + 1 if cut >= 0 else len(buf)
            data = bytes(buf[:end])
            del buf[:end]
            tail = max(0, tail - end)
            total = at + end
            partial = b""
            if cut < 0 and state.cut and not data.endswith(b"\n"):
                # a truncated stream: the part of a line before the cut is not a record
                keep = data.rfind(b"\n") + 1
                data, partial = data[:keep], data[keep:]
            block = parse_lines(
                self.source, self.shard.name, data, self.text_field, self.skip, row, k, M
            )
            row += data.count(b"\n")
            at = total
            if partial:
                block.skipped.append(self._cut(row, total))
                state.cut = False  # reported once
            yield block
            k += 1
        if state.cut:  # the cut falls at the end of a line: its block is the next one
            block = _empty_block(k)
            block.skipped.append(self._cut(row, at))
            yield block

    def _cut(self, row: int, at: int) -> SourceError:
        err = SourceError(
            self.source,
            self.shard.name,
            row,
            f"truncated file: the compressed stream ends after {at} decompressed bytes, "
            "in the middle of the file; the records from this row on are lost (how many is "
            "unknown); copy the file again",
        )
        if not self.skip:
            raise err
        return err

    def close(self) -> None:
        self._f.close()


# ---- Parquet -----------------------------------------------------------------------------


STRINGS = ("strings", (pa.types.is_string, pa.types.is_large_string))
BINARY = ("binary", (pa.types.is_binary, pa.types.is_large_binary))


class ParquetReader(ShardReader):
    """A Parquet file whose blocks are its row groups; ``columns`` name and type its fields."""

    def __init__(
        self, source: str, shard: Shard, columns: list[tuple[str, tuple[str, Any]]], skip: bool
    ):
        self.source, self.shard, self.skip = source, shard, skip
        self.columns = [name for name, _ in columns]
        self._f = shard.open(source)
        try:
            self._pf = pq.ParquetFile(self._f)
        except (pa.ArrowException, OSError) as e:
            self._f.close()
            raise SourceError(source, shard.name, None, f"cannot read Parquet file ({e})") from None
        schema = self._pf.schema_arrow
        for name, (want, tests) in columns:
            problem = None
            if name not in schema.names:
                problem = f"no column '{name}' (columns: {schema.names})"
            elif not any(t(schema.field(name).type) for t in tests):
                problem = f"column '{name}' is {schema.field(name).type}, expected {want}"
            if problem is not None:
                self._f.close()
                raise SourceError(source, shard.name, None, problem)
        meta = self._pf.metadata
        self.n_blocks = meta.num_row_groups
        sizes = [meta.row_group(i).num_rows for i in range(self.n_blocks)]
        self._row0 = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))

    def row_group(self, k: int) -> tuple[pa.Table, np.ndarray]:
        """Row group ``k``'s columns, and the rows it holds."""
        try:
            table = self._pf.read_row_group(k, columns=self.columns)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(
                self.source, self.shard.name, None, f"cannot read Parquet row group {k} ({e})"
            ) from None
        return table, np.arange(table.num_rows, dtype=np.int64) + int(self._row0[k])

    def close(self) -> None:
        """Close the file."""
        self._f.close()


class _Parquet(ParquetReader):
    def __init__(self, source: str, shard: Shard, text_field: str, skip: bool):
        super().__init__(source, shard, [(text_field, STRINGS)], skip)
        self.text_field = text_field

    def block(self, k: int) -> RecordBlock:
        table, rows = self.row_group(k)
        col = table.column(self.text_field).combine_chunks().cast(pa.large_string())
        if col.null_count == 0:
            return RecordBlock(k, rows, col)
        valid = np.asarray(col.is_valid())
        skipped = [
            SourceError(self.source, self.shard.name, int(r), f"field '{self.text_field}' is null")
            for r in rows[~valid]
        ]
        if not self.skip:
            raise skipped[0]
        return RecordBlock(k, rows[valid], col.filter(pa.array(valid)), skipped)


def open_shard(
    source: str,
    shard: Shard,
    fmt: Format,
    text_field: str,
    block_bytes: int,
    skip: bool,
    cache: dict[Any, Any] | None = None,
    max_record_bytes: int | None = None,
) -> ShardReader:
    """Open one shard for reading by blocks; ``cache`` keeps plain JSONL line indexes.

    ``max_record_bytes`` bounds a JSONL line (``loading.max_record_bytes``).

    A file that cannot be opened at all raises :class:`SourceError` with no row.
    """
    try:
        if fmt is Format.PARQUET:
            return _Parquet(source, shard, text_field, skip)
        for suffix, codec in _CODECS.items():
            if shard.name.endswith(suffix):
                return _CompressedJsonl(
                    source, shard, codec, text_field, block_bytes, skip, max_record_bytes
                )
        return _PlainJsonl(
            source,
            shard,
            text_field,
            block_bytes,
            skip,
            {} if cache is None else cache,
            max_record_bytes,
        )
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise SourceError(source, shard.name, None, f"cannot read file ({e})") from None


def read_blocks(reader: ShardReader, ks: list[int] | None = None) -> Iterator[RecordBlock]:
    """Blocks ``ks`` of an open shard (every block in file order if None), errors named."""
    source, name = reader.source, reader.shard.name
    try:
        if ks is None:
            yield from reader.blocks()
        else:
            for k in ks:
                yield reader.block(k)
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise SourceError(source, name, None, f"cannot read file ({e})") from None


def read_shard(
    source: str, shard: Shard, fmt: Format, text_field: str, skip: bool, block_bytes: int = 1 << 20
) -> RecordBlock:
    """Every good record of one shard, in file order (for checks and tests: it holds them all)."""
    reader = open_shard(source, shard, fmt, text_field, block_bytes, skip)
    try:
        blocks = list(read_blocks(reader))
    finally:
        reader.close()
    if not blocks:
        return _empty_block(0)
    return RecordBlock(
        0,
        np.concatenate([b.rows for b in blocks]),
        pa.concat_arrays([b.texts for b in blocks]),
        [e for b in blocks for e in b.skipped],
    )
