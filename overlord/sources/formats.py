"""Reading one shard's text records: JSONL (plain, .gz, .zst) and Parquet.

A shard is read whole, with Arrow's vectorized readers on the fast path. When
a file has bad records, a slower per-line pass finds each one so that its
error names the exact row. Rows are 0-based: the line of a JSONL file (blank
lines included in the count, though they hold no record), the row of a
Parquet file.

A compressed JSONL file that ends before its compressed stream does (a
truncated ``.gz`` or ``.zst``, e.g. a copy cut short) is a bad record at the
cut: under ``on_error: skip`` every complete line before the cut is read, and
the cut counts as one skipped record (its row is the first line not complete;
how many records the lost part held cannot be known); under ``fail`` it raises
:class:`SourceError` naming the file. gzip is decoded with ``zlib``, which
hands out every byte before the cut; Arrow's zstd decoder hands out whole
pieces (1 MiB with Arrow 26), so the records of the piece the cut falls in
are lost with it too.
"""

from __future__ import annotations

import io
import json
import zlib
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from overlord.errors import SourceError
from overlord.plan.spec import Format
from overlord.sources.files import Shard

_CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_SPACE = np.array([9, 11, 12, 13, 32], dtype=np.uint8)  # what bytes.strip() removes, but "\n"


@dataclass
class ShardTexts:
    """The good records of one shard, in file order."""

    rows: np.ndarray  # int64, 0-based row of each record
    texts: pa.Array  # large_string, one per record
    skipped: list[SourceError] = field(default_factory=list)  # bad records (on_error=skip)


_ZSTD_PIECE = 1 << 20  # bytes asked of Arrow's zstd decoder at once


def _gunzip(raw: bytes) -> tuple[bytes, bool]:
    """Every byte of a gzip file (all its members), and whether it ends before its stream."""
    out: list[bytes] = []
    while True:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out.append(d.decompress(raw))
        if not d.eof:
            out.append(d.flush())
            return b"".join(out), True
        raw = d.unused_data
        if not raw.strip(b"\0"):  # trailing zero padding, as gzip tolerates
            return b"".join(out), False


def _unzstd(raw: bytes) -> tuple[bytes, bool]:
    """Every byte Arrow can decode of a zstd file, and whether it ends before its stream."""
    stream = pa.CompressedInputStream(pa.BufferReader(raw), "zstd")
    out: list[bytes] = []
    try:
        while piece := stream.read(_ZSTD_PIECE):
            out.append(piece)
    except OSError as e:
        if "truncated" not in str(e).lower():
            raise
        return b"".join(out), True
    return b"".join(out), False


def _read_bytes(shard: Shard) -> tuple[bytes, bool]:
    """The file's bytes, decompressed; True if a compressed file ends before its stream."""
    with fsspec.open(shard.url, "rb") as f:
        raw = f.read()
    for suffix, codec in _CODECS.items():
        if shard.name.endswith(suffix):
            if codec == "gzip":
                try:
                    return _gunzip(raw)
                except zlib.error as e:
                    raise OSError(f"corrupt gzip data: {e}") from None
            return _unzstd(raw)
    return raw, False


