"""Cheap checks of what a plan points at, before a job starts: ``overlord validate``.

:func:`check_sources` opens what it can without reading the data: the ``hf``
tokenizer file (does it load, is its ``eos`` a token of it), and the first
file (by name) of each source: for JSONL its first record (the first line
that is not blank: a JSON object whose ``text_field`` is a string), for
Parquet the schema in the file's footer (``text_field`` is a column of
strings; no row is read), for an image-text source (WebDataset tar, Parquet
with ``image_field``) its first sample, whose image is decoded, resized and
cut into patches as a SourceLoader would. Every problem is returned, each
with its place, so that one run of ``validate`` shows them all. An object-store
endpoint that cannot be reached is one problem naming every source that uses it,
found within ``loading.timeout_s``.

The other files and records are not opened: a bad record further on is met
by the job, which names it (``on_error``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from overlord.errors import PlanError, SourceError
from overlord.plan.spec import Format, Plan, SourceSpec, TokenizerKind
from overlord.sources.files import Shard, resolve_files
from overlord.sources.remote import Retries, endpoint_problems

_CHUNK = 1 << 16
_MAX_FIRST_LINE = 64 << 20  # bytes read at most to find a first record


@dataclass(frozen=True)
class Problem:
    """One thing a plan points at that a job could not use: where, and what is wrong."""

    place: str  # "tokenizer tok.json", "source 'web', file data/web/a.jsonl, row 0"
    reason: str

    def __str__(self) -> str:
        return f"{self.place}: {self.reason}"


def check_sources(plan: Plan) -> list[Problem]:
    """Every problem found opening the plan's tokenizer and the first record of each source."""
    problems = check_tokenizer(plan)
    # every endpoint tried at once first: one that is down is named once, with its sources
    down = endpoint_problems(
        ((s.name, _patterns(s.path), s.storage_options) for s in plan.sources),
        plan.loading.timeout_s,
    )
    problems += [Problem(f"source {', '.join(repr(n) for n in names)}", m) for m, names in down]
    skipped = {n for _, names in down for n in names}
    for spec in plan.sources:
        if spec.name not in skipped:
            problems += check_source(plan, spec)
    return problems


def _patterns(path: str | list[str]) -> list[str]:
    return [path] if isinstance(path, str) else list(path)


def check_tokenizer(plan: Plan) -> list[Problem]:
    """An ``hf`` tokenizer file loads, and has the plan's ``eos`` token."""
    spec = plan.tokenizer
    if spec.kind is not TokenizerKind.HF or spec.path is None:
        return []
    import os

    path = spec.path if os.path.isabs(spec.path) else str(plan.base_dir / spec.path)
    place = f"tokenizer.path {spec.path}"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return [Problem(place, "tokenizer kind 'hf' needs: pip install 'overlord-data[hf]'")]
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises its own Exception type
        return [Problem(place, f"cannot load the tokenizer file ({e})")]
    if spec.eos is not None and tok.token_to_id(spec.eos) is None:
        return [Problem(f"tokenizer.eos '{spec.eos}'", f"no such token in {spec.path}")]
    return []


def check_source(plan: Plan, spec: SourceSpec) -> list[Problem]:
    """The first file of a source: readable, and its first record (or schema) has the text."""
    where = f"source '{spec.name}'"
    try:
        shards = resolve_files(spec, plan.base_dir)
    except PlanError as e:
        return [Problem(where, msg) for _, msg in e.problems]
    if not shards:
        return [Problem(where, "no file")]
    shard = dataclasses.replace(shards[0], retries=Retries(plan.loading.retries))
    where += f", file {shard.name}"
    try:
        if spec.format.pretokenized:
            return _check_tokens(where, plan, spec, shard)
        if spec.format is Format.WEBDATASET or spec.image_field is not None:
            return _check_images(where, plan, spec, shard)
        if spec.format is Format.PARQUET:
            return _check_parquet(where, spec.name, shard, spec.text_field)
        return _check_jsonl(
            where, spec.name, shard, spec.text_field, plan.loading.max_record_bytes
        )
    except SourceError as e:
        return [Problem(where, e.reason)]
    except (OSError, EOFError, zlib.error, pa.ArrowException) as e:
        return [Problem(where, f"cannot read the file ({type(e).__name__}: {e})")]


_EOS_WITHIN = 1 << 20  # ids a first document may hold before a missing eos is a problem


