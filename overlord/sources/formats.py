"""Reading one shard's text records: JSONL (plain, .gz, .zst) and Parquet.

A shard is read whole, with Arrow's vectorized readers on the fast path. When
a file has bad records, a slower per-line pass finds each one so that its
error names the exact row. Rows are 0-based: the line of a JSONL file (blank
lines included in the count, though they hold no record), the row of a
Parquet file.
"""

from __future__ import annotations

import io
import json
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


def _read_bytes(shard: Shard) -> bytes:
    with fsspec.open(shard.url, "rb") as f:
        raw = f.read()
    for suffix, codec in _CODECS.items():
        if shard.name.endswith(suffix):
            stream = pa.CompressedInputStream(pa.BufferReader(raw), codec)
            return stream.read()
    return raw


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
    data = _read_bytes(shard)
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
