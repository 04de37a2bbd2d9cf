"""A long JSONL line read as a stream: its text held once, or only its prefix.

A plain JSONL line longer than :data:`STREAM_LINE` is not read whole (its raw bytes,
then its decoded text, then Arrow's copy: three copies of a long record at once).
:func:`scan_line` reads it a piece at a time (:data:`READ` bytes) and keeps

- its *skeleton*: the line with every JSON string longer than ``keep`` raw
  bytes replaced by a short placeholder (everything else verbatim), which
  ``json.loads`` then checks as the record's structure and reads the text
  field from;
- of each such long string, its text decoded as it is read (``whole``: in UTF-8,
  handed to Arrow without a copy), or under ``long_docs: truncate`` with the bytes
  tokenizer, whose tokens are a text's first ``max_seq_len`` bytes, only its first
  ``keep`` raw bytes, from which the text field's prefix is decoded.

The rest of a long string is checked a piece at a time by ``json.loads`` (its
escapes, its control characters, its UTF-8), so a malformed record is still a
bad record, named by its row. Its memory is a few pieces (and ``keep`` bytes
per long string, or its text), whatever the line's size; where that would not
hold (a skeleton over :data:`SKELETON_MAX`, a text whose kept prefix is blank)
it gives ``None`` and the line is read whole as before.

Where a JSON string ends is found from its quotes: a quote ends a string
unless a run of an odd number of backslashes is before it. A backslash
outside a string stays in the skeleton, where ``json.loads`` rejects it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

READ = 1 << 20  # bytes of the line read and scanned at once
STREAM_LINE = 4 << 20  # a line longer than this is streamed
WHOLE_KEEP = 64 << 10  # raw bytes past which a string is decoded as it is read (``whole``)
SKELETON_MAX = 16 << 20  # a line with more than this outside its long strings is read whole
_CHECK = 1 << 20  # bytes of a long string handed to json.loads at once
_BACK = 8  # a cut this close to a piece's end is inside an escape or a character, or nowhere


def raw_bytes_for(text_bytes: int) -> int:
    r"""Raw bytes of a JSON string that hold at least ``text_bytes`` UTF-8 bytes of its text.

    An escape is at most 6 raw bytes for at least one byte of text (``\u0041``);
    the slack is what :func:`decode_head` may cut off before a split escape.
    """
    return 6 * text_bytes + 4 * _BACK


def text_array(text: str | bytearray) -> pa.Array:
    """A one-record large_string array of ``text``; a bytearray (UTF-8) is not copied."""
    if isinstance(text, str):
        return pa.array([text], pa.large_string())
    offsets = pa.py_buffer(np.array([0, len(text)], np.int64))
    return pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(text)])


class BadLine(ValueError):
    """The line is not a well-formed JSON record; the message says why."""


@dataclass
class _String:
    """The string being scanned: its raw bytes so far (all, or the first ``keep``)."""

    head: bytearray = field(default_factory=bytearray)
    size: int = 0  # raw bytes of content so far
    pending: bytearray = field(default_factory=bytearray)  # long: not yet checked
    body: bytearray = field(default_factory=bytearray)  # long, ``whole``: its text so far, UTF-8


def _loads_piece(raw: bytes | bytearray) -> str:
    """The JSON string whose raw content is ``raw`` (raises ValueError)."""
    out = json.loads(b'"' + bytes(raw) + b'"')
    assert isinstance(out, str)
    return out


def _check_prefix(raw: bytearray, final: bool) -> tuple[int, str]:
    """Check the longest prefix of ``raw`` that is whole escapes, characters and pairs.

    Returns how many bytes were checked and their text; a piece that fails at every
    cut near its end is malformed. A cut leaves no high surrogate last: its low half
    would be decoded on its own, after it.
    """
    ends = [len(raw)] if final else range(len(raw), max(-1, len(raw) - 2 * _BACK), -1)
    error: Exception | None = None
    for cut in ends:
        try:
            text = _loads_piece(raw[:cut])
        except (ValueError, UnicodeDecodeError) as e:
            error = error or e
            continue
        if not final and text and "\ud800" <= text[-1] <= "\udbff":
            continue
        return cut, text
    raise BadLine(f"malformed JSON string ({error})")


def _utf8(text: str) -> bytes:
    """A string's text as UTF-8; a lone surrogate (an escape JSON lets through) is bad."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise BadLine(f"malformed JSON string (a lone surrogate: {e})") from None


def decode_head(raw: bytes | bytearray) -> str:
    """The longest decodable start of a string's raw ``raw`` bytes, by JSON's rules.

    The cut goes before an escape or a character it would split, and before a
    high surrogate whose low half it would leave out.
    """
    for cut in range(len(raw), max(-1, len(raw) - 2 * _BACK), -1):
        try:
            text = _loads_piece(raw[:cut])
        except (ValueError, UnicodeDecodeError):
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":
            continue
        return text
    raise BadLine("malformed JSON string")


