"""The pages of a Parquet column chunk, learned from their headers without reading a page.

A Parquet reader (Arrow's) decompresses a page whole before it hands out any value of
it, and a page holds at least one value: a file of a few KB can hold a cell of a GiB in
one highly compressed page. The footer gives a column chunk's uncompressed size; when
that is over ``loading.max_record_bytes``, :func:`large_pages` walks the chunk's page
headers (Thrift's compact protocol, a few dozen bytes each, the page's bytes skipped by
their compressed size) to find the pages over the bound and the rows they hold, before
any page is read.

A data page of a flat column holds one value per row, so a page's rows follow from its
value count; a dictionary page holds values every row of the chunk may refer to.
"""

from __future__ import annotations

from typing import Any, NamedTuple

_READ = 256  # header bytes fetched at once: a header is a few dozen bytes
_DEPTH = 16  # nested Thrift structs a header may hold (a PageHeader needs 3)
DICTIONARY_PAGE = 2
DATA_PAGES = {0: 5, 3: 8}  # page type -> the PageHeader field of its header (v1, v2)
_ROWS_FIELD = {0: 1, 3: 3}  # v1: num_values (flat column: rows); v2: num_rows


class Page(NamedTuple):
    """One page of a column chunk: the rows it holds (of its row group) and its size."""

    first_row: int  # the row (within the row group) of its first value
    rows: int  # rows it holds; a dictionary page: 0 (every row may use it)
    size: int  # uncompressed bytes
    dictionary: bool


class _Compact:
    """Thrift's compact protocol over a seekable file, bytes fetched a few at a time."""

    def __init__(self, f: Any, at: int):
        self.f, self.base, self.buf, self.pos = f, at, b"", 0

    @property
    def at(self) -> int:
        return self.base + self.pos

    def seek(self, at: int) -> None:
        self.base, self.buf, self.pos = at, b"", 0

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            self.seek(self.at)
            self.f.seek(self.base)
            self.buf = self.f.read(_READ)
            if not self.buf:
                raise ValueError(f"the file ends inside a page header (byte {self.base})")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        out, shift = 0, 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
            if shift > 63:
                raise ValueError(f"a varint longer than 10 bytes at byte {self.at}")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def struct(self, depth: int = 0) -> dict[int, Any]:
        """A struct's fields by id: integers and nested structs; other values skipped."""
        if depth > _DEPTH:
            raise ValueError(f"Thrift structs nested more than {_DEPTH} deep at byte {self.at}")
        fields: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == 0:
                return fields
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            fields[last] = self.value(kind, depth)

    def value(self, kind: int, depth: int) -> Any:
        if kind in (1, 2):  # a boolean field: its value is its type
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.seek(self.at + 8)
        elif kind == 8:
            n = self.varint()  # a binary (statistics' min/max): passed over, never read
            self.seek(self.at + n)
        elif kind in (9, 10):
            head = self.byte()
            n = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(n):
                self.element(head & 0x0F, depth + 1)
        elif kind == 11:
            n = self.varint()
            if n:
                kinds = self.byte()
                for _ in range(n):
                    self.element(kinds >> 4, depth + 1)
                    self.element(kinds & 0x0F, depth + 1)
        elif kind == 12:
            return self.struct(depth + 1)
        else:
            raise ValueError(f"unknown Thrift type {kind} at byte {self.at}")
        return None

    def element(self, kind: int, depth: int) -> None:
        """Pass over one element of a list, set or map (a boolean there is a byte)."""
        if kind in (1, 2):
            self.byte()
        else:
            self.value(kind, depth)


def pages(f: Any, start: int, length: int) -> list[Page]:
    """The pages of the column chunk in bytes ``[start, start + length)`` of ``f``.

    Raises ``ValueError`` for headers that cannot be a column chunk's.
    """
    out: list[Page] = []
    reader, end, row = _Compact(f, start), start + length, 0
    while reader.at < end:
        header = reader.struct()
        kind, size, packed = header.get(1), header.get(2), header.get(3)
        if not isinstance(size, int) or not isinstance(packed, int) or size < 0 or packed < 0:
            raise ValueError(f"a page header without its sizes at byte {reader.at}")
        if kind == DICTIONARY_PAGE:
            out.append(Page(0, 0, size, True))
        elif kind in DATA_PAGES:
            sub = header.get(DATA_PAGES[kind])
            rows = sub.get(_ROWS_FIELD[kind]) if isinstance(sub, dict) else None
            if not isinstance(rows, int) or rows < 0:
                raise ValueError(f"a data page header without its value count at byte {reader.at}")
            out.append(Page(row, rows, size, False))
            row += rows
        reader.seek(reader.at + packed)
    return out


def large_pages(f: Any, chunk: Any, limit: int) -> list[Page]:
    """The pages over ``limit`` bytes of a column chunk (``chunk``: its footer metadata).

    None is looked for when the whole chunk is within ``limit``: the footer says so.
    """
    if chunk.total_uncompressed_size <= limit:
        return []
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset:
        start = min(start, chunk.dictionary_page_offset)
    return [p for p in pages(f, start, chunk.total_compressed_size) if p.size > limit]
