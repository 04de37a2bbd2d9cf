"""``overlord.sources.shard``: a shard's items, and documents longer than a row.

The long-document policies (split, truncate, drop) are checked on what the trainer
gets from a running Loader, and the drop count on one shard's items directly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.runs import byte_tokens, run, sample_tokens

from conftest import make_corpus, overlord_cli
from overlord import load_plan
from overlord.sources.files import resolve_files
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import BytesTokenizer

integration = pytest.mark.integration


LONG = ["x" * 40, "short", "y" * 15, "z" * 16, "w" * 90]  # 41, 6, 16, 17, 91 tokens


def long_docs_plan(tmp_path: Path, policy: str) -> Path:
    records = [{"text": t} for t in LONG]
    return make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": records}}},
        batch={"tokens_per_step": 64, "max_seq_len": 16, "long_docs": policy},
    )


def delivered(plan: Path, steps: int) -> dict[str, list[int]]:
    batches, _ = run(plan, steps)
    out: dict[str, list[int]] = {}
    for b in batches:
        assert b.input_ids.shape[1] == 16
        assert all(s.tokens <= 16 for s in b.samples)
        out.update(sample_tokens(b))
    return out


@integration
def test_long_docs_split_into_numbered_chunks(tmp_path: Path) -> None:
    got = delivered(long_docs_plan(tmp_path, "split"), 6)
    want: dict[str, list[int]] = {}
    for row, text in enumerate(LONG):
        toks = byte_tokens(text)
        chunks = [toks[k : k + 16] for k in range(0, len(toks), 16)]
        if len(chunks) == 1:
            want[f"data/web/a.jsonl:{row}"] = chunks[0]
        else:
            want |= {f"data/web/a.jsonl:{row}#{k}": c for k, c in enumerate(chunks)}
    assert got == want
    assert [len(got[f"data/web/a.jsonl:4#{k}"]) for k in range(6)] == [16, 16, 16, 16, 16, 11]


@integration
def test_long_docs_truncate_to_max_seq_len(tmp_path: Path) -> None:
    got = delivered(long_docs_plan(tmp_path, "truncate"), 4)
    want = {f"data/web/a.jsonl:{row}": byte_tokens(t)[:16] for row, t in enumerate(LONG)}
    assert got == want
    assert len(got["data/web/a.jsonl:0"]) == 16 and "#" not in "".join(got)


@integration
def test_long_docs_drop_skips_and_counts_them(tmp_path: Path) -> None:
    plan = long_docs_plan(tmp_path, "drop")
    got = delivered(plan, 4)
    assert set(got) == {"data/web/a.jsonl:1", "data/web/a.jsonl:2"}  # 6 and 16 tokens
    _, stats = run(plan, 1)
    (web,) = stats["loaders"]
    assert web["dropped"] == 3  # rows 0, 3 and 4, counted once over every epoch
    proc = overlord_cli("run", str(plan), "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "dropped 3 document(s) (too long, long_docs: drop)" in proc.stdout


def test_drop_count_of_one_shard(tmp_path: Path) -> None:
    plan = load_plan(long_docs_plan(tmp_path, "drop"))
    spec = plan.sources[0]
    items = load_shard_items(plan, spec, resolve_files(spec, plan.base_dir), BytesTokenizer(), 0, 0)
    assert items.dropped == 3
    assert sorted(items.row.tolist()) == [1, 2]
    assert np.all(items.chunk == -1)


# ---- empty records -----------------------------------------------------------------------------

BLANKS = ["", "   ", "\t\r\n ", "\u3000\u2003"]  # empty, or only (Unicode) white space


def hf_tokenizer_file(path: Path) -> Path:
    """A tiny word-level tokenizer.json with an end-of-sequence token ``</s>``."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_blank_records_are_not_samples_but_counted_as_empty(tmp_path: Path, tokenizer: str) -> None:
    texts = ["hello world", *BLANKS, "world hello hello"]
    kind: dict[str, str] = {"kind": "bytes"}
    if tokenizer == "hf":
        hf_tokenizer_file(tmp_path / "tok.json")
        kind = {"kind": "hf", "path": "tok.json", "eos": "</s>"}
    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {"data/web/a.jsonl": [{"text": t} for t in texts]}}},
            tokenizer=kind,
        )
    )
    spec = plan.sources[0]
    from overlord.sources.tokenizers import make_tokenizer

    tok = make_tokenizer(plan.tokenizer, str(plan.base_dir))
    items = load_shard_items(plan, spec, resolve_files(spec, plan.base_dir), tok, 0, 0)
    assert sorted(items.row.tolist()) == [0, 5]  # only the two real documents
    assert (items.records, items.empty, items.dropped) == (6, 4, 0)
    assert np.all(items.length > 1)  # no document of its end token alone
