"""Reading a shard's text records block by block: JSONL (plain, .gz, .zst) and Parquet.

A shard is never read whole. A JSONL file's blocks are its lines by byte ranges
(:mod:`overlord.sources.jsonl`); block ``k`` of a Parquet file is its row group ``k``,
and rows are 0-based rows of the file. A plain JSONL file or a Parquet file can be read at
any block (:meth:`ShardReader.block`); a compressed file only in order
(:meth:`ShardReader.blocks`), as a stream. :func:`open_shard` opens the right reader.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from overlord.errors import SourceError
from overlord.plan.spec import Format
from overlord.sources.files import Shard
from overlord.sources.jsonl import CODECS, CompressedJsonl, PlainJsonl
from overlord.sources.parquet_pages import large_pages
from overlord.sources.records import JsonField, RecordBlock, ShardReader, empty_block

__all__ = ["RecordBlock", "ShardReader", "empty_block", "open_shard", "read_blocks", "read_shard"]


# ---- Parquet -----------------------------------------------------------------------------


STRINGS = ("strings", (pa.types.is_string, pa.types.is_large_string))
BINARY = ("binary", (pa.types.is_binary, pa.types.is_large_binary))
ANY = ("any type", (lambda _: True,))  # a JsonField's column: handed on as JSON text


class ParquetReader(ShardReader):
    """A Parquet file whose blocks are its row groups; ``columns`` name and type its fields."""

    def __init__(
        self,
        source: str,
        shard: Shard,
        columns: list[tuple[str, tuple[str, Any]]],
        skip: bool,
        max_record_bytes: int | None = None,
    ):
        self.source, self.shard, self.skip = source, shard, skip
        self.max_record_bytes = max_record_bytes
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

    def row_group(self, k: int) -> tuple[pa.Table, np.ndarray, list[SourceError]]:
        """Row group ``k``'s columns, the rows they hold, and its bad records.

        Rows that :func:`overlord.sources.parquet_pages.large_pages` finds in a page over
        ``max_record_bytes``, and the row group's rows after the first of them, are bad
        records (raised unless ``skip``); the rows before it are read in one batch that
        stops at it, so that no page over the bound is ever decompressed.
        """
        try:
            cut, errors = self._large(k)
            if cut is None:
                table = self._pf.read_row_group(k, columns=self.columns)
            else:
                table = self._head(k, cut)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise SourceError(
                self.source, self.shard.name, None, f"cannot read Parquet row group {k} ({e})"
            ) from None
        if errors and not self.skip:
            raise errors[0]
        return table, np.arange(table.num_rows, dtype=np.int64) + int(self._row0[k]), errors

    def _large(self, k: int) -> tuple[int | None, list[SourceError]]:
        """The first row of row group ``k`` not to read (None: all), and the errors from it on."""
        limit = self.max_record_bytes
        if limit is None:
            return None, []
        group = self._pf.metadata.row_group(k)
        n = group.num_rows
        bad: list[tuple[int, int, str]] = []  # rows [a, b) in a page over the bound: why
        for i in range(group.num_columns):
            chunk = group.column(i)
            column = chunk.path_in_schema
            if column not in self.columns:
                continue
            for page in large_pages(self._f, chunk, limit):
                over = f"more than loading.max_record_bytes ({limit})"
                if page.dictionary:
                    why = (f"row group {k}, column '{column}': its dictionary page holds "
                           f"{page.size} bytes, {over}, and any row of the row group may "
                           "use it: not read")  # fmt: skip
                    bad.append((0, n, why))
                else:
                    a, b = page.first_row, page.first_row + page.rows
                    why = (f"row group {k}, column '{column}': the page of its rows {a}-{b - 1} "
                           f"holds {page.size} bytes, {over}; a Parquet page is read whole, "
                           "so it is not read")  # fmt: skip
                    bad.append((a, b, why))
        if not bad:
            return None, []
        cut = min(a for a, _, _ in bad)
        after = (f"row group {k}: a page before this row is over loading.max_record_bytes "
                 f"({limit}), and a column's pages are read in order, so the row group's "
                 f"rows from {cut} on are not read")  # fmt: skip
        row0 = int(self._row0[k])
        errors = []
        for r in range(cut, n):
            why = next((w for a, b, w in bad if a <= r < b), after)
            errors.append(SourceError(self.source, self.shard.name, row0 + r, why))
        return cut, errors

    def _head(self, k: int, cut: int) -> pa.Table:
        """Rows ``[0, cut)`` of row group ``k``, read no further.

        Its batches end where the page over the bound starts, so that Arrow never
        decompresses that page.
        """
        schema = pa.schema([self._pf.schema_arrow.field(c) for c in self.columns])
        if cut == 0:
            return schema.empty_table()
        got: list[pa.RecordBatch] = []
        held = 0
        batches = self._pf.iter_batches(
            batch_size=cut, row_groups=[k], columns=self.columns, use_threads=False
        )
        for batch in batches:
            got.append(batch.slice(0, cut - held))
            held += got[-1].num_rows
            if held >= cut:
                break
        return pa.Table.from_batches(got, schema)

    def close(self) -> None:
        """Close the file."""
        self._f.close()


class _Parquet(ParquetReader):
    def __init__(
        self, source: str, shard: Shard, text_field: str, skip: bool, max_record_bytes: int | None
    ):
        kind = ANY if isinstance(text_field, JsonField) else STRINGS
        super().__init__(source, shard, [(text_field, kind)], skip, max_record_bytes)
        self.text_field = text_field

    def block(self, k: int) -> RecordBlock:
        table, rows, large = self.row_group(k)
        col = table.column(self.text_field).combine_chunks()
        if isinstance(self.text_field, JsonField) and not any(t(col.type) for t in STRINGS[1]):
            # a chat source's messages column (a list of structs): each row's JSON text; a
            # value JSON has no form for (bytes, a date) becomes a mapping, which the chat
            # record check names as not a string
            values = col.to_pylist()
            texts = [None if v is None else json.dumps(v, default=_no_json) for v in values]
            col = pa.array(texts, pa.large_string())
        col = col.cast(pa.large_string())
        if col.null_count == 0:
            return RecordBlock(k, rows, col, large)
        valid = np.asarray(col.is_valid())
        skipped = [
            SourceError(self.source, self.shard.name, int(r), f"field '{self.text_field}' is null")
            for r in rows[~valid]
        ]
        if not self.skip:
            raise skipped[0]
        return RecordBlock(k, rows[valid], col.filter(pa.array(valid)), skipped + large)


def _no_json(value: object) -> dict[str, str]:
    return {"type": type(value).__name__}


def open_shard(
    source: str,
    shard: Shard,
    fmt: Format,
    text_field: str,
    block_bytes: int,
    skip: bool,
    cache: dict[Any, Any] | None = None,
    max_record_bytes: int | None = None,
    text_prefix: int | None = None,
) -> ShardReader:
    """Open one shard for reading by blocks; ``cache`` keeps plain JSONL line indexes.

    ``max_record_bytes`` bounds a JSONL line and a Parquet cell (``loading.max_record_bytes``).
    ``text_prefix``, if given, is how many UTF-8 bytes of a text are all that is read of
    it: a plain JSONL file's long line keeps only its text's prefix
    (:mod:`overlord.sources.long_lines`).

    A file that cannot be opened at all raises :class:`SourceError` with no row.
    """
    try:
        if fmt is Format.PARQUET or (fmt is Format.CHAT and shard.name.endswith(".parquet")):
            return _Parquet(source, shard, text_field, skip, max_record_bytes)
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
            text_prefix,
        )
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise SourceError(source, shard.name, None, f"cannot read file ({e})") from None


def read_blocks(reader: ShardReader, ks: list[int] | None = None) -> Iterator[RecordBlock]:
    """Blocks ``ks`` of an open shard (every block in file order if None), errors named."""
    with read_errors(reader):
        if ks is None:
            yield from reader.blocks()
        else:
            for k in ks:
                yield reader.block(k)


@contextlib.contextmanager
def read_errors(reader: ShardReader) -> Iterator[None]:
    """A failed read of ``reader``'s file raised as a :class:`SourceError` that names it."""
    try:
        yield
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        where = (reader.source, reader.shard.name, None)
        raise SourceError(*where, f"cannot read file ({e})") from None


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
