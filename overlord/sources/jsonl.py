"""JSONL shards (plain, .gz, .zst), read block by block.

Block ``k`` of a JSONL file holds the lines that *start* in bytes ``[k*B, (k+1)*B)`` of
the file (of its decompressed bytes, for ``.gz`` and ``.zst``), ``B`` being
``shuffle.block_bytes``; a file of ``S`` bytes has ``ceil(S / B)`` blocks, and a line
longer than ``B`` leaves the blocks it spans empty. A plain file can be read at any block
(:meth:`ShardReader.block`); a compressed file only in order (:meth:`ShardReader.blocks`),
as a stream.

Where a plain file's blocks start, and the row each starts at, come from one pass over the
file that counts its lines (a few MB at a time; the index is a few integers per block and
is kept for the next epoch).

Rows are 0-based: the line of the file (blank lines included in the count, though they
hold no record). Arrow's vectorized JSON reader parses a block; when a block has bad
records, a slower per-line pass finds each one so that its error names the exact row. A
line longer than ``loading.max_record_bytes`` is a bad record and is never held: a plain
file's block reads only the lines before it, a compressed stream passes over it.
A plain file's line longer than 4 MiB is read as a stream (:mod:`overlord.sources.long_lines`):
its text is held once, not with the line's raw bytes, or only its prefix where that is all
its tokens need.

A compressed file that ends before its compressed stream does (a truncated ``.gz`` or
``.zst``, e.g. a copy cut short) is a bad record at the cut: under ``on_error: skip``
every complete line before the cut is read, and the cut counts as one skipped record (its
row is the first line not complete; how many records the lost part held cannot be known);
under ``fail`` it raises :class:`SourceError` naming the file, when the stream reaches the
cut. gzip is decoded with ``zlib``, which hands out every byte before the cut, at most a
megabyte for each input; Arrow's zstd decoder hands out whole pieces (1 MiB with Arrow
26), so the records of the piece the cut falls in are lost with it too.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json

from overlord.errors import SourceError
from overlord.sources.files import Shard
from overlord.sources.long_lines import (
    STREAM_LINE,
    WHOLE_KEEP,
    BadLine,
    raw_bytes_for,
    scan_line,
    text_array,
)
from overlord.sources.records import JsonField, RecordBlock, ShardReader, empty_block
from overlord.sources.remote import file_size

CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_SPACE = np.array([9, 11, 12, 13, 32], dtype=np.uint8)  # what bytes.strip() removes, but "\n"
_READ = 1 << 20  # compressed bytes read at once
_SCAN = 8 << 20  # bytes counted at once by the line index
_ZSTD_PIECE = 1 << 20  # bytes asked of Arrow's zstd decoder at once
_INFLATE = 1 << 20  # decompressed bytes a gzip input yields at once


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
        return empty_block(number)
    as_json = isinstance(text_field, JsonField)  # a value of any type, handed on as JSON
    schema = pa.schema([(text_field, pa.large_string())])
    opts = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        if not as_json:
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
            elif not as_json and not isinstance(record[text_field], str):
                kind = type(record[text_field]).__name__
                reason = f"field '{text_field}' is {kind}, expected a string"
        if reason is None:
            rows.append(row0 + i)
            value = record[text_field]
            texts.append(json.dumps(value) if as_json else value)
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


class PlainJsonl(ShardReader):
    """A plain JSONL file, read at any block through its line index."""

    def __init__(
        self,
        source: str,
        shard: Shard,
        text_field: str,
        block_bytes: int,
        skip: bool,
        cache: dict[Any, Any],
        max_bytes: int | None = None,
        text_prefix: int | None = None,
    ):
        self.source, self.shard, self.text_field, self.skip = source, shard, text_field, skip
        self.block_bytes, self.max_bytes = block_bytes, max_bytes
        self.text_prefix = text_prefix  # UTF-8 bytes of a text that are all it is read for
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
            return empty_block(k)
        row0 = int(self._rows[k])
        M, long_at = self.max_bytes, None
        if M is not None and hi - lo > self.block_bytes + M:
            long_at, hi = hi, max(lo, min(hi, (k + 1) * self.block_bytes))
        elif hi - lo > self.block_bytes + STREAM_LINE:
            streamed = self._streamed(k, lo, hi, row0)
            if streamed is not None:
                return streamed
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

    def _streamed(self, k: int, lo: int, hi: int, row0: int) -> RecordBlock | None:
        """Block ``k`` whose last line is long, that line read as a stream.

        Only the last line of a block can be long (the others start and end before
        its nominal end). Its text is kept whole (in one copy, never the raw line's
        bytes as well), or only its prefix if ``text_prefix``. None where the line
        must be read whole (:mod:`overlord.sources.long_lines`).
        """
        if isinstance(self.text_field, JsonField):
            return None  # a long line's field that is not a string: read whole
        whole = self.text_prefix is None
        keep = WHOLE_KEEP if self.text_prefix is None else raw_bytes_for(self.text_prefix)
        data = self._read(lo, max(lo, min(hi, (k + 1) * self.block_bytes)))
        data = data[: data.rfind(b"\n") + 1]  # the complete lines before the long one
        block = parse_lines(
            self.source, self.shard.name, data, self.text_field, self.skip, row0, k, self.max_bytes
        )
        start, row = lo + len(data), row0 + data.count(b"\n")
        end = hi - (self._read(hi - 1, hi) == b"\n")
        self._f.seek(start)
        try:
            got = scan_line(self._f.read, end - start, self.text_field, keep, whole)
        except BadLine as e:
            err = SourceError(self.source, self.shard.name, row, str(e))
            if not self.skip:
                raise err from None
            block.skipped.append(err)
            return block
        if got is None:
            return None
        block.rows = np.append(block.rows, np.int64(row))
        text = text_array(got.text)
        block.texts = pa.concat_arrays([block.texts, text]) if len(block.texts) else text
        return block

    def _read(self, lo: int, hi: int) -> bytes:
        self._f.seek(lo)
        data: bytes = self._f.read(hi - lo)
        if len(data) != hi - lo:
            raise OSError(f"the file is shorter than when it was indexed ({lo + len(data)} bytes)")
        return data

    def close(self) -> None:
        """Close the file."""
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


class CompressedJsonl(ShardReader):
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
        """Every block, in file order, as the stream decompresses."""
        B, M, state = self.block_bytes, self.max_bytes, _Truncated()
        pieces = (_gunzip if self.codec == "gzip" else _unzstd)(self._f, state)
        buf = bytearray()
        at = 0  # decompressed offset of buf[0]: a line start
        tail = 0  # where the last line of buf starts (one past its last newline)
        row, k, eof = 0, 0, False
        while True:
            if at >= (k + 1) * B:  # a long line spans block k: no line starts in it
                yield empty_block(k)
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
            block = empty_block(k)
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
        """Close the file."""
        self._f.close()
