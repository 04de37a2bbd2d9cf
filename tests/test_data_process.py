"""The ``process`` runtime: the roles in a data process, batches through shared memory.

Every check compares with the inline runtime run in the same test: the same
batches byte for byte (dp 1 and 2, a mesh, a resume), the same errors with
their place; and what only a second process can get wrong: a batch kept
across steps stays intact, slots are reused, no segment or process is left
behind, and a trainer killed takes its data process with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord import Loader, load_plan, validate_plan
from overlord.dist.data_server import steps_ahead
from overlord.errors import CheckpointError, RanksApart, SourceError
from overlord.ops.run import dump_line

pytestmark = pytest.mark.integration


def _plan(root: Path, dp: int) -> Path:
    return make_corpus(
        root,
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 20 + i for i in range(4)}, "loaders": 2},
            "code": {"files": {"data/code/p0.parquet": 30}, "text_field": "content"},
        },
        batch={"tokens_per_step": 1024, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": dp},
    )


def _run(plan: Any, runtime: str, steps: int, state: dict[str, Any] | None = None,
         mesh: bool = False) -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """Every rank's dump lines, step by step, rank by rank; the state at the end."""
    lines = []
    with Loader(plan, runtime=runtime, state=state) as loader:
        world = loader.plan.world
        if mesh:
            clients = [loader.rank_client(r) for r in range(world.size)]
        else:
            clients = [loader.client(r) for r in range(world.dp)]
        for _ in range(loader.start_step, steps):
            for c in clients:
                b = next(c)
                arrays = {k: v.tobytes().hex() for k, v in b.arrays().items()}
                rows = [s.row for s in b.samples]  # where each sample lies: not in a dump line
                lines.append(dump_line(b) + json.dumps([arrays, rows], sort_keys=True))
        return lines, loader.state_dict()


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def plan_path(request, tmp_path_factory) -> Path:
    return _plan(tmp_path_factory.mktemp(f"dp{request.param}"), request.param)


def test_the_data_process_gives_the_inline_runtimes_batches_byte_for_byte(plan_path):
    want, want_state = _run(load_plan(plan_path), "inline", 8)
    got, state = _run(load_plan(plan_path), "process", 8)
    assert got == want
    assert state == want_state and state["step"] == 8


def test_a_resume_from_the_data_process_continues_the_inline_stream(plan_path):
    want, _ = _run(load_plan(plan_path), "inline", 10)
    first, state = _run(load_plan(plan_path), "process", 4)
    second, end = _run(load_plan(plan_path), "process", 10, state=state)
    assert first + second == want
    assert end["step"] == 10


def test_a_mesh_gets_the_inline_rank_client_batches_and_tp_peers_share_memory(tmp_path):
    base = load_plan(_plan(tmp_path, 2))
    data = base.model_dump(mode="json")
    data["world"] = {"dp": 1, "cp": 2, "tp": 2}
    data["batch"]["cp_layout"] = "zigzag"
    plan = validate_plan(data, base_dir=base.base_dir)
    want, _ = _run(plan, "inline", 4, mesh=True)
    got, _ = _run(plan, "process", 4, mesh=True)
    assert got == want
    with Loader(plan, runtime="process") as loader:
        peers = [loader.rank_client(r) for r in range(plan.world.size)]
        batches = [next(c) for c in peers]
        tp = [r for r in range(plan.world.size) if plan.world.coords(r).tp == 1]
        first = [r for r in range(plan.world.size) if plan.world.coords(r).tp == 0]
        slots = [c.slot for c in peers]  # type: ignore[attr-defined]
        for a, b in zip(first, tp, strict=True):  # TP peers: one slot, written once
            assert slots[a] == slots[b] and batches[a].cp_rank == batches[b].cp_rank
        assert slots[first[0]] != slots[first[1]]  # CP ranks: slices of their own


def test_a_batch_kept_across_steps_keeps_its_contents_and_dropped_slots_are_reused(tmp_path):
    plan = load_plan(_plan(tmp_path, 1))
    want, _ = _run(plan, "inline", 2)
    with Loader(plan, runtime="process") as loader:
        stream = loader.client(0)
        kept = next(stream)
        copy = kept.input_ids.copy()
        for _ in range(20):
            batch = next(stream)
            del batch  # dropped: its slot goes back with the next message
        assert np.array_equal(kept.input_ids, copy)  # its slot was not written again
        assert want[0].startswith(dump_line(kept))  # and it is the inline runtime's step 0
        names = set(stream._views._maps)  # slots this trainer mapped, by name
        ahead = steps_ahead(plan.batch.prefetch_steps)
        assert len(names) <= ahead + 2, names  # reused: ahead, the kept one, the one in hand


