"""torchrun on one node without Ray: every rank gets its embedded batches; sources read once."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
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
    report: bool = False,
    runtime: str = "inline",
) -> list[dict[str, Any]]:
    """Run the worker on ``RANKS`` CPU processes; each rank's result."""
    args = [str(plan), str(out), str(steps)] + ([str(state)] if state else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    env = {**os.environ, **({"OVERLORD_TEST_DATASET": "1"} if dataset else {})}
    env.pop("OVERLORD_RUNTIME", None)  # the workers' default is a user's
    env |= {"OVERLORD_TEST_LOADER": "1"} if loader else {}
    env |= {"OVERLORD_TEST_MESH": "1"} if mesh else {}
    env |= {"OVERLORD_TEST_REPORT": "1"} if report else {}
    env |= {"OVERLORD_TEST_RUNTIME": runtime}
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


@pytest.mark.parametrize(
    "runtime, kind",
    [("inline", "NodeClient"), ("process", "ProcessStream"), ("default", "ProcessStream")],
)  # inline: rank 0 hosts the node's roles; process (the default): one data process serves all
def test_every_rank_gets_the_batches_the_embedded_runtime_gives_it(
    plan_path, tmp_path, runtime, kind
):
    want = run_job(load_plan(plan_path), steps=8).lines  # step by step, rank by rank
    got = torchrun(plan_path, tmp_path / "run", 8, runtime=runtime)
    assert all(r["error"] is None and r["kind"] == kind for r in got)
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


def test_every_ranks_reports_reach_the_nodes_planner_and_the_stream_is_unchanged(
    plan_path, tmp_path
):
    want = run_job(load_plan(plan_path), steps=6).lines
    got = torchrun(plan_path, tmp_path / "run", 6, report=True)
    assert all(r["error"] is None for r in got)
    for rank, result in enumerate(got):
        assert result["lines"] == want[rank::RANKS]
    fb = got[0]["feedback"]
    assert (fb["received"], fb["dropped"]) == (RANKS * 6, 0)


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


def mesh_plan(plan_path: Path, tmp_path: Path) -> tuple[Path, Any]:
    """The job's plan on a dp 1 x cp 2 x tp 2 mesh, written beside its data: its path and plan."""
    plan = load_plan(plan_path)
    data = plan.model_dump(mode="json")
    data["world"] = {"dp": 1, "cp": 2, "tp": 2}
    (tmp_path / "data").symlink_to(plan.base_dir / "data")
    path = tmp_path / "mesh.yaml"
    path.write_text(json.dumps(data))
    return path, validate_plan(data, base_dir=tmp_path)


def test_a_mesh_under_torchrun_gets_the_embedded_rank_client_batches(plan_path, tmp_path):
    """dp 1 x cp 2 x tp 2 on 4 processes: each its CP slice; TP peers the same batches."""
    path, mesh = mesh_plan(plan_path, tmp_path)
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


def test_under_torchrun_the_data_process_is_the_default_and_its_roles_are_not_at_hand(
    plan_path, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", str(RANKS))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("OVERLORD_RUNTIME")  # a user's default
    loader = Loader(plan_path)  # nothing starts before the first batch
    assert loader.node and loader._runtime == "process"  # noqa: SLF001
    for ask in (loader.stats, loader.monitor, lambda: loader.set_threads("web", 2)):
        with pytest.raises(LoaderError, match="node's roles run in its data process"):
            ask()
    hosted = Loader(plan_path, runtime="inline")  # rank 0 hosts: its stats once it runs
    assert hosted.node and hosted._runtime == "inline"  # noqa: SLF001
    with pytest.raises(LoaderError, match="under torchrun the node's Loader is rank 0's"):
        hosted.set_threads("web", 2)


KILL_WORKER = Path(__file__).parent / "support" / "node_kill_worker.py"
TIMEOUT_S = 20  # the plan's loading.timeout_s: the bound on every rank's end


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _by_hand(
    plan: Path, out: Path, raises: int = -1, runtime: str = "inline"
) -> list[subprocess.Popen[bytes]]:
    """``RANKS`` processes started as a scheduler starts them: the environment, no agent.

    Rank ``raises`` dies of an uncaught exception at step 3.
    """
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["WORLD_SIZE"] = str(RANKS)
    env["OVERLORD_TEST_RUNTIME"] = runtime
    env.pop("LOCAL_WORLD_SIZE", None)
    env.pop("OVERLORD_RUNTIME", None)  # the workers' default is a user's
    procs = []
    for r in range(RANKS):
        with open(f"{out}.{r}.err", "w") as err:  # the child holds its own copy
            cmd = [sys.executable, str(KILL_WORKER), str(plan), str(out)]
            env_r = {**env, "RANK": str(r)} | ({"OVERLORD_TEST_RAISE": "1"} if r == raises else {})
            procs.append(subprocess.Popen(cmd, env=env_r, stdout=subprocess.DEVNULL, stderr=err))
    return procs


@pytest.fixture(scope="module")
def short_plan(tmp_path_factory) -> Path:
    return make_corpus(
        tmp_path_factory.mktemp("kill"),
        {"web": {"files": {f"data/web/p{i}.jsonl": 40 for i in range(2)}}},
        batch={"tokens_per_step": 512, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": RANKS},
        loading={"timeout_s": TIMEOUT_S},
    )


@pytest.mark.parametrize("runtime", ["inline", "process"])
@pytest.mark.parametrize(
    ("death", "victim"), [("SIGKILL", 2), ("SIGKILL", 0), ("raise", 1), ("raise", 0)]
)
def test_a_rank_that_dies_without_torchrun_fails_every_other_rank_naming_it(
    short_plan, tmp_path, death, victim, runtime
):
    """A process killed, or dead of its own exception: every other one raises, naming it.

    Within loading.timeout_s, and every process ends (the one that raised too:
    it does not wait for an orderly end that would never come).
    """
    out = tmp_path / "run"
    procs = _by_hand(short_plan, out, raises=victim if death == "raise" else -1, runtime=runtime)
    try:
        deadline = time.monotonic() + 120
        while not all(Path(f"{out}.{r}.step").exists() for r in range(RANKS)):
            assert time.monotonic() < deadline, "the ranks never started"
            errors = [Path(f"{out}.{r}.err").read_text() for r in range(RANKS)]
            assert death == "raise" or all(p.poll() is None for p in procs), errors
            time.sleep(0.1)
        if death == "SIGKILL":
            procs[victim].send_signal(signal.SIGKILL)
            killed = time.time()
        for p in procs:
            p.wait(timeout=TIMEOUT_S + 30)  # the process ends, not only its stream
        if death == "raise":
            killed = float(Path(f"{out}.{victim}.raised").read_text())
            assert "a trainer's bug at step 3" in Path(f"{out}.{victim}.err").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if runtime == "process":  # rank 0's data process ended too (its argv names its parent)
        deadline = time.monotonic() + 20
        while _data_processes_of(procs[0].pid):
            assert time.monotonic() < deadline, "the data process outlived the node's ranks"
            time.sleep(0.1)
    for r, p in enumerate(procs):
        if r == victim:
            continue
        result = json.loads(Path(f"{out}.{r}").read_text())
        assert f"rank {victim}" in result["error"], result["error"]
        assert result["at"] - killed < TIMEOUT_S, (r, result["at"] - killed)
        err = Path(f"{out}.{r}.err").read_text()
        assert p.returncode == 1, (r, p.returncode, err)  # the worker's own exit, no abort
        assert "terminate called" not in err


def _data_processes_of(parent: int) -> list[int]:
    """Live data processes of ``parent`` (``python -m overlord.ops.data_process FD PID``)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
            state = (cmdline.parent / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        ours = b"overlord.ops.data_process" in argv and str(parent).encode() in argv[-3:]
        if ours and state != "Z":
            found.append(int(cmdline.parent.name))
    return found


def test_rank_0_hosts_nothing_and_a_resume_continues_with_the_data_process(plan_path, tmp_path):
    want = run_job(load_plan(plan_path), steps=10).lines
    first = torchrun(plan_path, tmp_path / "a", 4, loader=True, runtime="process")
    assert all(r["error"] is None and r["kind"] == "node" for r in first)
    import pyarrow as pa

    # the loaders run in the data process: rank 0's allocators are left as every rank's
    assert {r["arrow_pool"] for r in first} == {pa.default_memory_pool().backend_name} != {"system"}
    assert all(r["loader_state"] == r["state"] for r in first)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[1]["state"]))
    second = torchrun(plan_path, tmp_path / "b", 10, state, loader=True, runtime="process")
    for rank in range(RANKS):
        assert first[rank]["lines"] + second[rank]["lines"] == want[rank::RANKS]


def test_a_mesh_and_the_dataset_under_torchrun_with_the_data_process(plan_path, tmp_path):
    path, mesh = mesh_plan(plan_path, tmp_path)
    want: list[list[Any]] = [[] for _ in range(RANKS)]
    with Loader(mesh) as loader:
        clients = [loader.rank_client(g) for g in range(RANKS)]
        for _ in range(5):
            for g, c in enumerate(clients):
                want[g].append(json.loads(json.dumps(digest(next(c)))))
    got = torchrun(path, tmp_path / "mesh", 5, mesh=True, runtime="process")
    assert [r["lines"] for r in got] == want
    assert all(r["state"] == got[0]["state"] and r["state"]["step"] == 5 for r in got)
    ds = torchrun(plan_path, tmp_path / "ds", 6, dataset=True, runtime="process")
    inline = torchrun(plan_path, tmp_path / "ds-inline", 6, dataset=True)
    assert [r["lines"] for r in ds] == [r["lines"] for r in inline]


DOCS = Path(__file__).resolve().parents[1]
TORCHRUN_PAGE = DOCS / "docs" / "guides" / "torchrun.md"
SCRIPT = "a torchrun script: tests/test_node.py runs it as written"


def _scripts(page: Path) -> list[str]:
    """The page's python blocks marked as torchrun scripts, as written."""
    lines, found = page.read_text().split("\n"), []
    for i, line in enumerate(lines):
        if SCRIPT in line and lines[i + 1] == "```python":
            end = lines.index("```", i + 2)
            found.append("\n".join(lines[i + 2 : end]) + "\n")
    return found


def _docs_corpus(root: Path) -> None:
    """The corpus and quick start plan every docs page runs against (the root conftest.py's)."""
    spec = importlib.util.spec_from_file_location("docs_conftest", DOCS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_corpus(root)


# a loop left early, nothing closed: the process's exit ends node mode
BREAK = """import torch.distributed as dist

import overlord

dist.init_process_group("gloo")
loader = overlord.Loader("plan.yaml")
for batch in loader.client(dist.get_rank()):
    if batch.step == 5:
        break
"""


def test_the_guides_torchrun_scripts_exit_0_on_every_rank_as_written(tmp_path):
    """Run as a user runs them: torchrun, 2 CPU processes, nothing closed by hand."""
    scripts = _scripts(TORCHRUN_PAGE)
    assert len(scripts) == 2  # the DataLoader one and the Loader one
    _docs_corpus(tmp_path)
    for n, script in enumerate([*scripts, BREAK]):
        (tmp_path / "train.py").write_text(script)
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node=2", "train.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"script {n}:\n{script}\n{output[-4000:]}"
        assert "Traceback" not in output and "terminate called" not in output, output[-4000:]


LISTEN_WORKER = Path(__file__).parent / "support" / "node_listen_worker.py"
# a namespace of its own where the host name is an address other than loopback (on lo), as
# a real machine's resolves to its network address: what gloo binds by default
NAMESPACE = """ip link set lo up && ip addr add 10.99.0.1/32 dev lo && hostname 10.99.0.1
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 "$0" "$1" "$2" &
done
wait"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
    reason="needs root, unshare and ip for a network namespace of its own",
)
def test_node_modes_group_listens_on_loopback_only_with_a_loopback_master(tmp_path):
    out = tmp_path / "listen"
    cmd = ["unshare", "-n", "-u", "sh", "-c", NAMESPACE, sys.executable, str(LISTEN_WORKER)]
    done = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        # the trainer's own group binds the host name's address: the check can fail
        assert any(a.startswith("10.99.0.1:") for a in got["trainer"]), got
        assert got["node"] and all(a.startswith("127.0.0.1:") for a in got["node"]), got