def _line_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive, without the newline) of every line."""
    buf = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    ends = nl
    if len(buf) and buf[-1] != 10:
        ends = np.append(nl, len(buf))
    starts = np.concatenate(([0], nl + 1))[: len(ends)]
    return starts.astype(np.int64), ends.astype(np.int64)


def _read_jsonl(source: str, shard: Shard, text_field: str, skip: bool) -> ShardTexts:
    data, truncated = _read_bytes(shard)
    if not truncated:
        return _read_lines(source, shard, data, text_field, skip)
    # only complete lines are records: the part of a line before the cut is not one
    whole = data[: data.rfind(b"\n") + 1]
    cut = SourceError(
        source,
        shard.name,
        whole.count(b"\n"),
        f"truncated file: the compressed stream ends after {len(data)} decompressed bytes, "
        "in the middle of the file; the records from this row on are lost (how many is "
        "unknown); copy the file again",
    )
    if not skip:
        raise cut
    texts = _read_lines(source, shard, whole, text_field, skip)
    texts.skipped.append(cut)
    return texts


def _read_lines(source: str, shard: Shard, data: bytes, text_field: str, skip: bool) -> ShardTexts:
    """The records of a JSONL file's (decompressed) bytes."""
    starts, ends = _line_bounds(data)
    # a line holding only "\r", tabs or spaces is blank too; Arrow skips those, so do we.
    # Only a line that starts with whitespace can be one: check just those.
    lengths = ends - starts
    nonblank = np.flatnonzero(lengths > 0)
    buf = np.frombuffer(data, dtype=np.uint8)
    maybe = nonblank[np.isin(buf[starts[nonblank]], _SPACE)]
    blank = [i for i in maybe.tolist() if not data[starts[i] : ends[i]].strip()]
    if blank:
        nonblank = np.setdiff1d(nonblank, blank)
    schema = pa.schema([(text_field, pa.large_string())])
    opts = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        table = pa_json.read_json(io.BytesIO(data), parse_options=opts)
        col = table.column(text_field).combine_chunks()
        col.validate(full=True)  # Arrow's JSON reader lets invalid UTF-8 through
        if len(col) == len(nonblank) and col.null_count == 0:
            return ShardTexts(rows=nonblank, texts=col)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    return _read_jsonl_slow(source, shard, data, starts, ends, nonblank, text_field, skip)


def _read_jsonl_slow(
    source: str,
    shard: Shard,
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    nonblank: np.ndarray,
    text_field: str,
    skip: bool,
) -> ShardTexts:
    rows: list[int] = []
    texts: list[str] = []
    skipped: list[SourceError] = []
    for i in nonblank.tolist():
        line = data[starts[i] : ends[i]]
        reason = None
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            reason = f"malformed JSON ({e})"
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
            rows.append(i)
            texts.append(record[text_field])
            continue
        err = SourceError(source, shard.name, i, reason)
        if not skip:
            raise err
        skipped.append(err)
    return ShardTexts(np.asarray(rows, dtype=np.int64), pa.array(texts, pa.large_string()), skipped)


def _read_parquet(source: str, shard: Shard, text_field: str, skip: bool) -> ShardTexts:
    try:
        with fsspec.open(shard.url, "rb") as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            if text_field not in names:
                raise SourceError(
                    source, shard.name, None, f"no column '{text_field}' (columns: {names})"
                )
            table = pf.read(columns=[text_field])
    except SourceError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise SourceError(source, shard.name, None, f"cannot read Parquet file ({e})") from None
    col = table.column(text_field).combine_chunks()
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise SourceError(
            source, shard.name, None, f"column '{text_field}' is {col.type}, expected strings"
        )
    col = col.cast(pa.large_string())
    rows = np.arange(len(col), dtype=np.int64)
    if col.null_count == 0:
        return ShardTexts(rows, col)
    valid = np.asarray(col.is_valid())
    skipped = [
        SourceError(source, shard.name, int(r), f"field '{text_field}' is null")
        for r in np.flatnonzero(~valid)
    ]
    if not skip:
        raise skipped[0]
    return ShardTexts(rows[valid], col.filter(pa.array(valid)), skipped)


def read_shard(source: str, shard: Shard, fmt: Format, text_field: str, skip: bool) -> ShardTexts:
    """Read every good record of one shard; raise (or, with ``skip``, collect) bad ones.

    A file that cannot be read at all raises :class:`SourceError` with no row.
    """
    try:
        if fmt is Format.JSONL:
            return _read_jsonl(source, shard, text_field, skip)
        return _read_parquet(source, shard, text_field, skip)
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise SourceError(source, shard.name, None, f"cannot read file ({e})") from None
