"""The Ray runtime: same roles, same stream, named actors that trainer processes connect to."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks._lib.procfs import alive, below
from conftest import two_sources
from overlord import Loader, LoaderError, SourceError, connect, load_plan
from overlord.ops.run import dump_line, run_plan

pytestmark = [pytest.mark.ray, pytest.mark.integration]


@pytest.fixture
def plan_path(tmp_path: Path) -> Path:
    return two_sources(tmp_path)


def _dump(plan, steps, runtime, **kw) -> str:
    out = io.StringIO()
    run_plan(plan, steps, runtime=runtime, dump=out, progress=False, **kw)
    return out.getvalue()


def test_ray_dump_equals_the_embedded_dump_byte_for_byte(ray_session, plan_path):
    plan = load_plan(plan_path)
    assert _dump(plan, 12, "ray") == _dump(plan, 12, "inline")


def test_connected_clients_get_the_embedded_batches(ray_session, plan_path):
    plan = load_plan(plan_path)
    with Loader(plan, runtime="ray", job="t-connect"):
        clients = [connect("t-connect", rank=r, stop_step=6) for r in range(4)]
        got = [dump_line(b) for _ in range(6) for b in (next(c) for c in clients)]
        state = clients[0].state_dict()
    with Loader(plan) as loader:
        local = [loader.client(r) for r in range(4)]
        want = [dump_line(b) for _ in range(6) for b in (next(c) for c in local)]
    assert got == want
    assert state["step"] == 6


def test_a_ray_checkpoint_resumes_embedded_with_another_dp(ray_session, plan_path):
    plan = load_plan(plan_path)
    first = io.StringIO()
    with Loader(plan, runtime="ray") as loader:
        clients = [loader.client(r) for r in range(4)]
        for _ in range(5):
            for c in clients:
                first.write(dump_line(next(c)) + "\n")
        state = loader.state_dict()
    rest = _dump(plan.with_dp(2), 10, "inline", state=state)
    whole = _dump(plan, 10, "inline")

    def per_step(text):
        import json

        out = {}
        for line in text.splitlines():
            r = json.loads(line)
            out.setdefault(r["step"], []).extend(s["id"] for s in r["samples"])
        return {k: sorted(v) for k, v in out.items()}

    assert per_step(first.getvalue() + rest) == per_step(whole)


def test_a_bad_record_raises_in_the_trainer_with_its_place(ray_session, tmp_path, make_corpus):
    plan_path = make_corpus(
        tmp_path,
        sources={"web": {"files": {"data/web/a.jsonl": ['{"text": "ok"}', "{broken"]}}},
        world={"dp": 1},
        batch={"tokens_per_step": 64, "max_seq_len": 64},
    )
    with Loader(load_plan(plan_path), runtime="ray") as loader, pytest.raises(SourceError) as e:
        next(loader.client(0))
    assert e.value.source == "web" and e.value.file == "data/web/a.jsonl" and e.value.row == 1


def test_connect_errors_are_clear(ray_session, plan_path):
    with pytest.raises(LoaderError, match="no overlord job 'nope'"):
        connect("nope", rank=0)
    with Loader(load_plan(plan_path), runtime="ray", job="t-errors"):
        with pytest.raises(LoaderError, match="outside job 't-errors'"):
            connect("t-errors", rank=4)
        with pytest.raises(LoaderError, match="already running"):
            Loader(load_plan(plan_path), runtime="ray", job="t-errors")


def test_an_unreachable_cluster_fails_fast():
    # no Ray here: a child process with a fresh interpreter
    code = (
        "from overlord.runtime.ray_runtime import init_ray\n"
        "try:\n    init_ray('127.0.0.1:9')\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "LoaderError cannot reach the Ray cluster at '127.0.0.1:9'" in out.stdout
    assert time.monotonic() - t0 < 30


def test_serve_connect_and_ctrl_c(plan_path, tmp_path):
    """`overlord serve` in its own process, two trainer processes, then Ctrl-C stops it all."""
    bin_dir = Path(sys.executable).parent
    serve = subprocess.Popen(
        [str(bin_dir / "overlord"), "serve", str(plan_path), "--name", "t-serve", "--dp", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        line = ""
        while "is ready" not in line:
            line = serve.stdout.readline()
            assert line or serve.poll() is None, "serve exited before it was ready"
            assert time.monotonic() < deadline, "serve did not get ready"
        address = line.split(" on Ray at ")[1].split(":")[0:2]
        env = {**os.environ, "RAY_ADDRESS": ":".join(address)}
        trainer = (
            "import sys, overlord\n"
            "from overlord.ops.run import dump_line\n"
            "c = overlord.connect('t-serve', rank=int(sys.argv[1]), stop_step=5)\n"
            "print('\\n'.join(dump_line(b) for b in c))\n"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", trainer, str(r)], stdout=subprocess.PIPE, text=True, env=env
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs)
        served = sorted(line for out in outs for line in out.splitlines())
        local = sorted(_dump(load_plan(plan_path).with_dp(2), 5, "inline").splitlines())
        assert served == local
    finally:
        started = below(serve.pid)
        serve.send_signal(signal.SIGINT)
        rest = serve.communicate(timeout=60)[0]
    assert serve.returncode == 130, rest  # Ctrl-C: 128 + SIGINT
    assert "stopped by SIGINT" in rest
    assert started, "serve started no process of its own (no local Ray instance?)"
    deadline = time.monotonic() + 30
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(started), "processes started by `overlord serve` outlived it"


def test_a_second_serve_of_the_same_name_is_refused_without_address(plan_path, tmp_path):
    """Each serve would start a Ray of its own, where the name is free: the machine refuses."""
    bin_dir = Path(sys.executable).parent
    name = f"t-dup-{os.getpid()}"
    cmd = [str(bin_dir / "overlord"), "serve", str(plan_path), "--name", name, "--dp", "2"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        line = ""
        while "is ready" not in line:
            line = first.stdout.readline()
            assert line or first.poll() is None, "serve exited before it was ready"
            assert time.monotonic() < deadline, "serve did not get ready"
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGINT)
        rest = first.communicate(timeout=60)[0]
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"a job named '{name}' is already served on this machine" in second.stderr
    assert f"by process {first.pid}" in second.stderr and "choose another --name" in second.stderr
    assert "is ready" not in second.stdout
    assert first.returncode == 130, rest
    # the name is free again once the first serve ended
    from overlord.serve import job_lock

    with job_lock(name):
        pass


def test_loaders_pinned_to_a_node(ray_session, plan_path):
    import yaml

    data = yaml.safe_load(plan_path.read_text())
    data["placement"] = {"loader_nodes": {"web": ray_session.get_runtime_context().get_node_id()}}
    plan_path.write_text(yaml.safe_dump(data))
    with Loader(load_plan(plan_path), runtime="ray") as loader:
        assert next(loader.client(0)).samples
    data["placement"] = {"loader_nodes": {"web": "f" * 56}}
    plan_path.write_text(yaml.safe_dump(data))
    with pytest.raises(LoaderError, match="not an alive node"):
        Loader(load_plan(plan_path), runtime="ray")


def test_trainer_side_constructors_give_the_same_stream(ray_session, plan_path):
    import yaml

    data = yaml.safe_load(plan_path.read_text())
    data["placement"] = {"constructors": "trainer"}
    plan_path.write_text(yaml.safe_dump(data))
    plan = load_plan(plan_path)
    assert _dump(plan, 8, "ray") == _dump(plan, 8, "inline")
    with Loader(plan, runtime="ray", job="t-local"):
        client = connect("t-local", rank=1, stop_step=3)
        assert [b.step for b in client] == [0, 1, 2]


def test_loaders_grouped_in_fewer_processes_give_the_same_stream(ray_session, plan_path):
    import yaml

    data = yaml.safe_load(plan_path.read_text())
    data["placement"] = {"loader_processes": 1}
    plan_path.write_text(yaml.safe_dump(data))
    plan = load_plan(plan_path)
    assert _dump(plan, 8, "ray") == _dump(plan, 8, "inline")
    with Loader(plan, runtime="ray") as loader:
        # one loader group, its shadow group, the planner, 4 constructors
        assert len(loader.runtime.job_actors()) == 1 + 1 + 1 + 4
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(4):
            for c in clients:
                next(c)
        # the planner asks the group's loaders for metadata in one call to their process
        calls = loader.stats()["calls"]["by_method"]
        assert calls.get("call_each:metadata", 0) > 0
        assert "call:metadata" not in calls


def test_a_file_added_mid_run_is_not_read_by_a_loader_a_failover_starts(ray_session, tmp_path):
    """The job's files are listed once: on Ray too, a replacement loader reads the same list.

    It used to list the folder again and the job died in the constructor
    (``could not broadcast input array from shape (55,) into shape (54,)``).
    """
    from support.jobs import kill, run_job

    from conftest import make_corpus, write_file

    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {f"data/web/part-{i}.jsonl": 30 for i in range(6)}, "shadows": 0}},
            batch={"tokens_per_step": 256, "max_seq_len": 64, "prefetch_steps": 1},
            world={"dp": 1},
            loading={"timeout_s": 20},
        )
    )
    reference = run_job(plan, steps=30).lines

    def add_then_kill(loader: Loader) -> None:
        write_file(tmp_path / "data/web/part-6.jsonl", 30, tag="web/part-6")
        kill("web", 0)(loader)

    ran = run_job(plan, {(10, 0): add_then_kill}, steps=30, runtime="ray")
    assert ran.lines == reference
    assert [e["event"] for e in ran.stats["events"]] == ["failover"]


def test_groups_balanced_on_assigner_actors_give_the_embedded_stream(ray_session, plan_path):
    import yaml

    data = yaml.safe_load(plan_path.read_text())
    data["balance"]["group_ranks"] = 2  # dp 4: two groups, one assigner actor each
    plan_path.write_text(yaml.safe_dump(data))
    plan = load_plan(plan_path)
    out = io.StringIO()
    with Loader(plan, runtime="ray", job="t-assign") as loader:
        clients = [loader.client(r) for r in range(4)]
        for _ in range(8):
            out.write("".join(dump_line(next(c)) + "\n" for c in clients))
        actors = loader.runtime.job_actors()  # type: ignore[attr-defined]
    assert {"t-assign.assigner-0", "t-assign.assigner-1"} <= set(actors)
    assert out.getvalue() == _dump(plan, 8, "inline")  # there, the planner balances the groups


def test_allocators_are_made_lean_in_actors_only(ray_session):
    """Where the runtime starts a process for a role asked to be lean, and nowhere else."""
    import pyarrow as pa

    from overlord.runtime.base import RoleOptions
    from overlord.runtime.ray_runtime import RayRuntime

    pool = pa.default_memory_pool().backend_name

    class _Probe:  # local: pickled by value, the workers cannot import this module
        def pool(self) -> str:
            import pyarrow as pa

            return pa.default_memory_pool().backend_name

    runtime = RayRuntime(f"t-lean-{os.getpid()}")
    try:
        lean = runtime.spawn(_Probe, name="lean", options=RoleOptions(lean=True))
        plain = runtime.spawn(_Probe, name="plain")  # the same class, not asked to be lean
        hosted = runtime.spawn(_Probe, name="p", options=RoleOptions(host="h", lean=True))
        assert lean.call(_Probe.pool).result(timeout=60) == "system"
        assert hosted.call(_Probe.pool).result(timeout=60) == "system"
        assert plain.call(_Probe.pool).result(timeout=60) == pool
    finally:
        runtime.shutdown()
    assert pa.default_memory_pool().backend_name == pool  # the driver: the user's process


def test_actors_that_build_several_ranks_together_give_the_same_batches(ray_session, plan_path):
    base = load_plan(plan_path).with_dp(4)

    def batches(per: int, runtime: str) -> list[tuple[str, bytes, bytes, bytes]]:
        placement = base.placement.model_copy(update={"ranks_per_constructor": per})
        with Loader(base.model_copy(update={"placement": placement}), runtime=runtime) as loader:
            clients = [loader.client(r) for r in range(4)]
            got = [next(c) for _ in range(4) for c in clients]
            return [
                (dump_line(b), b.input_ids.tobytes(), b.labels.tobytes(), b.cu_seqlens.tobytes())
                for b in got
            ]

    assert batches(2, "ray") == batches(1, "inline")  # two actors of two ranks; one rank each
