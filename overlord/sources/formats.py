"""Reading a shard's text records block by block: JSONL (plain, .gz, .zst) and Parquet.

A shard is never read whole. A JSONL file's blocks are its lines by byte ranges
(:mod:`overlord.sources.jsonl`); block ``k`` of a Parquet file is its row group ``k``,
and rows are 0-based rows of the file. A plain JSONL file or a Parquet file can be read at
any block (:meth:`ShardReader.block`); a compressed file only in order
(:meth:`ShardReader.blocks`), as a stream. :func:`open_shard` opens the right reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from overlord.errors import SourceError
from overlord.plan.spec import Format
from overlord.sources.files import Shard
from overlord.sources.jsonl import CODECS, CompressedJsonl, PlainJsonl
from overlord.sources.records import RecordBlock, ShardReader, empty_block

__all__ = ["RecordBlock", "ShardReader", "empty_block", "open_shard", "read_blocks", "read_shard"]


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
        for suffix, codec in CODECS.items():
            if shard.name.endswith(suffix):
                return CompressedJsonl(
                    source, shard, codec, text_field, block_bytes, skip, max_record_bytes
                )
        return PlainJsonl(
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
        return empty_block(0)
    return RecordBlock(
        0,
        np.concatenate([b.rows for b in blocks]),
        pa.concat_arrays([b.texts for b in blocks]),
        [e for b in blocks for e in b.skipped],
    )
