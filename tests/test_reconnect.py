"""Trainers restart against a live job: every trainer process killed, reconnected from a checkpoint.

The job (served on Ray by this process) keeps running; the trainers are
processes of their own that checkpoint every few steps and die by SIGKILL at
a random step; new ones reconnect with the last checkpoint's state. What
every rank receives must be the uninterrupted stream, and the SourceLoaders
the same processes.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import two_sources
from overlord import Loader, LoaderError, load_plan
from overlord.ops.run import run_plan
from overlord.plan.spec import validate_plan

pytestmark = [pytest.mark.ray, pytest.mark.integration]

STEPS, EVERY, DP = 14, 3, 2

TRAINER = """
import json, os, signal, sys
from pathlib import Path
import overlord
from overlord import checkpoint
from overlord.ops.run import dump_line

job, rank, out, ckpt, stop, die_at = sys.argv[1:7]
rank, stop, die_at = int(rank), int(stop), int(die_at)
mine = Path(ckpt) / f"rank-{rank}"
state = checkpoint.load(mine) if mine.is_dir() and any(mine.iterdir()) else None
client = overlord.connect(job, rank=rank, stop_step=stop, state=state)
with open(out, "a") as f:
    for batch in client:
        f.write(dump_line(batch) + "\\n")
        f.flush()
        if (batch.step + 1) % int(os.environ["EVERY"]) == 0:
            checkpoint.save(mine, client.state_dict())
        if batch.step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
client.close()
"""


@pytest.fixture
def plan(tmp_path: Path):
    path = two_sources(tmp_path, dp=DP, timeout_s=30, recovery={"rewind_steps": 8})
    return load_plan(path)


def trainers(job: str, out: Path, ckpt: Path, die_at: int) -> None:
    import ray

    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "EVERY": str(EVERY),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TRAINER,
                job,
                str(r),
                str(out),
                str(ckpt),
                str(STEPS),
                str(die_at),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(DP)
    ]
    for p in procs:
        err = p.communicate(timeout=120)[1]
        assert p.returncode in (0, -9), err[-3000:]


def loader_pids(loader: Loader) -> set[int]:
    return {s["pid"] for s in loader.stats()["loaders"]}


def test_trainers_killed_at_a_random_step_reconnect_from_their_checkpoint(
    ray_session, plan, tmp_path
):
    reference = io.StringIO()
    run_plan(plan, STEPS, dump=reference, progress=False)
    want = {(d["step"], d["rank"]): line for line in reference.getvalue().splitlines()
            for d in [json.loads(line)]}  # fmt: skip
    die_at = random.Random(os.getpid()).randrange(EVERY + 1, STEPS - 2)
    out, ckpt = tmp_path / "dump.jsonl", tmp_path / "ckpt"
    with Loader(plan, runtime="ray", job="rewind-ci") as loader:
        before = loader_pids(loader)
        trainers("rewind-ci", out, ckpt, die_at)  # every trainer dies after step die_at
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert max(d["step"] for d in got) == die_at
        trainers("rewind-ci", out, ckpt, -1)  # new processes, from the last checkpoint
        after = loader_pids(loader)
        events = [e["event"] for e in loader.stats()["events"]]
    lines = out.read_text().splitlines()
    restart = (die_at + 1) // EVERY * EVERY  # the step of the last checkpoint
    served = [(d["step"], d["rank"], line) for line in lines for d in [json.loads(line)]]
    # steps from the checkpoint on were served twice (before the kill and after), identically
    for step, rank, line in served:
        assert line == want[(step, rank)], (step, rank)
    counts: dict[tuple[int, int], int] = {}
    for step, rank, _ in served:
        counts[(step, rank)] = counts.get((step, rank), 0) + 1
    assert set(counts) == set(want)  # every step of every rank, nothing lost
    assert all(counts[(s, r)] == (2 if restart <= s <= die_at else 1) for s, r in want), (
        restart,
        die_at,
        counts,
    )
    assert before == after  # the SourceLoaders were not restarted
    assert "trainers-rewound" in events


def test_ranks_reconnecting_with_different_states_are_refused_naming_both(ray_session, plan):
    from overlord import connect

    with Loader(plan, runtime="ray", job="rewind-mixed") as loader:
        clients = [loader.client(r) for r in range(DP)]
        states = {}
        for step in range(6):
            for c in clients:
                next(c)
            if step in (2, 5):
                states[step + 1] = clients[0].state_dict()
        first = connect("rewind-mixed", rank=0, state=states[3], stop_step=5)
        assert next(first).step == 3
        with pytest.raises(LoaderError, match="state of step 6.*state of step 3"):
            connect("rewind-mixed", rank=1, state=states[6])
        # a checkpoint of another plan is refused too
        other = validate_plan({**plan.model_dump(mode="json"), "seed": 99}, base_dir=plan.base_dir)
        with pytest.raises(LoaderError, match="cannot reconnect"):
            with Loader(other) as o:
                bad = o.state_dict()
            connect("rewind-mixed", rank=1, state=bad)


def test_a_notice_of_a_trainer_from_before_the_rewind_is_dropped(job_plan):
    """A killed trainer's last consumption notices may land after the rewind: not counted."""
    from overlord.monitor.figures import Figures
    from overlord.roles.consumption import Consumption
    from overlord.roles.ledger import Ledger
    from overlord.state.format import STATE_VERSION

    plan = load_plan(job_plan).with_dp(1)
    fingerprint = plan.stream_fingerprint()
    state = {"version": STATE_VERSION, "fingerprint": fingerprint, "step": 9, "sources": {}}
    ledger = Ledger(plan, {})
    ledger.keep(9, state)  # the job keeps the state of step 9
    rewound: list[int] = []
    figures = Figures(plan.source_names, 1)
    consumption = Consumption(plan, figures, ledger, lambda: 9, lambda *_: None, rewound.append)
    assert not consumption.stale(0)  # no rewind yet: every client counts
    assert consumption.reconnect(0, state) == 9 and rewound == [9]  # the job rewound to step 9
    assert consumption.stale(0) and consumption.stale(8)  # clients started before it: killed ones
    assert not consumption.stale(9) and not consumption.stale(None)  # reconnected, or unknown
