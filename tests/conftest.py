"""Shared fixtures: small corpora and data plans written into a test's tmp_path.

``make_corpus(root, sources=..., **plan_overrides)`` writes every file of a
corpus and a ``plan.yaml`` next to them, and returns the plan's path. A source
is given as

- an int: one JSONL shard ``data/NAME/part-0.jsonl`` with that many documents;
- a dict ``{"files": {relpath: content, ...}, **source_fields}``, where
  ``source_fields`` go into the plan's source entry as they are (``path``
  defaults to ``data/NAME/*``, ``format`` to the first file's kind).

A file's content is an int (that many generated documents), a list of records
(a ``str`` is written as a raw line, anything else as JSON; for Parquet, a list
of dicts), a ``pyarrow.Table`` (Parquet), or ``bytes``/``str`` written verbatim.
Names ending ``.gz`` or ``.zst`` are compressed. Plan overrides are merged into
the default plan key by key; ``None`` removes a key.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

# The tests run the roles in their own process (the inline runtime), where a test can reach
# and kill them; a Loader's default runs them in a data process, which the tests that check
# it name (test_data_process, test_node, test_default_runtime), or unset this for.
os.environ["OVERLORD_RUNTIME"] = "inline"

DEFAULT_PLAN: dict[str, Any] = {
    "seed": 1234,
    "tokenizer": {"kind": "bytes"},
    "batch": {"tokens_per_step": 256, "max_seq_len": 64, "long_docs": "split"},
    "world": {"dp": 2},
    "balance": {"method": "kk", "cost": {"alpha": 1.0, "beta": 0.0}},
    "on_error": "fail",
    # small, so that a test whose loader cannot deliver fails in seconds, never hangs
    "loading": {"timeout_s": 5},
}

DEFAULT_SOURCES: dict[str, Any] = {
    "web": {"files": {"data/web/part-0.jsonl": 12, "data/web/part-1.jsonl": 12}},
    "code": {"files": {"data/code/part-0.parquet": 10}, "text_field": "content"},
}


def doc_text(tag: str, i: int) -> str:
    """A document of 12 to about 50 UTF-8 bytes that says where it comes from."""
    return f"{tag} doc {i} " + "abcdefghij"[: i % 10] * (1 + i % 4)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _is_parquet(rel: str) -> bool:
    return ".parquet" in Path(rel).name


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    elif path.name.endswith((".zst", ".zstd")):
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(data)
    else:
        path.write_bytes(data)


def write_file(path: Path, content: Any, text_field: str = "text", tag: str = "") -> None:
    """Write one shard; see the module docstring for what ``content`` may be."""
    if isinstance(content, int):
        tag = tag or path.name.split(".")[0]
        content = [{text_field: doc_text(tag, i), "n": i} for i in range(content)]
    if isinstance(content, bytes):
        _write_bytes(path, content)
    elif isinstance(content, str):
        _write_bytes(path, content.encode())
    elif _is_parquet(path.name):
        table = content if isinstance(content, pa.Table) else pa.Table.from_pylist(content)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
    else:
        lines = [r if isinstance(r, str) else json.dumps(r) for r in content]
        _write_bytes(path, "".join(line + "\n" for line in lines).encode())


def on_threads(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[str]]:
    """``fn`` wrapped to note the name of the thread of each call; and the names noted."""
    names: list[str] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        names.append(threading.current_thread().name)
        return fn(*args, **kwargs)

    return wrapped, names


def make_corpus(
    root: Path,
    sources: dict[str, Any] | None = None,
    plan_name: str = "plan.yaml",
    **overrides: Any,
) -> Path:
    """Write a corpus and its plan under ``root``; return the plan's path."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, spec in (DEFAULT_SOURCES if sources is None else sources).items():
        if isinstance(spec, int):
            spec = {"files": {f"data/{name}/part-0.jsonl": spec}}
        spec = dict(spec)
        files: dict[str, Any] = spec.pop("files", {})
        text_field = spec.get("text_field", "text")
        for rel, content in files.items():
            tag = f"{name}/{rel.rsplit('/', 1)[-1].split('.')[0]}"
            write_file(root / rel, content, text_field, tag)
        first = next(iter(files), "")
        entry = {
            "name": name,
            "path": f"data/{name}/*",
            "format": "parquet" if _is_parquet(first) else "jsonl",
            **spec,
        }
        entries.append(entry)
    plan = _merge({"seed": DEFAULT_PLAN["seed"], "sources": entries, **DEFAULT_PLAN}, overrides)
    path = root / plan_name
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def two_sources(root: Path, dp: int = 4, timeout_s: float = 20, **overrides: Any) -> Path:
    """The corpus of the Ray tests: 3 JSONL shards read by 2 loaders and a Parquet file."""
    return make_corpus(
        root,
        sources={
            "web": {"files": {f"data/web/part-{i}.jsonl": 30 for i in range(3)}, "loaders": 2},
            "code": {"files": {"data/code/part-0.parquet": 25}, "text_field": "content"},
        },
        batch={"tokens_per_step": 512, "max_seq_len": 64},
        world={"dp": dp},
        loading={"timeout_s": timeout_s},
        **overrides,
    )


@pytest.fixture(name="make_corpus")
def _make_corpus_fixture() -> Callable[..., Path]:
    """``make_corpus(root, sources=None, **plan_overrides) -> plan path``."""
    return make_corpus


@pytest.fixture
def default_corpus(tmp_path: Path) -> Path:
    """The default two-source corpus (two JSONL shards, one Parquet shard); its plan's path."""
    return make_corpus(tmp_path)


@pytest.fixture(scope="module")
def job_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small two-source job for one rank: web (3 files, 2 loaders) and code (1 file)."""
    return make_corpus(
        tmp_path_factory.mktemp("job"),
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 9 for i in range(3)}, "loaders": 2},
            "code": {"files": {"data/code/p0.jsonl": 14}},
        },
        batch={"tokens_per_step": 256, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": 1},
    )


def consume(plan: Any, steps: int, **loader_kwargs: Any) -> list[Any]:
    """Every rank's batch of steps 0..steps-1, step by step, as a trainer would take them."""
    from overlord import Loader

    out = []
    with Loader(plan, **loader_kwargs) as loader:
        clients = [loader.client(r) for r in range(loader.plan.world.dp)]
        for _ in range(steps):
            out += [next(c) for c in clients]
    return out


@pytest.fixture(name="consume")
def _consume_fixture() -> Callable[..., list[Any]]:
    """``consume(plan, steps) -> list of batches`` (every rank, step by step)."""
    return consume


def overlord_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m overlord.ops.cli ARGS`` in a child process, as a user would from a shell."""
    return subprocess.run(
        [sys.executable, "-m", "overlord.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(name="overlord_cli")
def _overlord_cli_fixture() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``overlord_cli(*args) -> CompletedProcess`` (stdout and stderr as text)."""
    return overlord_cli


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Ray tests run only inside tools/loopback, where Ray cannot leave 127.0.0.1."""
    import os

    if not os.environ.get("OVERLORD_NO_NETNS"):
        return
    skip = pytest.mark.skip(reason="needs a loopback-only network namespace (tools/loopback)")
    for item in items:
        if "ray" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session() -> Any:
    """One local Ray instance for every Ray test of the session."""
    ray = pytest.importorskip("ray")
    from overlord.runtime.ray_runtime import init_ray

    started = init_ray(None)
    yield ray
    if started:
        ray.shutdown()
