"""What a shard reader hands out: blocks of records, in file order, with their bad records.

Every format's reader (:mod:`overlord.sources.jsonl`, :mod:`overlord.sources.formats`'s
Parquet, :mod:`overlord.sources.webdataset`, :mod:`overlord.sources.token_files`) is a
:class:`ShardReader` of :class:`RecordBlock` s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from overlord.errors import SourceError
from overlord.sources.files import Shard


class JsonField(str):
    """A record field read as its JSON text, whatever its type (a chat source's messages).

    The readers pass a field's name as a plain ``str`` for a text field (the value must be a
    string); a ``JsonField`` name hands on the value's JSON text instead, for
    :mod:`overlord.sources.chat` to parse and check per record.
    """

    __slots__ = ()


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


def empty_block(number: int) -> RecordBlock:
    """A block with no record."""
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
