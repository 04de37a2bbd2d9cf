"""A long text tokenized by a ``tokenizers`` tokenizer a segment at a time, as if whole.

Tokenized whole, a text of hundreds of MB costs many times its size at once: the Rust
side keeps each token's string, offsets and masks, and the binding hands the ids out as
a Python list (tens of bytes per token). :func:`encode_segments` tokenizes a segment
(about :data:`SEGMENT_BYTES`) at a time and keeps only the ids, 4 bytes a token.

The ids are the whole text's. A word's tokens depend only on the word (the
pre-tokenizer's pieces, ``word_ids``), and the pre-tokenizer looks at most one character
ahead, so a segment's tokens are settled up to its last two words; the next segment
starts a few words back, at a word's start (its string's own start may tokenize
differently: a prefix space, a ``▁``), and is kept only if its tokens over the last
settled ones are the same ids at the same bytes. When they are not, or a segment
settles nothing, the caller tokenizes the text whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SEGMENT_BYTES = 1 << 20  # text tokenized at once
OVERLAP_WORDS = 8  # words a segment starts before the first token it keeps
CHECK_TOKENS = 4  # tokens of the overlap that must agree with the previous segment's


def _char_starts(data: bytes) -> np.ndarray:
    """The byte at which each character of UTF-8 ``data`` starts, and its length last."""
    b = np.frombuffer(data, np.uint8)
    return np.append(np.flatnonzero((b & 0xC0) != 0x80), len(b)).astype(np.int64)


def _boundary(data: memoryview, at: int) -> int:
    """``at``, moved back to the start of the character it falls in."""
    while 0 < at < len(data) and data[at] & 0xC0 == 0x80:
        at -= 1
    return at


def encode_segments(tok: Any, data: memoryview, segment: int | None = None) -> np.ndarray | None:
    """The ids of the UTF-8 text ``data`` (no end-of-document id), or None (tokenize it whole).

    ``tok`` is a ``tokenizers.Tokenizer``; ``segment`` the bytes tokenized at once
    (:data:`SEGMENT_BYTES`).
    """
    segment = segment or SEGMENT_BYTES
    most = 64 * segment
    parts: list[np.ndarray] = []
    ctx, start = 0, 0  # this segment's string starts at ctx; its tokens are kept from start
    last_ids = np.zeros(0, np.int32)  # the kept tokens before start, and their bytes
    last_at = np.zeros(0, np.int64)
    while True:
        end = _boundary(data, min(len(data), start + segment))
        whole = end >= len(data)
        raw = bytes(data[ctx:end])
        enc = tok.encode(raw.decode(), add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        chars = _char_starts(raw)
        at = chars[[o[0] for o in enc.offsets]] + ctx if len(ids) else np.zeros(0, np.int64)
        words = np.asarray([-1 if w is None else w for w in enc.word_ids], np.int64)
        keep = np.flatnonzero(at >= start)
        if ctx < start:  # the overlap: its last tokens must be the previous segment's
            before = np.flatnonzero(at < start)[-CHECK_TOKENS:]
            if len(keep) == 0 or at[keep[0]] != start or len(before) < min(
                CHECK_TOKENS, len(last_ids)
            ):
                return None
            want = slice(len(last_ids) - len(before), len(last_ids))
            if not (
                np.array_equal(ids[before], last_ids[want])
                and np.array_equal(at[before], last_at[want])
            ):
                return None
        if whole:
            parts.append(ids[keep])
            return np.concatenate(parts) if parts else np.zeros(0, np.int32)
        # settled: the tokens before the first of the last two words (a word: not -1)
        real = words[words >= 0]
        first_open = int(np.flatnonzero(words >= real.max() - 1)[0]) if len(real) else 0
        settled = keep[keep < first_open]
        if not len(settled) or first_open <= keep[0] or at[first_open] <= start:
            segment *= 2  # nothing settled past start yet: a longer segment
            if segment > most:
                return None
            continue
        parts.append(ids[settled])
        last_ids, last_at = ids[settled], at[settled]
        new_start = int(at[first_open])
        back = max(int(words[first_open]) - OVERLAP_WORDS, int(words[settled[0]]))
        ctx = int(at[np.flatnonzero(words == back)[0]])
        ctx, start = min(ctx, new_start), new_start
