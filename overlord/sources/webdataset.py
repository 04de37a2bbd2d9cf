"""Image-text shards: WebDataset tars read as a stream, and Parquet files with an image column.

A WebDataset tar holds *samples*: runs of consecutive file members that
share a *key*, the member's path up to the first ``.`` of its base name
(``a/b/000017.jpg`` and ``a/b/000017.txt`` are the members ``jpg`` and ``txt``
of key ``a/b/000017``). A sample's image is its first member whose extension
(lower case) is one of ``image_field`` (``;`` between them; default
``jpg;jpeg;png;webp``), its text the member ``key.<text_field>`` (UTF-8) or,
when it has none, the string field ``text_field`` of its ``key.json`` member.
A sample with no image or no text is a bad record naming its member.

A tar is read as a stream (``.tar``, or ``.tar.gz`` decompressed as it goes),
never extracted. Its *row* ``r`` is its ``r``-th sample (0-based) and its
blocks are cut like a compressed JSONL file's: block ``k`` holds the samples
whose first member's header starts at a byte offset ``k·B <= o < (k+1)·B`` of
the (decompressed) tar, ``B = shuffle.block_bytes``; a member longer than
``B`` leaves the blocks it spans empty, and the tar has as many blocks as
reach its last sample. The blocks come in file order (a stream cannot seek).

A Parquet file with ``image_field`` (a binary column of encoded images)
reads like a text one: block ``k`` is row group ``k``; a null image or text
is a bad record.

Images stay encoded here: they are decoded, resized and cut into patches
when a piece of a window is tokenized (:mod:`overlord.sources.images`).
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from overlord.errors import SourceError
from overlord.plan.spec import Format
from overlord.plan.vision import IMAGE_EXTENSIONS
from overlord.sources.files import Shard
from overlord.sources.formats import BINARY, STRINGS, ParquetReader
from overlord.sources.records import RecordBlock, ShardReader


def split_member(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a tar member: the path up to the base name's first dot.

    >>> split_member("a/b/000017.seg.png")
    ('a/b/000017', 'seg.png')
    """
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :].lower()


def _image_exts(image_field: str | None) -> tuple[str, ...]:
    if not image_field:
        return IMAGE_EXTENSIONS
    return tuple(e.strip().lower().lstrip(".") for e in image_field.split(";") if e.strip())


class _Collect:
    """The records of one block as they are found."""

    def __init__(self, number: int):
        self.number = number
        self.rows: list[int] = []
        self.texts: list[str] = []
        self.images: list[bytes] = []
        self.keys: list[str] = []
        self.skipped: list[SourceError] = []

    def block(self) -> RecordBlock:
        return RecordBlock(
            self.number,
            np.asarray(self.rows, dtype=np.int64),
            pa.array(self.texts, pa.large_string()),
            self.skipped,
            images=pa.array(self.images, pa.large_binary()),
            keys=pa.array(self.keys, pa.large_string()),
        )


