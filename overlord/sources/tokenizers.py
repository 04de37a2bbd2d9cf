"""Tokenizers: a whole shard of texts in, one flat int32 token array and offsets out."""

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
