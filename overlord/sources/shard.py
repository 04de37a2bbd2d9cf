"""A source's deterministic order, streamed: shards, blocks, windows, items.

The order of a source in epoch ``e`` (the README states it as the contract):

1. its shards in a permutation drawn from ``(seed, source, e)``;
2. a shard's blocks (:mod:`overlord.sources.formats`) in a permutation drawn
   from ``(seed, source, e, shard)``, or in file order for a compressed file
   (a stream cannot seek);
3. the blocks in that order taken ``shuffle.window_blocks`` at a time into
   *windows* (:mod:`overlord.sources.window`); the records of a window (good
   and not blank, in block order) in a permutation drawn from
   ``(seed, source, e, shard, window)``;
4. each record in that order gives its document, or the chunks of one longer
   than ``max_seq_len`` (``long_docs: split``): these are the *items*.

``shard`` is the file's index in the epoch's file list. Reading one shard at
a time keeps I/O sequential, holding one window bounds memory whatever the
shard's size, and the order does not depend on how many loaders share the
source, because a shard's items are the same whoever reads it.

An item's identity is its position ``(epoch, shard_pos, index)``: the shard's
place in the epoch's order and the item's place in that shard's order. A
window's records are tokenized a *piece* (consecutive records) at a time, so
that the first items of a shard are ready long before its last; pieces are
how the work is cut, not part of the order.

A record whose text is empty, or only white space (Unicode's, as ``str.strip``
sees it), after the source's transform, is not a sample: it would be a
document of its end-of-document token alone. It is counted as *empty*, as is a
text the tokenizer turns into no token at all. Items are numbered after empty
records are taken out.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from overlord.errors import SourceError
from overlord.plan.spec import Format, LongDocs, OnError, Plan, SourceSpec, TokenizerKind
from overlord.sources.catalog import File
from overlord.sources.chat import chat_field, encode_chat, plan_template
from overlord.sources.files import Shard
from overlord.sources.formats import RecordBlock, open_shard, read_blocks, read_errors
from overlord.sources.images import fuse_images, image_payload, image_token_id
from overlord.sources.records import JsonField, ShardReader
from overlord.sources.remote import Retries
from overlord.sources.token_files import TokenReader, open_token_shard
from overlord.sources.token_window import gathers, token_window
from overlord.sources.tokenizers import LONG_TEXT, Tokenizer, encode_capped
from overlord.sources.transforms import load_transform
from overlord.sources.webdataset import is_image_source, open_image_shard
from overlord.sources.window import EMPTY_TEXTS, PIECE_BYTES, Packed, Piece, Window, piece_bounds


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([k & 0xFFFFFFFF for k in keys]))


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def shard_order(seed: int, source: str, epoch: int, n_shards: int) -> np.ndarray:
    """File indexes of a source's shards in the order epoch ``epoch`` reads them.

    >>> shard_order(0, "web", 0, 4).tolist() == shard_order(0, "web", 0, 4).tolist()
    True
    """
    return _rng(seed, _name_key(source), epoch, 0x5A).permutation(n_shards)


def block_order(seed: int, source: str, epoch: int, file_index: int, n_blocks: int) -> np.ndarray:
    """The order epoch ``epoch`` reads the blocks of a file that can seek."""
    return _rng(seed, _name_key(source), epoch, 0xB1, file_index).permutation(n_blocks)


def window_order(
    seed: int, source: str, epoch: int, file_index: int, window: int, n: int
) -> np.ndarray:
    """Permutation of the ``n`` records of one window."""
    return _rng(seed, _name_key(source), epoch, 0xB2, file_index, window).permutation(n)


@dataclass
class ShardItems:
    """Items of a run of a shard's records in epoch order, with their tokens (payloads)."""

    epoch: int
    shard_pos: int
    file_index: int
    tokens: np.ndarray  # int32: the documents back to back
    start: np.ndarray  # int64 per item: first token in ``tokens``
    length: np.ndarray  # int32 per item: tokens
    row: np.ndarray  # int64 per item: row of the record in its file
    chunk: np.ndarray  # int32 per item: k for the k-th chunk of a split document, else -1
    patches: np.ndarray  # int32 per item: image patches for the encoder's cost (0 for text)
    # image-text items (overlord.sources.images); an item with no image has a (0, 0) grid
    pixels: np.ndarray | None = None  # uint8 (total patches, 3*p*p): the items' images
    patch_start: np.ndarray | None = None  # int64 per item: its first row in ``pixels``
    grid: np.ndarray | None = None  # int32 (items, 2): (h1/p, w1/p) per item
    keys: list[str] | None = None  # a tar's sample key per item (its id is file:key)
    # chat sources with loss_on: assistant (overlord.sources.chat): uint8 per token of
    # ``tokens``, 1 for an assistant token; None for every other source
    mask: np.ndarray | None = None
    dropped: int = 0  # documents dropped as too long (long_docs: drop)
    empty: int = 0  # texts that give no token: not samples
    text_bytes: int = 0  # bytes of text tokenized
    records: int = 0  # records of a whole shard (load_shard_items): good, empty and bad
    skipped: list[SourceError] = field(default_factory=list)  # its bad records (on_error: skip)

    def __len__(self) -> int:
        return len(self.length)


