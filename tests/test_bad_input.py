"""Bad input met by a running job: empty sources, loaders that die, stall or outnumber shards.

Each test runs a whole Loader (or the ``overlord run`` command): what is checked
is that the error reaches the trainer naming its place, and that nothing hangs.
Plans use ``loading.timeout_s: 5`` (conftest), so a loader that cannot deliver
fails the test instead of blocking it. Errors of one module are tested beside it:
plans in ``test_spec.py``, records in ``test_formats.py``, long documents in
``test_shard.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.runs import run

from conftest import make_corpus
from overlord import Loader, LoaderError, PlanError, SourceError, load_plan
from overlord.ops.run import dump_line

pytestmark = pytest.mark.integration  # every test runs a Loader


# ---- empty sources -----------------------------------------------------------------------------

EMPTY = {
    "empty file": (b"", "fail"),
    "blank lines only": (b"\n  \n\n", "fail"),
    "every record bad (skip)": (b'{"body": 1}\n[1, 2]\n{"text": "cut\n', "skip"),
}


@pytest.mark.parametrize("case", list(EMPTY))
def test_empty_source_is_a_clear_error_not_a_hang(tmp_path: Path, case: str) -> None:
    data, on_error = EMPTY[case]
    sources = {"web": 6, "empty": {"files": {"data/empty/part-0.jsonl": data}}}
    plan = make_corpus(tmp_path, sources, on_error=on_error)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as e:
        run(plan, 3)
    assert time.monotonic() - t0 < 5
    assert e.value.source == "empty"
    assert "no sample" in e.value.reason


def test_source_whose_every_document_is_dropped_is_a_clear_error(tmp_path: Path) -> None:
    records = [{"text": "x" * 100} for _ in range(3)]
    plan = make_corpus(
        tmp_path,
        {"long": {"files": {"data/long/part-0.jsonl": records}}},
        batch={"long_docs": "drop"},
    )
    with pytest.raises(SourceError) as e:
        run(plan, 1)
    assert e.value.source == "long" and "dropped" in e.value.reason


# ---- a loader that dies ------------------------------------------------------------------------


def test_shard_deleted_mid_run_raises_in_the_trainer_with_where(tmp_path: Path) -> None:
    files = {f"data/web/part-{i}.jsonl": 8 for i in range(4)}
    # a small read-ahead budget: the loader must come back to the files in later epochs
    plan = make_corpus(
        tmp_path, {"web": {"files": files}}, batch={"prefetch_steps": 1, "lookahead": 2}
    )
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(2)]
        for c in clients:
            next(c)
        for rel in files:
            (tmp_path / rel).unlink()
        t0 = time.monotonic()
        with pytest.raises(SourceError) as e:
            for _ in range(100):
                for c in clients:
                    next(c)
        assert time.monotonic() - t0 < 5
    assert e.value.source == "web"
    assert e.value.file in files and e.value.row is None
    assert "cannot read file" in e.value.reason
    assert f"source 'web', file {e.value.file}: " in str(e.value)


def test_shard_deleted_after_load_plan_before_any_read(tmp_path: Path) -> None:
    plan_path = make_corpus(
        tmp_path, {"web": {"files": {"data/web/a.jsonl": 5, "data/web/b.jsonl": 5}}}
    )
    plan = load_plan(plan_path)
    (tmp_path / "data/web/a.jsonl").unlink()
    (tmp_path / "data/web/b.jsonl").unlink()
    with pytest.raises(PlanError) as e:
        run(plan, 1)
    assert "'data/web/*' matches no file" in str(e.value)


def test_loader_crash_is_reraised_in_the_trainer_naming_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import overlord.roles.read_ahead as sl

    def broken(*args: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(sl, "cut_items", broken)
    plan = make_corpus(tmp_path, {"web": 4})
    with pytest.raises(LoaderError) as e:
        run(plan, 1)
    assert "SourceLoader web[0] failed: RuntimeError: disk on fire" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_stuck_loader_times_out_naming_source_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import overlord.roles.read_ahead as sl

    release = threading.Event()
    real = sl.shard_windows

    def slow(*args: Any) -> Any:
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(sl, "shard_windows", slow)
    plan = make_corpus(tmp_path, {"web": 4}, loading={"timeout_s": 0.3})
    with Loader(plan) as loader:
        client = loader.client(0)
        t0 = time.monotonic()
        try:
            with pytest.raises(LoaderError) as e:
                next(client)
        finally:
            release.set()
        assert time.monotonic() - t0 < 3
    msg = str(e.value)
    assert "SourceLoader web[0] produced no data" in msg
    assert "data/web/part-0.jsonl" in msg and "loading.timeout_s" in msg


def test_more_loaders_than_shards_neither_spins_nor_stalls(tmp_path: Path) -> None:
    # loader web[1] owns no shard. A stall would hit loading.timeout_s (a LoaderError); a
    # loader spinning over no shard would outlive the Loader's close; and the loader count
    # never changes the stream, so two loaders deliver exactly what one delivers
    streams = {}
    for loaders in (1, 2):
        before = set(threading.enumerate())
        files = {"data/web/a.jsonl": 6}
        plan = make_corpus(
            tmp_path / f"loaders-{loaders}", {"web": {"files": files, "loaders": loaders}}
        )
        batches, _ = run(plan, 4)
        left = [
            t.name
            for t in threading.enumerate()
            if t not in before and t.name.startswith("overlord-loader-")
        ]
        assert left == [], f"loader threads still alive after the Loader closed: {left}"
        streams[loaders] = [dump_line(b) for b in batches]
    assert len(streams[1]) == 4 * 2  # steps x ranks
    assert streams[2] == streams[1]


# ---- ranks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_client_rank_outside_the_world(tmp_path: Path, rank: int) -> None:
    with Loader(make_corpus(tmp_path)) as loader, pytest.raises(ValueError) as e:
        loader.client(rank)
    assert f"rank {rank} is outside the plan's world: dp=2, ranks 0..1" in str(e.value)