def _check_tokens(where: str, plan: Plan, spec: SourceSpec, shard: Shard) -> list[Problem]:
    """A pre-tokenized shard: its header, its first document, and its ids against the vocabulary.

    Opening it names a ``.npy`` dtype that disagrees with the plan's, a raw file that is not
    a whole number of ids, an ``.idx`` without its ``.bin`` and a truncated ``.bin``. A flat
    file whose first million ids hold no ``eos_id`` most likely has another one. When the plan
    names a tokenizer, an id of the first document at or above its vocabulary is named.
    """
    from overlord.sources.token_files import FlatTokenFile, MegatronFile, open_token_shard
    from overlord.sources.tokenizers import make_tokenizer

    reader = open_token_shard(spec, shard, plan.shuffle.block_bytes, {})
    try:
        if isinstance(reader, FlatTokenFile):
            end = reader.end_of(0)
            ask = f"is eos_id {reader.eos} the id that ends its documents?"
            if end == reader.n and reader.n > _EOS_WITHIN:
                return [Problem(where, f"none of its {reader.n} ids is its eos_id: {ask}")]
            if end > _EOS_WITHIN:
                return [Problem(where, f"its first document has {end} ids: {ask}")]
            first = reader.ids(0, end)
        else:
            assert isinstance(reader, MegatronFile)
            if not len(reader.doc_start):
                return [Problem(where, "no document (its index is empty)")]
            block = reader.block(int(reader.doc_start[0]) // reader.block_bytes)
            first = np.frombuffer(block.texts[0].as_py(), np.int32)
    finally:
        reader.close()
    if "tokenizer" in plan.model_fields_set and len(first):
        vocab = make_tokenizer(plan.tokenizer, str(plan.base_dir)).vocab_size
        low, high = int(first.min()), int(first.max())
        if high >= vocab or low < 0:
            bad = high if high >= vocab else low
            reason = (
                f"id {bad} is outside the tokenizer's vocabulary of {vocab} ids: were these "
                "ids made by it?"
            )
            return [Problem(f"{where}, row 0", reason)]
    return []


def _check_parquet(where: str, source: str, shard: Shard, text_field: str) -> list[Problem]:
    with shard.open(source) as f:
        schema = pq.ParquetFile(f).schema_arrow  # the footer only
    if text_field not in schema.names:
        return [Problem(where, f"no column '{text_field}' (columns: {schema.names})")]
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return [Problem(f"{where}, column '{text_field}'", f"is {kind}, expected strings")]
    return []


def _first_line(stream: Any, limit: int = _MAX_FIRST_LINE) -> tuple[int, bytes] | None:
    """The row and bytes of the first line that is not blank; None if the file has none.

    A line longer than ``limit`` is returned cut at ``limit`` plus one byte (it is read no
    further): the caller names it too long.
    """
    buf, row = b"", 0
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                return row, line
            row += 1
        if len(buf) > limit:
            return row, buf[: limit + 1]
        chunk = stream.read(_CHUNK)
        if not chunk:
            return (row, buf) if buf.strip() else None
        buf += chunk


def _check_jsonl(
    where: str, source: str, shard: Shard, text_field: str, limit: int = _MAX_FIRST_LINE
) -> list[Problem]:
    with shard.open(source) as raw:
        if shard.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw) as f:
                first = _first_line(f, limit)
        elif shard.name.endswith((".zst", ".zstd")):
            stream = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")
            first = _first_line(stream, limit)
        else:
            first = _first_line(raw, limit)
    if first is None:
        return [Problem(where, "no record (the file is empty or only blank lines)")]
    row, line = first
    where += f", row {row}"
    if len(line) > limit:
        return [Problem(where, f"the first record is longer than loading.max_record_bytes "
                        f"({limit} bytes): it is a bad record, not read")]  # fmt: skip
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        return [Problem(where, f"malformed JSON ({e})")]
    if not isinstance(record, dict):
        return [Problem(where, f"expected a JSON object, found {type(record).__name__}")]
    if text_field not in record:
        keys = sorted(record)[:8]
        return [Problem(where, f"no field '{text_field}' (the record has {keys})")]
    if not isinstance(record[text_field], str):
        kind = type(record[text_field]).__name__
        return [Problem(where, f"field '{text_field}' is {kind}, expected a string")]
    return []


def _check_images(where: str, plan: Plan, spec: SourceSpec, shard: Shard) -> list[Problem]:
    """An image-text shard: its first record reads, and its image decodes into patches.

    The record is the first whose text is not blank (a blank one is not a
    sample: its image is never decoded). Its image is decoded, resized and cut
    into patches as a SourceLoader would, so a missing Pillow, an image Pillow
    cannot read, a wrong ``image_field`` and an image too long for
    ``max_seq_len`` are found here, named by row and (tars) member.
    """
    from overlord.sources.webdataset import open_image_shard

    reader = open_image_shard(
        spec.name, shard, spec.format, spec.text_field, spec.image_field, 1 << 20, False
    )
    try:
        first = next((b for b in reader.blocks() if _first_sample(b) is not None), None)
    except SourceError as e:  # the first record lacks its image or text member (its row named)
        return [Problem(_at(where, e.row), e.reason)]
    finally:
        reader.close()
    if first is None:
        return [Problem(where, "no record with a text (the file has no sample)")]
    i = _first_sample(first)
    assert i is not None and first.images is not None
    row = int(first.rows[i])
    place = _at(where, row)
    if first.keys is not None:
        place += f", member {first.keys[i].as_py()}"
    return _check_image(place, plan, first.images[i].as_py())


def _at(where: str, row: int | None) -> str:
    return where if row is None else f"{where}, row {row}"


def _first_sample(block: Any) -> int | None:
    """The index in ``block`` of its first record whose text is not blank."""
    for i, text in enumerate(block.texts.to_pylist()):
        if text.strip():
            return i
    return None


def _check_image(place: str, plan: Plan, data: bytes) -> list[Problem]:
    """One encoded image: Pillow is there, decodes it, and its tokens fit ``max_seq_len``."""
    from overlord.plan.vision import image_tokens
    from overlord.sources.images import image_patches

    assert plan.vision is not None  # the plan's check requires it beside an image source
    try:
        patches = image_patches(data, plan.vision)
    except ImportError as e:
        return [Problem(place, str(e))]
    except Exception as e:  # Pillow raises many types for bad bytes
        return [Problem(place, f"cannot decode the image ({type(e).__name__}: {e})")]
    gh, gw = patches.shape[:2]
    n = image_tokens(gh, gw, plan.vision)
    if n > plan.batch.max_seq_len:
        reason = (
            f"the image gives {n} image tokens ({gh}x{gw} patches), more than "
            f"batch.max_seq_len {plan.batch.max_seq_len}; lower vision.max_pixels or raise "
            "max_seq_len"
        )
        return [Problem(place, reason)]
    return []