def _transform(
    spec: SourceSpec, name: str, block: RecordBlock, skip: bool, allow_imports: bool
) -> RecordBlock:
    """The source's transform on every record; one that fails is a bad record.

    A transform that cannot load (or that the plan did not allow) fails the shard.
    """
    assert spec.transform is not None
    try:
        fn = load_transform(spec.transform, allow_imports)
    except ValueError as e:
        raise SourceError(spec.name, name, None, f"transform {spec.transform}: {e}") from None
    rows, out, skipped = [], [], list(block.skipped)
    for row, text in zip(block.rows.tolist(), block.texts.to_pylist()):
        try:
            new = fn(text)
            if not isinstance(new, str):
                raise TypeError(f"returned {type(new).__name__}, not str")
        except Exception as e:
            err = SourceError(spec.name, name, row, f"transform {spec.transform}: {e!r}")
            if not skip:
                raise err from e
            skipped.append(err)
            continue
        rows.append(row)
        out.append(new)
    kept = np.flatnonzero(np.isin(block.rows, np.asarray(rows, dtype=np.int64)))
    return RecordBlock(
        block.number,
        np.asarray(rows, dtype=np.int64),
        pa.array(out, pa.large_string()),
        skipped,
        images=None if block.images is None else block.images.take(pa.array(kept)),
        keys=None if block.keys is None else block.keys.take(pa.array(kept)),
    )


class ShardIO:
    """What a loader's reads keep from shard to shard: line indexes, and retries.

    ``indexes`` are plain JSONL files' line indexes (for every epoch);
    ``retries`` retries its files' transient errors, and counts them
    (:mod:`overlord.sources.remote`).
    """

    def __init__(self, retries: int):
        self.retries = Retries(retries)
        self.indexes: dict[Any, Any] = {}


def shard_file(plan: Plan, spec: SourceSpec, files: Sequence[File], epoch: int, pos: int) -> File:
    """The file at place ``pos`` of epoch ``epoch``'s shard order (``files``: the epoch's)."""
    return files[int(shard_order(plan.seed, spec.name, epoch, len(files))[pos])]


def shard_windows(
    plan: Plan,
    spec: SourceSpec,
    files: Sequence[File],
    epoch: int,
    shard_pos: int,
    cache: ShardIO | None = None,
) -> Iterator[Window]:
    """The windows of one shard in epoch order; ``files`` are the epoch's files.

    ``cache`` keeps what opening a file learns (a plain JSONL file's line
    index) for the next epoch, and counts the retried reads.
    """
    if cache is None:
        cache = ShardIO(plan.loading.retries)
    file_index = int(shard_order(plan.seed, spec.name, epoch, len(files))[shard_pos])
    shard = files[file_index]
    skip = plan.on_error is OnError.SKIP
    W = plan.shuffle.window_blocks
    where = Shard(shard.url, shard.name, spec.storage_options, cache.retries)
    B = plan.shuffle.block_bytes
    reader: ShardReader
    if spec.format.pretokenized:
        reader = open_token_shard(spec, where, B, cache.indexes)
    elif is_image_source(spec.format, spec.image_field):
        reader = open_image_shard(
            *(spec.name, where, spec.format, spec.text_field, spec.image_field, B, skip),
            plan.loading.max_record_bytes,
        )
    else:
        reader = open_shard(
            spec.name,
            where,
            spec.format,
            JsonField(chat_field(spec)) if spec.format is Format.CHAT else spec.text_field,
            B,
            skip,
            cache.indexes,
            plan.loading.max_record_bytes,
            _text_prefix(plan, spec),
        )
    try:
        if isinstance(reader, TokenReader) and spec.transform is None and gathers(reader.dtype):
            # a token file's windows are gathered from its blocks' ids (the same windows)
            yield from _token_windows(plan, spec, reader, epoch, shard_pos, file_index)
            return
        if reader.n_blocks is not None:
            order = block_order(plan.seed, spec.name, epoch, file_index, reader.n_blocks).tolist()
            groups: Iterator[list[RecordBlock]] = (
                list(read_blocks(reader, order[i : i + W])) for i in range(0, len(order), W)
            )
        else:
            groups = _batched(read_blocks(reader), W)
        for number, blocks in enumerate(groups):
            yield _window(plan, spec, shard.name, epoch, shard_pos, file_index, number, blocks)
    finally:
        reader.close()