@dataclass
class Scanned:
    """A long line's record: its text field's prefix (at least ``keep`` raw bytes' worth)."""

    text: str | bytearray  # bytearray: a long text read ``whole``, in UTF-8
    cut: bool  # the text is a prefix: the record's text is longer


def scan_line(
    read: Callable[[int], bytes], size: int, text_field: str, keep: int, whole: bool = False
) -> Scanned | None:
    """Scan a JSONL line of ``size`` bytes (no newline) given a piece at a time by ``read``.

    Returns the text field, its prefix when the string is longer than ``keep``
    raw bytes; ``None`` where the line must be read whole (see the module);
    raises :class:`BadLine` for a malformed record. ``whole``: a string longer than
    ``keep`` is decoded whole as it is checked, into UTF-8 (no copy of the raw line
    is held, and its text is held once).
    """
    nonce = os.urandom(8).hex()  # a placeholder no string of the record can equal by chance
    skeleton = bytearray()
    heads: list[bytearray] = []  # the first ``keep`` raw bytes of each long string (or all)
    cur: _String | None = None  # the string being scanned, if inside one
    carry = 0  # backslashes ending the previous piece
    done = 0
    while done < size:
        data = read(min(READ, size - done))
        if not data:
            raise OSError(f"the file is shorter than when it was indexed (a line at +{done})")
        done += len(data)
        buf = np.frombuffer(data, np.uint8)
        toggles = _unescaped_quotes(buf, carry)
        plain = np.flatnonzero(buf != 92)
        carry = len(buf) - 1 - int(plain[-1]) if len(plain) else carry + len(buf)
        at = 0
        for q in toggles.tolist():
            if cur is None:
                skeleton += data[at:q]
                cur = _String()
            else:
                _feed(cur, data[at:q], keep)
                if cur.size > keep:
                    text = _check_prefix(cur.pending, final=True)[1]
                    skeleton += b'"\\u0000' + f"{nonce}:{len(heads)}".encode() + b'"'
                    if whole:
                        cur.body += _utf8(text)
                    heads.append(cur.body if whole else cur.head)
                else:
                    skeleton += b'"' + cur.head + b'"'
                cur = None
            at = q + 1
            if len(skeleton) > SKELETON_MAX:
                return None
        if cur is None:
            skeleton += data[at:]
        else:
            _feed(cur, data[at:], keep)
            if len(cur.pending) >= _CHECK:
                cut, text = _check_prefix(cur.pending, final=False)
                del cur.pending[:cut]
                if whole:
                    cur.body += _utf8(text)
        if len(skeleton) > SKELETON_MAX or (not whole and sum(map(len, heads)) > SKELETON_MAX):
            return None
    if cur is not None:
        raise BadLine("malformed JSON (a string not terminated at the line's end)")
    return _record(bytes(skeleton), heads, nonce, text_field, whole)


def _feed(cur: _String, raw: bytes, keep: int) -> None:
    """Add a string's raw bytes: kept while it is short, checked as they come once long."""
    was_short = cur.size <= keep
    cur.size += len(raw)
    if not was_short:
        cur.pending += raw
        return
    cur.head += raw
    if cur.size > keep:  # it turns long: what it has so far is checked with the rest
        cur.pending += cur.head
        del cur.head[keep:]


def _unescaped_quotes(buf: np.ndarray, carry: int) -> np.ndarray:
    """Where in ``buf`` a quote not escaped is: an even run of backslashes before it.

    ``carry`` is the run of backslashes that ended the previous piece.
    """
    quotes = np.flatnonzero(buf == 34)
    if not len(quotes):
        return quotes
    plain = np.flatnonzero(buf != 92)
    j = np.searchsorted(plain, quotes) - 1  # the last byte before each quote not a backslash
    last = np.where(j >= 0, plain[np.maximum(j, 0)], -1)
    run = quotes - 1 - last + np.where(last < 0, carry, 0)
    return quotes[run % 2 == 0]


def _record(
    skeleton: bytes, heads: list[bytearray], nonce: str, text_field: str, whole: bool
) -> Scanned | None:
    """The text field of the record whose skeleton is ``skeleton``."""
    try:
        record = json.loads(skeleton)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadLine(f"malformed JSON ({e})") from None
    except RecursionError:
        raise BadLine("malformed JSON (nested too deeply to parse)") from None
    if not isinstance(record, dict):
        raise BadLine(f"expected a JSON object, found {type(record).__name__}")
    if text_field not in record:
        raise BadLine(f"no field '{text_field}' (the record has {sorted(record)[:8]})")
    value = record[text_field]
    if not isinstance(value, str):
        raise BadLine(f"field '{text_field}' is {type(value).__name__}, expected a string")
    mark = f"\x00{nonce}:"
    if not value.startswith(mark):
        return Scanned(value, cut=False)
    if whole:  # its text, as it is: a blank one is a blank record
        return Scanned(heads[int(value[len(mark) :])], cut=False)
    text = decode_head(heads[int(value[len(mark) :])])
    # a blank prefix says nothing of the whole text's blankness: read it whole
    return Scanned(text, cut=True) if text.strip() else None
