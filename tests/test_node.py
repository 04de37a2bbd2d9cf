"""torchrun on one node without Ray: every rank gets its embedded batches; sources read once."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.jobs import run_job
from support.node_worker import digest

from conftest import make_corpus
from overlord import Loader, LoaderError, load_plan, validate_plan

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

WORKER = Path(__file__).parent / "support" / "node_worker.py"
RANKS = 4


def torchrun(
    plan: Path,
    out: Path,
    steps: int,
    state: Path | None = None,
    dataset: bool = False,
    loader: bool = False,
    mesh: bool = False,
) -> list[dict[str, Any]]:
    """Run the worker on ``RANKS`` CPU processes; each rank's result."""
    args = [str(plan), str(out), str(steps)] + ([str(state)] if state else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    env = {**os.environ, **({"OVERLORD_TEST_DATASET": "1"} if dataset else {})}
    env |= {"OVERLORD_TEST_LOADER": "1"} if loader else {}
    env |= {"OVERLORD_TEST_MESH": "1"} if mesh else {}
    done = subprocess.run(
        [*cmd, f"--nproc_per_node={RANKS}", str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    return make_corpus(
        tmp_path_factory.mktemp("node"),
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 20 + i for i in range(4)}, "loaders": 2},
            "code": {"files": {"data/code/p0.parquet": 30}, "text_field": "content"},
        },
        batch={"tokens_per_step": 1024, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": RANKS},
    )


def test_every_rank_gets_the_batches_the_embedded_runtime_gives_it(plan_path, tmp_path):
    want = run_job(load_plan(plan_path), steps=8).lines  # step by step, rank by rank
    got = torchrun(plan_path, tmp_path / "run", 8)
    assert all(r["error"] is None and r["kind"] == "NodeClient" for r in got)
    for rank, result in enumerate(got):
        assert result["lines"] == want[rank::RANKS]
    # every rank holds the same state at the same position: a synchronous checkpoint
    assert all(r["state"] == got[0]["state"] for r in got) and got[0]["state"]["step"] == 8
    assert all(r["start"]["step"] == 0 for r in got)


def test_overlord_loader_under_torchrun_is_the_nodes_loader(plan_path, tmp_path):
    """``overlord.Loader(plan)`` in every torchrun process: rank 0 reads, each rank its batches."""
    want = run_job(load_plan(plan_path), steps=8)
    got = torchrun(plan_path, tmp_path / "run", 8, loader=True)
    assert all(r["error"] is None and r["kind"] == "node" for r in got)
    for rank, result in enumerate(got):
        assert result["lines"] == want.lines[rank::RANKS]
        assert result["loader_state"] == result["state"] and result["state"]["step"] == 8
    # the sources were read once, by rank 0's loaders: as many records as one process reads
    assert got[0]["records"] == sum(s["records"] for s in want.stats["loaders"])
    # rank 0 hosts the node's loaders: their allocators, as a Ray loader process's; the
    # other ranks' are left as they were
    import pyarrow as pa

    assert got[0]["arrow_pool"] == "system"
    assert {r["arrow_pool"] for r in got[1:]} == {pa.default_memory_pool().backend_name}
    assert pa.default_memory_pool().backend_name != "system"  # else the check proves nothing


def test_a_checkpoint_taken_under_torchrun_resumes_there(plan_path, tmp_path):
    want = run_job(load_plan(plan_path), steps=10).lines
    first = torchrun(plan_path, tmp_path / "a", 4)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[2]["state"]))  # any rank's: they are the same
    second = torchrun(plan_path, tmp_path / "b", 10, state)
    for rank in range(RANKS):
        assert first[rank]["lines"] + second[rank]["lines"] == want[rank::RANKS]
    assert all(r["start"]["step"] == 4 for r in second)


def test_an_error_of_the_nodes_loader_reaches_every_rank_with_its_place(tmp_path):
    bad = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": [{"text": "fine"}, "{not json", {"text": "x"}]}}},
        world={"dp": RANKS},
        batch={"tokens_per_step": 512, "max_seq_len": 64},
    )
    got = torchrun(bad, tmp_path / "run", 5)
    for result in got:
        assert "the node's Loader (rank 0) failed" in result["error"]
        assert "data/web/a.jsonl, row 1" in result["error"]


def test_the_pytorch_dataset_from_a_plan_uses_the_nodes_loader_under_torchrun(plan_path, tmp_path):
    want: list[list[str]] = [[] for _ in range(RANKS)]
    with Loader(load_plan(plan_path)) as loader:
        clients = [loader.client(r) for r in range(RANKS)]
        for _ in range(6):
            for r, c in enumerate(clients):
                ids = next(c).input_ids.astype("int64").tobytes()
                want[r].append(hashlib.sha256(ids).hexdigest())
    got = torchrun(plan_path, tmp_path / "ds", 6, dataset=True)
    assert [r["lines"] for r in got] == want
    assert all(r["state"]["step"] == 6 for r in got)


def test_a_mesh_under_torchrun_gets_the_embedded_rank_client_batches(plan_path, tmp_path):
    """dp 1 x cp 2 x tp 2 on 4 processes: each its CP slice; TP peers the same batches."""
    plan = load_plan(plan_path)
    data = plan.model_dump(mode="json")
    data["world"] = {"dp": 1, "cp": 2, "tp": 2}
    (tmp_path / "data").symlink_to(plan.base_dir / "data")
    path = tmp_path / "mesh.yaml"
    path.write_text(json.dumps(data))
    mesh = validate_plan(data, base_dir=tmp_path)
    want: list[list[Any]] = [[] for _ in range(RANKS)]
    with Loader(mesh) as loader:
        clients = [loader.rank_client(g) for g in range(RANKS)]
        for _ in range(5):
            for g, c in enumerate(clients):
                want[g].append(json.loads(json.dumps(digest(next(c)))))
    got = torchrun(path, tmp_path / "mesh", 5, mesh=True)
    assert all(r["error"] is None and r["kind"] == "node" for r in got)
    assert [r["lines"] for r in got] == want
    # TP peers (global ranks 0, 1 and 2, 3) received equal batches; the CP ranks their slices
    assert got[0]["lines"] == got[1]["lines"] != got[2]["lines"] == got[3]["lines"]
    assert {line[3] for line in got[2]["lines"]} == {1}
    assert all(r["state"] == got[0]["state"] and r["state"]["step"] == 5 for r in got)
    assert "use Loader.rank_client(global_rank)" in got[0]["client_error"]


def test_a_node_loader_of_a_mesh_takes_this_process_global_rank_only(plan_path, monkeypatch):
    data = load_plan(plan_path).model_dump(mode="json")
    data["world"] = {"dp": 1, "cp": 2, "tp": 2}
    mesh = validate_plan(data, base_dir=load_plan(plan_path).base_dir)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    loader = Loader(mesh)  # no process group yet: that starts with the first batch
    assert loader.node
    with pytest.raises(ValueError, match=r"\(this process: rank_client\(1\)\)"):
        loader.client(1)
    with pytest.raises(ValueError, match="this process is global rank 1"):
        loader.rank_client(2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(LoaderError, match=r"set world.dp to 2"):
        Loader(mesh)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="not a multiple of cp\\*tp\\*pp=4"):
        Loader(mesh)