def _token_windows(
    plan: Plan,
    spec: SourceSpec,
    reader: TokenReader,
    epoch: int,
    shard_pos: int,
    file_index: int,
) -> Iterator[Window]:
    """The windows of a token file, each gathered from its blocks' ids (:func:`token_window`)."""
    W = plan.shuffle.window_blocks
    order = block_order(plan.seed, spec.name, epoch, file_index, reader.n_blocks).tolist()
    for number, i in enumerate(range(0, len(order), W)):
        with read_errors(reader):
            blocks = [reader.block_ids(k) for k in order[i : i + W]]

        def permute(n: int, number: int = number) -> np.ndarray:
            return window_order(plan.seed, spec.name, epoch, file_index, number, n)

        place = (epoch, shard_pos, file_index, number, spec.name, reader.shard.name)
        yield token_window(blocks, permute, *place)


def _text_prefix(plan: Plan, spec: SourceSpec) -> int | None:
    """UTF-8 bytes of a record's text that are all its tokens need, if they are known.

    Under ``truncate`` with the bytes tokenizer (a token a byte) and no transform (it
    would see the whole text): past :data:`LONG_TEXT` and ``max_seq_len`` bytes, so that
    :func:`encode_capped` cuts the prefix as it would the whole text. A ``tokenizers``
    tokenizer may need any length of text to settle its first tokens: its records are
    read whole.
    """
    if plan.batch.long_docs is not LongDocs.TRUNCATE or spec.transform is not None:
        return None
    if spec.format is Format.CHAT:  # a record's JSON is parsed and rendered whole
        return None
    if plan.tokenizer.kind is not TokenizerKind.BYTES:
        return None
    return max(LONG_TEXT, plan.batch.max_seq_len) + 1


def _batched(blocks: Iterator[RecordBlock], n: int) -> Iterator[list[RecordBlock]]:
    group: list[RecordBlock] = []
    for block in blocks:
        group.append(block)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


def _window(
    plan: Plan,
    spec: SourceSpec,
    name: str,
    epoch: int,
    shard_pos: int,
    file_index: int,
    number: int,
    blocks: list[RecordBlock],
) -> Window:
    skip = plan.on_error is OnError.SKIP
    records = sum(b.records for b in blocks)
    block = RecordBlock(
        number,
        np.concatenate([b.rows for b in blocks]) if blocks else np.zeros(0, np.int64),
        _join([b.texts for b in blocks]),
        [e for b in blocks for e in b.skipped],
        images=_concat([b.images for b in blocks], pa.large_binary()),
        keys=_concat([b.keys for b in blocks], pa.large_string()),
    )
    blocks.clear()  # the blocks' own arrays go: a window is built from one copy of them
    if spec.transform is not None:
        block = _transform(spec, name, block, skip, plan.transforms.allow_imports)
    kept, empty = _not_blank(block.texts)
    # the window's records, as indexes into the block's: the kept ones, permuted
    order = kept[window_order(plan.seed, spec.name, epoch, file_index, number, len(kept))]
    size = np.diff(_array_offsets(block.texts))
    if block.images is not None:  # a piece's work is mostly its images' decoding
        size = size + np.diff(_array_offsets(block.images))
    offsets = np.concatenate(([0], np.cumsum(size[order], dtype=np.int64)))
    cut = piece_bounds(offsets, PIECE_BYTES)
    arrays = (block.texts, block.images, block.keys)
    if len(cut) == 1 and np.array_equal(order, np.arange(len(block.rows))):
        # one piece of every record, in order (one long record, say): its arrays as they are
        pieces: list[Piece | Packed | None] = [Piece(*arrays)]
    else:
        pieces = [
            Piece(*(None if a is None else a.take(pa.array(order[lo:hi])) for a in arrays))
            for lo, hi in cut
        ]
    return Window(
        epoch=epoch,
        shard_pos=shard_pos,
        file_index=file_index,
        number=number,
        rows=block.rows[order],
        offsets=offsets,
        cut=cut,
        pieces=pieces,
        skipped=block.skipped,
        records=records,
        empty=empty,
        has_images=block.images is not None,
        source=spec.name,
        name=name,
    )


