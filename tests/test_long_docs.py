"""long_docs: truncate tokenizes only what max_seq_len tokens need, and gives the same tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from support.memory import peak_kib

import overlord
from benchmarks.long_records import write_source as corpus
from overlord.sources import tokenizers as toks
from overlord.sources.tokenizers import BytesTokenizer, HFTokenizer, encode_capped

WORDS = ["the", "cat", "sat", "on", "mat", "été", "日本語", "🙂", "12345", "don't", "x" * 40,
         "über-long-hyphenated-word", "\t", "\n\n", "   ", ".,;!", "Ġ", "▁a"]  # fmt: skip


def texts(seed: int, n: int = 60) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randrange(1, 400)
        out.append("".join(rng.choice(WORDS) + rng.choice(["", " ", "  ", "\n"]) for _ in range(k)))
    return out


_TRAINED: dict[str, Path] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


def trained(kind: str, folder: Path) -> Path:
    """A small tokenizer of ``kind`` trained on :func:`texts` (once per module)."""
    if kind in _TRAINED and _TRAINED[kind].exists():
        return _TRAINED[kind]
    path = folder / f"{kind}.json"
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    corpus = texts(99, 40)
    if kind == "bpe":  # byte-level BPE, as GPT-2's
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["</s>"], initial_alphabet=alphabet
        )
    elif kind == "wordpiece":  # a word longer than 12 characters is one [UNK] token
        tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=12))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"])
    else:  # a unigram model over Metaspace words, as SentencePiece's
        tok = tokenizers.Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["</s>", "<unk>"],
                                          unk_token="<unk>")  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    _TRAINED[kind] = path
    return path


def whole(tokenizer: Any, batch: list[str], cap: int) -> list[list[int]]:
    """Today's tokens: the whole text tokenized, each document cut at ``cap``."""
    tokens, offsets = tokenizer.encode(pa.array(batch, pa.large_string()))
    return [tokens[a : min(b, a + cap)].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def capped(tokenizer: Any, batch: list[str], cap: int) -> list[list[int]]:
    tokens, offsets = encode_capped(tokenizer, pa.array(batch, pa.large_string()), cap)
    assert np.all(np.diff(offsets) <= cap)
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("cap", [1, 7, 64, 333])
@pytest.mark.parametrize("kind", ["bytes", "bpe", "wordpiece", "unigram"])
def test_the_first_tokens_of_a_prefix_are_the_whole_texts(
    folder: Path, monkeypatch: pytest.MonkeyPatch, kind: str, cap: int
) -> None:
    # every text takes the prefix path (as a record of megabytes does), cut at many places:
    # inside words, characters of several bytes, runs of white space
    monkeypatch.setattr(toks, "LONG_TEXT", 0)
    monkeypatch.setattr(toks, "_PREFIX_SLACK", 0)
    for eos in ([None, "</s>"] if kind != "bytes" else [None]):
        if kind == "bytes":
            tokenizer: Any = BytesTokenizer()
        else:
            tokenizer = HFTokenizer(str(trained(kind, folder)), eos)
            # its first prefix as short as cap tokens of one byte: cut inside the tokens
            # kept, then doubled, so that a cut falls near every kind of boundary
            tokenizer._longest = 1
        for seed in range(3):
            batch = texts(seed)
            assert capped(tokenizer, batch, cap) == whole(tokenizer, batch, cap), (eos, seed)


def test_a_long_text_beside_short_ones_keeps_its_place(folder: Path) -> None:
    tokenizer = HFTokenizer(str(trained("bpe", folder)), "</s>")
    batch = ["short one", "word " * 200_000, "", "another short", "y" * 300_000]
    assert capped(tokenizer, batch, 50) == whole(tokenizer, batch, 50)
    assert capped(BytesTokenizer(), batch, 50) == whole(BytesTokenizer(), batch, 50)


def test_a_long_text_is_tokenized_only_as_far_as_needed(folder: Path) -> None:
    tokenizer = HFTokenizer(str(trained("bpe", folder)), "</s>")
    seen: list[int] = []
    encode = tokenizer._tok.encode

    def spy(text: str, **kw: Any) -> Any:
        seen.append(len(text))
        return encode(text, **kw)

    tokenizer._tok = type("Spy", (), {"encode": staticmethod(spy),
                                      "get_vocab": tokenizer._tok.get_vocab})()  # fmt: skip
    first = tokenizer.first_tokens(memoryview(("word " * 2_000_000).encode()), 64)
    assert len(first) == 64 and seen and max(seen) < 100_000, seen  # of 10 MB


def test_truncate_serves_the_first_max_seq_len_tokens(tmp_path: Path) -> None:
    path = corpus(tmp_path, 2_000_000, "truncate")
    text = json.loads((tmp_path / "a.jsonl").read_text())["text"]
    with overlord.Loader(overlord.load_plan(path)) as loader:
        batch = next(loader.client(0))
    want = list(text.encode()[:1024])
    row = batch.input_ids.reshape(-1).tolist()
    assert row[:1024] == want  # bytes tokens: the record's first 1024 bytes


@pytest.mark.integration
def test_truncate_memory_is_bounded_by_the_plan_not_the_record(tmp_path: Path) -> None:
    """A 120 MB record peaks within 1.5x of a 20 MB one under truncate.

    Neither its tokens past max_seq_len are made nor its text held whole: a long JSONL
    line is streamed and only its text's prefix kept (overlord.sources.long_lines). Read
    whole, the 120 MB record took 1.9x the 20 MB one's peak (its text in 2-3 copies); its
    tokens made whole, each epoch's item held 4 bytes per byte of the record.
    """
    small = peak_kib(corpus(tmp_path / "small", 20_000_000, "truncate"), 2)
    large = peak_kib(corpus(tmp_path / "large", 120_000_000, "truncate"), 2)
    assert large < 1.5 * small, f"{large} KiB for 120 MB, {small} KiB for 20 MB"


@pytest.mark.integration
def test_split_memory_holds_no_record_of_tokens(tmp_path: Path) -> None:
    """From a 20 MB record to a 120 MB one under split, the peak grows by its text, not tokens.

    Its chunks are made and published a part at a time (overlord.sources.record_parts):
    the tokens held are the loader's budget's; its text is held once (1.2 bytes of memory
    per byte of record, measured). Its tokens made at once, and its text read in three
    copies, took 12.4 bytes per byte (measured before); its tokens alone are 4.
    """
    small = peak_kib(corpus(tmp_path / "small", 20_000_000, "split"), 2)
    large = peak_kib(corpus(tmp_path / "large", 120_000_000, "split"), 2)
    grown = (large - small) * 1024 / 100_000_000  # bytes of memory per byte of record
    assert grown < 2.0, f"{large} KiB for 120 MB, {small} KiB for 20 MB"