class WebDatasetReader(ShardReader):
    """One WebDataset tar, as a stream of blocks of samples."""

    def __init__(
        self,
        source: str,
        shard: Shard,
        text_field: str,
        image_field: str | None,
        block_bytes: int,
        skip: bool,
        max_bytes: int | None = None,
    ):
        self.source, self.shard, self.text_field, self.skip = source, shard, text_field, skip
        self.exts, self.block_bytes = _image_exts(image_field), block_bytes
        self.max_bytes = max_bytes
        self.wanted = {*self.exts, text_field, "json"}  # the members a record is made of
        self._f = shard.open(source)

    def _samples(self) -> Iterator[tuple[int, str, dict[str, bytes | int]]]:
        """``(offset of its first header, key, members by extension)`` of every sample.

        Only the members a record is made of are read; a member larger than ``max_bytes``
        is judged by its header and not read (its size stands in for its bytes), nor is
        any other member (the stream passes over them).
        """
        try:
            # reads of 1 MiB: a stream passes over a member by reading it, 10 KiB at a time by
            # default (a member of gigabytes took minutes)
            tar = tarfile.open(fileobj=self._f, mode="r|*", bufsize=1 << 20)  # noqa: SIM115
        except tarfile.TarError as e:
            raise OSError(f"not a tar file ({e})") from None
        at, key, members = -1, None, dict[str, bytes | int]()
        try:
            for info in tar:
                if not info.isfile():
                    continue
                k, ext = split_member(info.name)
                data: bytes | int = b""
                if ext not in self.wanted:
                    pass  # not part of a record: never read
                elif self.max_bytes is not None and info.size > self.max_bytes:
                    data = int(info.size)  # by its header: a sparse or huge member is not read
                else:
                    got = tar.extractfile(info)
                    data = got.read() if got is not None else b""
                if k != key:
                    if key is not None:
                        yield at, key, members
                    at, key, members = info.offset, k, {}
                members.setdefault(ext, data)
        except (tarfile.TarError, EOFError) as e:
            raise OSError(f"corrupt or truncated tar ({e})") from None
        finally:
            tar.close()
        if key is not None:
            yield at, key, members

    def _record(
        self, row: int, key: str, members: dict[str, bytes | int], into: _Collect
    ) -> None:
        image = next((e for e in self.exts if e in members), None)
        reason, text = None, None
        large = [(e, n) for e, n in members.items() if isinstance(n, int)]
        if large:
            ext, size = large[0]
            reason = (
                f"member {key}.{ext} has {size} bytes, more than loading.max_record_bytes "
                f"({self.max_bytes}): not read"
            )
        elif image is None:
            reason = f"sample '{key}' has no image member {self.exts} (it has {sorted(members)})"
        elif self.text_field in members:
            try:
                text = bytes(members[self.text_field]).decode("utf-8")
            except UnicodeDecodeError as e:
                reason = f"member {key}.{self.text_field} is not UTF-8 ({e})"
        elif "json" in members:
            try:
                record = json.loads(bytes(members["json"]))
                text = record[self.text_field] if isinstance(record, dict) else None
                if not isinstance(text, str):
                    reason = f"member {key}.json: field '{self.text_field}' is not a string"
            except (ValueError, KeyError) as e:
                reason = f"member {key}.json: no string field '{self.text_field}' ({e!r})"
        else:
            reason = f"sample '{key}' has no member {self.text_field} or json"
        if reason is not None:
            err = SourceError(self.source, self.shard.name, row, reason)
            if not self.skip:
                raise err
            into.skipped.append(err)
            return
        assert image is not None and text is not None
        into.rows.append(row)
        into.texts.append(text)
        into.images.append(bytes(members[image]))
        into.keys.append(f"{key}.{image}")

    def blocks(self) -> Iterator[RecordBlock]:
        """Every block, in file order (a tar is a stream)."""
        B = self.block_bytes
        cur = _Collect(0)
        for row, (at, key, members) in enumerate(self._samples()):
            k = at // B
            while cur.number < k:
                yield cur.block()
                cur = _Collect(cur.number + 1)
            self._record(row, key, members, cur)
        if cur.rows or cur.skipped:
            yield cur.block()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


class ParquetImageReader(ParquetReader):
    """A Parquet file with a text column and a binary column of encoded images."""

    def __init__(
        self,
        source: str,
        shard: Shard,
        text_field: str,
        image_field: str,
        skip: bool,
        max_record_bytes: int | None = None,
    ):
        columns = [(text_field, STRINGS), (image_field, BINARY)]
        super().__init__(source, shard, columns, skip, max_record_bytes)
        self.fields = (text_field, image_field)

    def block(self, k: int) -> RecordBlock:
        """Row group ``k``."""
        table, rows, large = self.row_group(k)
        text = table.column(self.fields[0]).combine_chunks().cast(pa.large_string())
        image = table.column(self.fields[1]).combine_chunks().cast(pa.large_binary())
        valid = np.asarray(text.is_valid()) & np.asarray(image.is_valid())
        skipped = [
            SourceError(self.source, self.shard.name, int(r), "its text or its image is null")
            for r in rows[~valid]
        ]
        if skipped and not self.skip:
            raise skipped[0]
        keep = pa.array(valid)
        return RecordBlock(
            k, rows[valid], text.filter(keep), skipped + large, images=image.filter(keep)
        )


def is_image_source(fmt: Format, image_field: str | None) -> bool:
    """Whether a source's records carry images."""
    return fmt is Format.WEBDATASET or image_field is not None


def open_image_shard(
    source: str,
    shard: Shard,
    fmt: Format,
    text_field: str,
    image_field: str | None,
    block_bytes: int,
    skip: bool,
    max_record_bytes: int | None = None,
) -> ShardReader:
    """Open one image-text shard; a file that cannot be opened raises :class:`SourceError`.

    ``max_record_bytes`` bounds a tar member and a Parquet cell (``loading.max_record_bytes``).
    """
    try:
        if fmt is Format.WEBDATASET:
            return WebDatasetReader(
                source, shard, text_field, image_field, block_bytes, skip, max_record_bytes
            )
        assert image_field is not None
        return ParquetImageReader(
            source, shard, text_field, image_field, skip, max_record_bytes
        )
    except SourceError:
        raise
    except (OSError, pa.ArrowException) as e:
        raise SourceError(source, shard.name, None, f"cannot read file ({e})") from None