def test_an_error_of_the_data_process_is_raised_in_the_trainer_with_its_place(tmp_path):
    bad = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": [{"text": "fine"}, "{not json", {"text": "x"}]}}},
        batch={"tokens_per_step": 512, "max_seq_len": 64},
    )
    with pytest.raises(SourceError) as inline:
        _run(load_plan(bad), "inline", 5)
    with pytest.raises(SourceError) as process:
        _run(load_plan(bad), "process", 5)
    assert "data/web/a.jsonl, row 1" in str(inline.value)
    assert str(process.value) == str(inline.value)


def test_one_rank_alone_is_refused_as_the_inline_runtime_refuses_it(tmp_path):
    plan = load_plan(_plan(tmp_path, 2))
    ahead = steps_ahead(plan.batch.prefetch_steps)
    with Loader(plan, runtime="process") as loader, pytest.raises(RanksApart, match="rank 1"):
        stream = loader.client(0)
        for _ in range(ahead + 1):
            next(stream)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_close_ends_the_data_process_and_unlinks_its_slots(tmp_path):
    plan = load_plan(_plan(tmp_path, 1))
    loader = Loader(plan, runtime="process")
    process = loader._process
    assert process is not None
    stream = loader.client(0)
    next(stream)
    prefix = stream._views._maps.copy()
    loader.close()
    assert process.proc.poll() == 0
    assert prefix and not any(Path(f"/dev/shm/{name}").exists() for name in prefix)


TRAINER = """
import sys, time
from overlord import Loader
loader = Loader(sys.argv[1], runtime="process")
stream = loader.client(0)
next(stream)
print(loader._process.pid, flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_takes_its_data_process_with_it(tmp_path):
    plan = _plan(tmp_path, 1)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(plan)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert trainer.stdout is not None
        data_pid = int(trainer.stdout.readline())
        assert _alive(data_pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 20
        while _alive(data_pid):
            assert time.monotonic() < deadline, "the data process outlived its trainer"
            time.sleep(0.1)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()


def test_a_checkpoint_is_accepted_at_its_position_and_refused_elsewhere(tmp_path):
    plan = load_plan(_plan(tmp_path, 1))
    with Loader(plan, runtime="process") as loader:
        stream = loader.client(0)
        start = stream.state_dict()
        stream.load_state_dict(start)  # where it is: accepted
        next(stream)
        later = stream.state_dict()
        assert later["step"] == 1
        with pytest.raises(CheckpointError, match="found step 1"):
            stream.load_state_dict(start)
        stream.load_state_dict(later)
        assert next(stream).step == 1


def test_reports_reach_the_planner_through_the_data_process(tmp_path: Path) -> None:
    """A trainer's step times, sent through the data process, refit the planner's model."""
    plan = load_plan(_plan(tmp_path, 2))
    data = plan.model_dump(mode="json")
    data["balance"]["cost"] = {"alpha": 1.0, "beta": 0.005}
    data["balance"]["refit"] = {"every": 4, "window": 8, "min_samples": 4}
    plan = validate_plan(data, base_dir=plan.base_dir)
    true_beta = 0.02
    costs = []
    with Loader(plan, runtime="process") as loader:
        clients = [loader.client(r) for r in range(2)]
        with pytest.raises(ValueError, match="'nope'"):  # checked at the call, by the plan's names
            next(clients[0])
            clients[0].report(0, 1.0, {"nope": 1.0})
        next(clients[1])
        for _ in range(1, 20):
            for c in clients:
                b = next(c)
                t = np.array([s.tokens for s in b.samples], dtype=np.float64)
                costs.append((b.step, float(b.cost), t))
                c.report(b.step, seconds=float(t.sum() + true_beta * (t * t).sum()))
            time.sleep(0.01)  # one way: the reports reach the planner while steps are planned
    step, cost, t = costs[-1]
    assert cost == pytest.approx(float((t + true_beta * t * t).sum()), rel=1e-6), step
