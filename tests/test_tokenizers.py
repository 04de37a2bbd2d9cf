"""``overlord.sources.tokenizers``: text to token ids. Pure."""

from __future__ import annotations

import pyarrow as pa

from overlord.sources.tokenizers import BytesTokenizer


def test_bytes_tokenizer_matches_utf8():
    texts = ["", "héllo", "日本", "a\nb"]
    toks, offs = BytesTokenizer().encode(pa.array(texts, pa.large_string()))
    for i, t in enumerate(texts):
        assert toks[offs[i] : offs[i + 1]].tolist() == list(t.encode()) + [256]
    # a sliced Arrow array (offset != 0) is handled too
    toks, offs = BytesTokenizer().encode(pa.array(texts, pa.large_string()).slice(1, 2))
    assert toks.tolist() == list("héllo".encode()) + [256] + list("日本".encode()) + [256]
