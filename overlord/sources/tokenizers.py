"""Tokenizers: a whole shard of texts in, one flat int32 token array and offsets out.

:func:`encode_capped` gives each text's first ``max_seq_len`` tokens only
(``long_docs: truncate``), exactly as :meth:`Tokenizer.encode` would begin them, with
a long text tokenized only as far as those tokens need: its memory follows
``max_seq_len``, not the record's size.
"""

from __future__ import annotations

import functools
import itertools
from typing import Protocol

import numpy as np
import pyarrow as pa

from overlord.errors import PlanError
from overlord.plan.spec import Plan, SourceSpec, TokenizerKind, TokenizerSpec


class Tokenizer(Protocol):
    """Turns many texts into tokens at once: ``tokens[offsets[i]:offsets[i+1]]`` is text i."""

    vocab_size: int
    pad_id: int

    def encode(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (int32) and offsets (int64, one more than there are texts)."""
        ...


class BytesTokenizer:
    """UTF-8 bytes (ids 0-255) and one end-of-document id, 256. Padding is 257.

    >>> toks, offs = BytesTokenizer().encode(pa.array(["hi", "é"], pa.large_string()))
    >>> toks.tolist(), offs.tolist()
    ([104, 105, 256, 195, 169, 256], [0, 3, 6])
    """

    eod_id = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Arrow strings are UTF-8 already: the bytes are the data buffer, sliced by offsets."""
        texts = texts.cast(pa.large_string())
        n = len(texts)
        if n == 0:
            return np.zeros(0, np.int32), np.zeros(1, np.int64)
        _, off_buf, data_buf = texts.buffers()
        offs = np.frombuffer(off_buf, dtype=np.int64)[texts.offset : texts.offset + n + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0)
        data = data[offs[0] : offs[-1]]
        offs = offs - offs[0]
        lengths = np.diff(offs)
        out_offs = np.empty(n + 1, np.int64)
        out_offs[0] = 0
        np.cumsum(lengths + 1, out=out_offs[1:])
        # every document's bytes, then its end-of-document id; a mask (one byte per token)
        # places the bytes without int64 index arrays, which would cost 16 bytes per token
        tokens = np.full(out_offs[-1], self.eod_id, np.int32)
        is_byte = np.ones(out_offs[-1], dtype=bool)
        is_byte[out_offs[1:] - 1] = False
        tokens[is_byte] = data
        return tokens, out_offs

    def decode(self, ids: np.ndarray) -> str:
        """The text of ``ids`` (what ``overlord replay --text`` shows): ids past 255 left out.

        >>> BytesTokenizer().decode(np.array([104, 105, 256]))
        'hi'
        """
        data = np.asarray(ids)
        return data[data < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def encode_spans(self, texts: list[str]) -> tuple[np.ndarray, ...]:
        """:meth:`encode`, with each token's characters ``[start, end)`` in its text.

        The end-of-document id has none (-1, -1).

        >>> [a.tolist() for a in BytesTokenizer().encode_spans(["é!"])]
        [[195, 169, 33, 256], [0, 4], [0, 0, 1, -1], [1, 1, 2, -1]]
        """
        tokens, offsets = self.encode(pa.array(texts, pa.large_string()))
        starts = np.full(len(tokens), -1, np.int64)
        for text, a in zip(texts, offsets[:-1].tolist()):
            data = np.frombuffer(text.encode(), np.uint8)
            # a byte's character: the characters that start at or before it, less one
            starts[a : a + len(data)] = np.cumsum((data & 0xC0) != 0x80) - 1
        ends = np.where(starts >= 0, starts + 1, -1)
        return tokens, offsets, starts, ends

    def prefix_bytes(self, n: int) -> int:
        """Bytes of text that ``n`` tokens can cover at most: one each."""
        return n

    def first_tokens(self, data: memoryview, n: int) -> np.ndarray:
        """The first ``n`` tokens of the UTF-8 text ``data`` (end-of-document id included)."""
        head = np.frombuffer(data[:n], np.uint8).astype(np.int32)
        if len(head) < n:
            head = np.append(head, np.int32(self.eod_id))
        return head


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json; ``eos`` (if given) ends every document."""

    def __init__(self, path: str, eos: str | None = None):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                "tokenizer kind 'hf' needs the tokenizers package: pip install 'overlord-data[hf]'"
            ) from e
        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception naming no file
            raise PlanError(
                [("tokenizer.path", f"cannot load the tokenizer file {path}: {e}")]
            ) from None
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id: int | None = None
        if eos is not None:
            eos_id = self._tok.token_to_id(eos)
            if eos_id is None:
                raise ValueError(f"tokenizer {path} has no token '{eos}' (tokenizer.eos)")
            self.eos_id = eos_id
        self.pad_id = self.eos_id if self.eos_id is not None else 0
        self._longest: int | None = None  # bytes of the vocabulary's longest token

    def decode(self, ids: np.ndarray) -> str:
        """The text of ``ids``, special tokens included (what ``overlord replay --text`` shows)."""
        return str(self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False))

    def prefix_bytes(self, n: int) -> int:
        """Bytes of text that ``n`` tokens can cover, by the vocabulary's longest token.

        A first guess: :meth:`first_tokens` reads on until the tokens it keeps are
        settled, so that a tokenizer whose unknown token covers a whole word (or a
        normalizer that drops characters) still gives what the whole text would.
        """
        if self._longest is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._longest = max((len(t.encode()) for t in vocab), default=1)
        return n * self._longest + _PREFIX_SLACK

    def first_tokens(self, data: memoryview, n: int) -> np.ndarray:
        """The first ``n`` tokens of the UTF-8 text ``data``, as :meth:`encode` begins them.

        A prefix of the text is tokenized, twice as long each time, until its first ``n``
        tokens are settled: they lie in pre-tokenized words (``word_ids``) with a whole word
        between them and the prefix's last word, which the cut may have changed (a word's
        tokens depend only on the word; the pre-tokenizer looks at most one character
        ahead). A token of no word (an added token) settles nothing. At worst the
        prefix grows to the whole text.
        """
        size = self.prefix_bytes(n)
        while size < len(data):
            cut = size
            while cut > 0 and data[cut] & 0xC0 == 0x80:  # not inside a character
                cut -= 1
            enc = self._tok.encode(bytes(data[:cut]).decode(), add_special_tokens=False)
            words = enc.word_ids
            kept = words[n - 1] if len(words) > n else None
            if kept is not None:
                last = max((w for w in words[n:] if w is not None), default=-1)
                if last >= kept + 2:
                    return np.asarray(enc.ids[:n], np.int32)
            size *= 2
        tokens, _ = self.encode(pa.array([bytes(data).decode()], pa.large_string()))
        return tokens[:n]

    def encode_spans(self, texts: list[str]) -> tuple[np.ndarray, ...]:
        """:meth:`encode`, with each token's characters ``[start, end)`` in its text.

        ``encode_batch`` (not its ``_fast`` variant, which leaves offsets out); an end of
        document appended (``eos``) has none: ``(-1, -1)``.
        """
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        chain = itertools.chain.from_iterable
        count = sum(len(e) for e in encodings)
        ids = np.fromiter(chain(e.ids for e in encodings), np.int32, count)
        pairs = np.fromiter(chain(chain(e.offsets) for e in encodings), np.int64, 2 * count)
        lengths = np.fromiter((len(e) for e in encodings), np.int64, len(encodings))
        if self.eos_id is None:
            offs = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
            return ids, offs, pairs[0::2].copy(), pairs[1::2].copy()
        offs = np.concatenate(([0], np.cumsum(lengths + 1))).astype(np.int64)
        is_id = np.ones(offs[-1], dtype=bool)
        is_id[offs[1:] - 1] = False
        tokens = np.full(offs[-1], self.eos_id, np.int32)
        starts, ends = np.full(offs[-1], -1, np.int64), np.full(offs[-1], -1, np.int64)
        tokens[is_id], starts[is_id], ends[is_id] = ids, pairs[0::2], pairs[1::2]
        return tokens, offs, starts, ends

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` in the vocabulary, None if it has none."""
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch on the Rust side, which runs in parallel and releases the GIL.

        The binding hands each text's ids out as a Python list; they go into
        one numpy array in a single pass (``np.fromiter`` over the chained
        lists), with no Python loop over texts or tokens.
        """
        batch = texts.to_pylist()
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = encode(batch, add_special_tokens=False)
        n = len(encodings)
        ids = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings),
            np.int32,
            count=sum(len(e) for e in encodings),
        )
        if self.eos_id is None:
            lengths = np.fromiter((len(e) for e in encodings), np.int64, n)
            return ids, np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        lengths = np.fromiter((len(e) + 1 for e in encodings), np.int64, n)
        offs = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        tokens = np.full(offs[-1], self.eos_id, np.int32)
        is_id = np.ones(offs[-1], dtype=bool)
        is_id[offs[1:] - 1] = False
        tokens[is_id] = ids
        return tokens, offs


_PREFIX_SLACK = 4096  # bytes past what the tokens can cover: the word the cut falls in
LONG_TEXT = 256 << 10  # a text tokenized on its own (as far as it is needed) past this size


def encode_capped(tokenizer: Tokenizer, texts: pa.Array, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Every text's first ``cap`` tokens: ``tokenizer.encode``'s, each document cut at ``cap``.

    Texts too long for ``cap`` tokens to need all of them (and over :data:`LONG_TEXT`)
    are tokenized one at a time and only as far as their first ``cap`` tokens need
    (``first_tokens``); the others at once, as :meth:`Tokenizer.encode` does, their
    tokens past ``cap`` dropped. The tokens are the same either way.
    """
    texts = texts.cast(pa.large_string())
    first_tokens = getattr(tokenizer, "first_tokens", None)
    n = len(texts)
    if first_tokens is None or n == 0:
        return _cut(*tokenizer.encode(texts), cap)
    _, off_buf, data_buf = texts.buffers()
    offs = np.frombuffer(off_buf, np.int64)[texts.offset : texts.offset + n + 1]
    long = np.diff(offs) > max(LONG_TEXT, tokenizer.prefix_bytes(cap))  # type: ignore[attr-defined]
    if not long.any():
        return _cut(*tokenizer.encode(texts), cap)
    short = np.flatnonzero(~long)
    tokens, offsets = _cut(*tokenizer.encode(texts.take(pa.array(short))), cap)
    data = memoryview(data_buf)
    parts: list[np.ndarray] = []
    at = 0  # the next short text
    for i in range(n):
        if long[i]:
            parts.append(first_tokens(data[offs[i] : offs[i + 1]], cap))
        else:
            parts.append(tokens[offsets[at] : offsets[at + 1]])
            at += 1
    lengths = np.fromiter((len(p) for p in parts), np.int64, n)
    return np.concatenate(parts).astype(np.int32), np.concatenate(([0], np.cumsum(lengths)))


def _cut(tokens: np.ndarray, offsets: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document of ``tokens`` cut to its first ``cap`` tokens, in an array of their own."""
    lengths = np.diff(offsets)
    if not len(lengths) or lengths.max() <= cap:
        return tokens, offsets
    kept = np.minimum(lengths, cap)
    out = np.concatenate(([0], np.cumsum(kept))).astype(np.int64)
    # the position in ``tokens`` of each kept token: its document's start, plus its place
    at = np.arange(out[-1], dtype=np.int64) + np.repeat(offsets[:-1] - out[:-1], kept)
    return tokens[at], out


def make_tokenizer(spec: TokenizerSpec, base_dir: str | None = None) -> Tokenizer:
    """The tokenizer a plan asks for; a relative ``path`` is taken from the plan's folder.

    One per process and file: every SourceLoader of a process shares it (a
    ``tokenizers`` tokenizer encodes from many threads at once), so loading
    it and its memory are paid once, not once per loader.
    """
    if spec.kind is TokenizerKind.BYTES:
        return BytesTokenizer()
    import os

    assert spec.path is not None  # checked by plan validation
    path = spec.path if os.path.isabs(spec.path) or base_dir is None else f"{base_dir}/{spec.path}"
    try:
        st = os.stat(path)
        version = (st.st_size, st.st_mtime_ns)
    except OSError:
        version = (-1, -1)  # HFTokenizer names the missing file
    return _hf_tokenizer(os.path.abspath(path), spec.eos, version)


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(path: str, eos: str | None, version: tuple[int, int]) -> HFTokenizer:
    """The tokenizer of ``path`` (``version``: its size and time, so an edited file reloads)."""
    return HFTokenizer(path, eos)


def source_tokenizer(plan: Plan, spec: SourceSpec) -> Tokenizer:
    """What turns one source's records into ids.

    The plan's tokenizer for a text source; for a pre-tokenized one, the records' own ids
    (:class:`overlord.sources.token_files.TokenIds`), padded with the plan tokenizer's
    ``pad_id`` as every batch is.
    """
    tokenizer = make_tokenizer(plan.tokenizer, str(plan.base_dir))
    if not spec.format.pretokenized:
        return tokenizer
    from overlord.sources.token_files import TokenIds

    return TokenIds(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
