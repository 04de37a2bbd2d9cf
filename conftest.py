"""The documentation's code blocks as tests (Sybil), for README.md and docs/**/*.md.

Each page runs in a folder of its own that holds a small corpus and the quick
start's plan (``plan.yaml``: sources ``web``, JSONL, and ``code``, Parquet, under
``data/``), with the folder as the working directory:

- ``python`` blocks run, in order, in one namespace per page;
- ``bash``, ``sh`` and ``console`` blocks run with bash (``set -e``), with this
  checkout's ``overlord`` command and the virtual environment's ``python`` first
  on ``PATH``; a ``console`` block runs its ``$ `` lines and ignores the output shown;
- ``yaml`` blocks that hold a whole plan (``sources`` and ``batch``) are loaded
  with ``overlord.load_plan`` against the corpus (every glob must match) and
  become the page's ``plan.yaml``; a part of a plan is merged over the quick
  start's plan (its top-level keys replace the quick start's; with ``sources``
  the quick start's mixture goes) and validated with ``overlord.validate_plan``
  (files unchecked).
  A ``yaml`` block that is not a plan says so: ``<!-- skip: next "why" -->``.

A block that cannot run here (it installs from the package index, starts a Ray
cluster, needs a GPU or several machines) has ``<!-- skip: next "why" -->`` just
above it: Sybil reports it as skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import tomllib
import yaml
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent

QUICK_PLAN = """\
seed: 1234
sources:
  - {name: web, path: data/web/*.jsonl, format: jsonl, text_field: text}
  - {name: code, path: data/code/*.parquet, format: parquet, text_field: content}
mixture:
  schedule:
    - {step: 0, weights: {web: 0.7, code: 0.3}}
    - {step: 100, weights: {web: 0.5, code: 0.5}}
batch: {tokens_per_step: 16384, max_seq_len: 1024}
world: {dp: 2}
balance:
  method: kk
  cost: {model: {params: 7.0e9, layers: 32, hidden: 4096}}
"""

WORDS = [
    "data",
    "loader",
    "plan",
    "step",
    "rank",
    "token",
    "source",
    "shard",
    "window",
    "block",
    "mixture",
    "balance",
    "cost",
    "model",
    "train",
    "batch",
    "row",
    "pack",
    "seed",
    "order",
    "epoch",
    "state",
    "resume",
    "planner",
    "constructor",
]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300))) + "."


def build_corpus(root: Path) -> None:
    """Two JSONL shards of ``web`` and one Parquet file of ``code``, about 130 KB of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    web = root / "data" / "web"
    web.mkdir(parents=True)
    for k in range(2):
        lines = [json.dumps({"text": _text(rng)}) for _ in range(50)]
        (web / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    code = root / "data" / "code"
    code.mkdir(parents=True)
    table = pa.table({"content": [_text(rng) for _ in range(50)]})
    pq.write_table(table, code / "part-0.parquet", row_group_size=10)
    (root / "plan.yaml").write_text(QUICK_PLAN)


def _overlord_command(bin_dir: Path) -> None:
    """``overlord`` on PATH: the console command of pyproject.toml, run from this checkout."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["overlord"]
    module, func = target.split(":")
    script = bin_dir / "overlord"
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{code}" "$@"\n')
    script.chmod(0o755)


_CORPUS: dict[str, Path] = {}


def _corpus() -> Path:
    if "root" not in _CORPUS:
        root = Path(tempfile.mkdtemp(prefix="overlord-docs-corpus-"))
        build_corpus(root)
        (root / ".bin").mkdir()
        _overlord_command(root / ".bin")
        _CORPUS["root"] = root
    return _CORPUS["root"]


def setup(namespace: dict[str, Any]) -> None:
    """Before a page: its own copy of the corpus, as the working directory.

    The page runs as a reader would run it: a Loader's runtime is the default one,
    not the one ``tests/`` sets for its own tests (``OVERLORD_RUNTIME``).
    """
    work = Path(tempfile.mkdtemp(prefix="overlord-docs-"))
    shutil.copytree(_corpus(), work, dirs_exist_ok=True)
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_dir"] = work
    namespace["_docs_runtime"] = os.environ.pop("OVERLORD_RUNTIME", None)
    os.chdir(work)


def teardown(namespace: dict[str, Any]) -> None:
    """After a page: back to where pytest was, the page's folder removed."""
    os.chdir(namespace["_docs_cwd"])
    shutil.rmtree(namespace["_docs_dir"], ignore_errors=True)
    if namespace["_docs_runtime"] is not None:
        os.environ["OVERLORD_RUNTIME"] = namespace["_docs_runtime"]


def _shell_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(
        [str(work / ".bin"), str(Path(sys.executable).parent), env.get("PATH", "")]
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_shell(script: str, work: Path) -> None:
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=work,
        env=_shell_env(work),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"exit status {done.returncode}\n--- script\n{script}\n"
            f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
        )


def evaluate_bash(example: Any) -> None:
    """A bash block: the whole block, in the page's folder."""
    _run_shell(example.parsed, example.namespace["_docs_dir"])


def evaluate_console(example: Any) -> None:
    """A console block: its ``$ `` lines (and their continuation lines), output ignored."""
    commands: list[str] = []
    going_on = False
    for line in example.parsed.splitlines():
        if line.startswith("$ ") or going_on:
            command = line[2:] if line.startswith("$ ") and not going_on else line
            commands.append(command)
            going_on = command.rstrip().endswith("\\")
    _run_shell("\n".join(commands), example.namespace["_docs_dir"])


def evaluate_yaml(example: Any) -> None:
    """A plan: whole, loaded against the corpus; a part, merged over the quick start's plan."""
    import overlord

    data = yaml.safe_load(example.parsed)
    assert isinstance(data, dict), "a yaml block of the docs is a plan or a part of one"
    work: Path = example.namespace["_docs_dir"]
    if "sources" in data and "batch" in data:
        (work / "plan.yaml").write_text(example.parsed)
        overlord.load_plan(work / "plan.yaml")
    else:
        base = yaml.safe_load(QUICK_PLAN)
        if "sources" in data:  # the quick start's mixture names its own sources
            base.pop("mixture")
        merged = {**base, **data}
        overlord.validate_plan(merged, base_dir=work, check_files=False)


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(),
        CodeBlockParser(language="bash", evaluator=evaluate_bash),
        CodeBlockParser(language="sh", evaluator=evaluate_bash),
        CodeBlockParser(language="console", evaluator=evaluate_console),
        CodeBlockParser(language="yaml", evaluator=evaluate_yaml),
        SkipParser(),
    ],
    patterns=["README.md", "docs/*.md", "docs/*/*.md", "docs/*/*/*.md"],
    setup=setup,
    teardown=teardown,
    path=str(ROOT),
).pytest()
