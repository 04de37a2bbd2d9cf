"""Corpora that benchmarks write before they measure, and the tokenizer trained on one.

- ``write_word_docs``: one JSONL file of documents of random words (the text of
  the synthetic multi-source corpora; a seeded ``random.Random`` makes them the
  same on every run).
- ``write_corpus``: a small multi-source corpus and its plan (``chaos``,
  ``journal``).
- ``stdlib_files``, ``build_corpus``: this Python's standard library as two
  sources of JSONL shards (``throughput``).
- ``train_bpe``: a byte-level BPE tokenizer trained on JSONL shards, in a child
  process (``throughput``, ``throughput_vs``, ``ray_overhead``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

EOS = "<|endoftext|>"  # the BPE tokenizer's end-of-document token


def write_word_docs(
    path: Path,
    rng: random.Random,
    words: Sequence[str],
    docs: int,
    length: Callable[[random.Random], int],
) -> None:
    """Write ``docs`` JSONL records ``{"text": ...}``, each of ``length(rng)`` of ``words``."""
    with open(path, "w") as out:
        for _ in range(docs):
            n = length(rng)
            text = " ".join(rng.choice(words) for _ in range(n))
            out.write(json.dumps({"text": text}) + "\n")


def write_corpus(root: Path, sources: int = 3, files: int = 6, docs: int = 400) -> Path:
    """A small multi-source corpus and its plan (JSONL, documents of varied length)."""
    rng = random.Random(7)
    words = ["the", "of", "data", "loader", "shard", "token", "planner", "rank", "step", "mix"]
    entries = []
    for s in range(sources):
        name = f"src{s}"
        (root / name).mkdir(parents=True, exist_ok=True)
        for f in range(files):
            write_word_docs(
                root / name / f"part-{f}.jsonl",
                rng,
                words,
                docs,
                lambda r: int(r.lognormvariate(4.5, 1.0)) + 5,
            )
        entries.append({"name": name, "path": f"{name}/*.jsonl", "format": "jsonl", "loaders": 2})
    plan = {
        "seed": 3,
        "sources": entries,
        "mixture": {
            "schedule": [
                {"step": 0, "weights": {e["name"]: 1.0 + i for i, e in enumerate(entries)}},
                {
                    "step": 200,
                    "weights": {e["name"]: float(len(entries) - i) for i, e in enumerate(entries)},
                },
            ]
        },
        "batch": {"tokens_per_step": 8 * 4096, "max_seq_len": 4096, "prefetch_steps": 2},
        "world": {"dp": 4},
        "balance": {"method": "kk", "cost": {"alpha": 1.0, "beta": 0.001}},
        "loading": {"timeout_s": 60},
    }
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def stdlib_files(limit: int | None) -> dict[str, list[Path]]:
    """This Python's standard library sources, split into ``lib`` and ``tests``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[Path]] = {"lib": [], "tests": []}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "site-packages" in rel.parts or not p.is_file():
            continue
        is_test = any(part in ("test", "tests", "idle_test") for part in rel.parts[:-1])
        out["tests" if is_test else "lib"].append(p)
    if limit is not None:
        out = {k: v[:limit] for k, v in out.items()}
    return out


def build_corpus(folder: Path, shards: int, limit: int | None) -> dict[str, list[Path]]:
    """Write each source's files as ``shards`` JSONL files; returns the shard paths."""
    files = stdlib_files(limit)
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[Path]] = {}
    for source, paths in files.items():
        (folder / source).mkdir(parents=True, exist_ok=True)
        outs = [folder / source / f"shard-{k:03d}.jsonl" for k in range(shards)]
        handles = [open(p, "w", encoding="utf-8") for p in outs]  # noqa: SIM115
        try:
            for i, p in enumerate(paths):
                text = p.read_bytes().decode("utf-8", errors="replace")
                rec = {"text": text, "path": str(p.relative_to(root))}
                handles[i % shards].write(json.dumps(rec, ensure_ascii=False) + "\n")
        finally:
            for h in handles:
                h.close()
        out[source] = outs
    return out


_TRAIN = """
import sys
import pyarrow.json as pa_json
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
out, vocab, eos, shards = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
texts = []
for p in shards:
    texts += pa_json.read_json(p).column("text").to_pylist()[::8]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(texts, trainers.BpeTrainer(
    vocab_size=vocab, special_tokens=[eos], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(out)
"""


def train_bpe(shard_paths: dict[str, list[Path]], out: Path, vocab: int) -> Path | None:
    """A byte-level BPE tokenizer trained on every 8th record; None without ``tokenizers``.

    It is trained in a child process: training in this one leaves ``tokenizers``
    encoding on one thread afterwards, which would skew the timings.
    """
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    shards = [str(p) for ps in shard_paths.values() for p in ps]
    cmd = [sys.executable, "-c", _TRAIN, str(out), str(vocab), EOS, *shards]
    subprocess.run(cmd, check=True)
    return out