def cut_items(plan: Plan, tokenizer: Tokenizer, window: Window, lo: int, hi: int) -> ShardItems:
    """Tokenize records ``[lo, hi)`` of a window and cut them into items, in order."""
    piece = window.arrays(lo, hi)
    texts = piece.texts
    cap = plan.batch.max_seq_len
    policy = plan.batch.long_docs
    spec = next((s for s in plan.sources if s.name == window.source), None)
    chat = None
    # a chat source's records are rendered by the chat template; a bad record has no token
    if spec is not None and spec.format is Format.CHAT:
        chat = encode_chat(plan_template(plan), tokenizer, spec, texts)
        tokens, offsets = chat.tokens, chat.offsets
    elif policy is LongDocs.TRUNCATE and piece.images is None:
        # only what max_seq_len tokens need of a long record is tokenized, and an item holds
        # its own tokens: not the whole record's, for as long as the item is held
        tokens, offsets = encode_capped(tokenizer, texts, cap)
    else:
        tokens, offsets = tokenizer.encode(texts)
    fused = None
    if piece.images is not None:  # image tokens go before each text (overlord.plan.vision)
        assert plan.vision is not None
        fused = fuse_images(
            *(window, lo, piece, tokens, offsets, plan.vision),
            image_token_id(plan.vision, tokenizer),
            cap,
            plan.on_error is OnError.SKIP,
        )
        tokens, offsets = fused.tokens, fused.offsets
    doc_start = offsets[:-1]
    doc_len = np.diff(offsets)
    rows = window.rows[lo:hi]

    keep = doc_len > 0 if fused is None else (fused.text_len > 0) & fused.ok
    empty = int(len(keep) - keep.sum())  # texts the tokenizer makes nothing of
    policy = plan.batch.long_docs
    dropped = 0
    bad = 0 if fused is None else int((~fused.ok).sum())
    if chat is not None:
        bad = len(chat.bad)
        skipped = _chat_errors(plan, window, rows, chat.bad)
    empty -= bad  # a bad record is counted as skipped, not empty
    if policy is LongDocs.DROP:
        dropped = int((keep & (doc_len > cap)).sum())
        keep &= doc_len <= cap
    elif policy is LongDocs.TRUNCATE:
        doc_len = np.minimum(doc_len, cap)
    doc_start, doc_len, rows = doc_start[keep], doc_len[keep], rows[keep]

    n_chunks = (
        np.maximum(1, -(-doc_len // cap)) if policy is LongDocs.SPLIT else np.ones_like(doc_len)
    )
    doc_of = np.repeat(np.arange(len(doc_len)), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks  # index of each document's first item
    k = np.arange(len(doc_of)) - np.repeat(first, n_chunks)
    start = doc_start[doc_of] + k * cap
    length = np.minimum(cap, doc_len[doc_of] - k * cap).astype(np.int32)
    chunk = np.where(n_chunks[doc_of] > 1, k, -1).astype(np.int32)
    items = ShardItems(
        epoch=window.epoch,
        shard_pos=window.shard_pos,
        file_index=window.file_index,
        tokens=tokens,
        start=start.astype(np.int64),
        length=length,
        row=rows[doc_of].astype(np.int64),
        chunk=chunk,
        patches=np.zeros(len(length), dtype=np.int32),
        dropped=dropped,
        empty=empty,
        text_bytes=_text_bytes(texts),
    )
    if chat is not None:
        items.mask, items.skipped = chat.mask, skipped
    if fused is not None:
        kept = np.flatnonzero(keep)
        items.text_bytes = window.text_bytes(lo, hi)  # images too: what tokens_per_byte sees
        items.skipped = fused.skipped
        keys = None if piece.keys is None else piece.keys.to_pylist()
        width = 3 * plan.vision.patch_size**2 if plan.vision is not None else 0
        image_payload(items, [fused.patches[i] for i in kept], doc_of, k, keys, kept, width)
    return items


def _chat_errors(
    plan: Plan, window: Window, rows: np.ndarray, bad: list[tuple[int, str]]
) -> list[SourceError]:
    """The errors of a piece's chat records that cannot be rendered (raised unless skip)."""
    errors = [SourceError(window.source, window.name, int(rows[i]), why) for i, why in bad]
    if errors and plan.on_error is not OnError.SKIP:
        raise errors[0]
    return errors


def load_shard_items(
    plan: Plan,
    spec: SourceSpec,
    files: Sequence[File],
    tokenizer: Tokenizer,
    epoch: int,
    shard_pos: int,
) -> ShardItems:
    """Every item of one shard in order, with its counts, at once (tests and benchmarks).

    A SourceLoader streams a shard instead: this holds the whole of it.
    """
    parts: list[ShardItems] = []
    records, empty, skipped = 0, 0, []
    file_index = int(shard_order(plan.seed, spec.name, epoch, len(files))[shard_pos])
    for window in shard_windows(plan, spec, files, epoch, shard_pos):
        records += window.records
        empty += window.empty
        skipped += window.skipped
        for lo, hi in window.cut:
            parts.append(cut_items(plan, tokenizer, window, lo, hi))
    base = np.cumsum([0] + [len(p.tokens) for p in parts])
    items = ShardItems(
        epoch=epoch,
        shard_pos=shard_pos,
        file_index=file_index,
        tokens=np.concatenate([p.tokens for p in parts]) if parts else np.zeros(0, np.int32),
        start=np.concatenate([p.start + b for p, b in zip(parts, base)])
        if parts
        else np.zeros(0, np.int64),
        length=_cat([p.length for p in parts], np.int32),
        row=_cat([p.row for p in parts], np.int64),
        chunk=_cat([p.chunk for p in parts], np.int32),
        patches=_cat([p.patches for p in parts], np.int32),
        dropped=sum(p.dropped for p in parts),
        empty=sum(p.empty for p in parts),
        text_bytes=sum(p.text_bytes for p in parts),
        records=records,
        skipped=skipped,
    )
    items.empty += empty
    items.skipped += [e for p in parts for e in p.skipped]
    if any(p.mask is not None for p in parts):
        items.mask = np.concatenate([p.mask for p in parts if p.mask is not None])
    if any(p.pixels is not None for p in parts):
        at = np.cumsum([0] + [len(p.pixels) for p in parts if p.pixels is not None])
        items.pixels = np.concatenate([p.pixels for p in parts if p.pixels is not None])
        items.patch_start = np.concatenate(
            [p.patch_start + b for p, b in zip(parts, at) if p.patch_start is not None]
        )
        items.grid = np.concatenate([p.grid for p in parts if p.grid is not None])
        items.keys = [k for p in parts for k in (p.keys or [])] if parts[0].keys else None
    return items


def _join(texts: list[pa.Array]) -> pa.Array:
    """The blocks' texts in one array; one block's (the others empty) as it is, not copied."""
    full = [t for t in texts if len(t)]
    return full[0] if len(full) == 1 else pa.concat_arrays(texts) if texts else EMPTY_TEXTS


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _not_blank(texts: pa.Array) -> tuple[np.ndarray, int]:
    """The indexes of the records whose text is not blank, and how many are blank.

    A pre-tokenized record (binary ids) is blank when it holds no id.
    """
    if pa.types.is_large_binary(texts.type):
        blank = pc.equal(pc.binary_length(texts), 0)
    else:
        # every character white space (Arrow's, as utf8_trim_whitespace sees it), without
        # a trimmed copy of every text: a long record is not held twice
        blank = pc.or_(pc.equal(pc.binary_length(texts), 0), pc.utf8_is_space(texts))
    kept = np.flatnonzero(~np.asarray(blank, dtype=bool))
    return kept, len(texts) - len(kept)


def _text_bytes(texts: pa.Array) -> int:
    """The bytes of the texts: their offsets' span (a compute kernel's call costs far more)."""
    large = pa.types.is_large_binary(texts.type) or pa.types.is_large_string(texts.type)
    if not len(texts):
        return 0
    if not large or texts.null_count:
        return int(pc.sum(pc.binary_length(texts)).as_py() or 0)
    offsets = _array_offsets(texts)
    return int(offsets[-1] - offsets[0])


def _array_offsets(a: pa.Array) -> np.ndarray:
    """The int64 offsets of a large_string or large_binary array."""
    n, at = len(a), a.offset
    return np.frombuffer(a.buffers()[1], np.int64)[at : at + n + 1]


def _concat(arrays: list[pa.Array | None], kind: pa.DataType) -> pa.Array | None:
    if not arrays or any(a is None for a in arrays):
        return None
    return pa.concat_arrays(arrays).cast(kind)
