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
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import two_sources
from overlord import Loader, load_plan
from overlord.ops.run import run_plan

pytestmark = [pytest.mark.ray, pytest.mark.integration]

STEPS, EVERY, DP = 16, 3, 2

TRAINER = """
import json, os, signal, sys
from pathlib import Path
import overlord
from overlord import checkpoint
from overlord.ops.run import dump_line

job, rank, out, ckpt, stop, die_at, start = sys.argv[1:8]
rank, stop, die_at, start = int(rank), int(stop), int(die_at), int(start)
mine = Path(ckpt) / f"rank-{rank}"
state = None
if start >= 0:  # that checkpoint; else the newest, if any
    state = checkpoint.load(mine / f"step-{start:08d}.json")
elif mine.is_dir() and any(mine.iterdir()):
    state = checkpoint.load(mine)
client = overlord.connect(job, rank=rank, stop_step=stop, state=state)
with open(out, "a") as f:
    for batch in client:
        f.write(dump_line(batch) + "\\n")
        f.flush()
        if (batch.step + 1) % int(os.environ["EVERY"]) == 0:
            checkpoint.save(mine, client.state_dict())
        if batch.step == die_at:
            # synchronous training: a collective keeps a rank from dying before its peers
            # took the step (they would wait on it forever); its consumption notices landed
            client.flush()
            os.kill(os.getpid(), signal.SIGKILL)
client.close()
"""


@pytest.fixture
def plan(tmp_path: Path):
    return load_plan(two_sources(tmp_path, dp=DP, timeout_s=30))  # the default recovery


def spawn(job: str, rank: int, out: Path, ckpt: Path, die_at: int, start: int = -1) -> Any:
    """A trainer process of ``rank`` (from checkpoint ``start``: -1 the newest)."""
    import ray

    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "EVERY": str(EVERY),
    }
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, job, str(rank), str(out), str(ckpt), str(STEPS),
         str(die_at), str(start)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def trainers(
    job: str, out: Path, ckpt: Path, die_at: int, start: list[int] | None = None
) -> list[str]:
    """Run every rank's trainer (from checkpoint ``start[rank]``: -1 the newest); their errors."""
    start = start or [-1] * DP
    procs = [spawn(job, r, out, ckpt, die_at, start[r]) for r in range(DP)]
    errors = []
    for p in procs:
        err = p.communicate(timeout=120)[1]
        assert p.returncode in (0, 1, -9), err[-3000:]
        errors.append(err if p.returncode == 1 else "")
    return errors


def loader_pids(loader: Loader) -> set[int]:
    return {s["pid"] for s in loader.stats()["loaders"]}


def uninterrupted(plan) -> dict[tuple[int, int], str]:
    reference = io.StringIO()
    run_plan(plan, STEPS, dump=reference, progress=False)
    return {(d["step"], d["rank"]): line for line in reference.getvalue().splitlines()
            for d in [json.loads(line)]}  # fmt: skip


def served(out: Path, want: dict[tuple[int, int], str]) -> dict[tuple[int, int], int]:
    """How many times each (step, rank) was served; each line must be the uninterrupted one's."""
    counts: dict[tuple[int, int], int] = {}
    for line in out.read_text().splitlines():
        d = json.loads(line)
        assert line == want[(d["step"], d["rank"])], (d["step"], d["rank"])
        counts[(d["step"], d["rank"])] = counts.get((d["step"], d["rank"]), 0) + 1
    assert set(counts) == set(want)  # every step of every rank, nothing lost
    return counts


def test_trainers_killed_at_a_random_step_reconnect_from_their_newest_checkpoint(
    ray_session, plan, tmp_path
):
    want = uninterrupted(plan)
    die_at = random.Random(os.getpid()).randrange(EVERY + 1, STEPS - 2)
    out, ckpt = tmp_path / "dump.jsonl", tmp_path / "ckpt"
    with Loader(plan, runtime="ray", job="rewind-ci") as loader:
        before = loader_pids(loader)
        assert trainers("rewind-ci", out, ckpt, die_at) == ["", ""]  # all die after die_at
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert max(d["step"] for d in got) == die_at
        assert trainers("rewind-ci", out, ckpt, -1) == ["", ""]  # new ones, from the newest
        after = loader_pids(loader)
        events = [e for e in loader.stats()["events"] if e["event"] == "trainers-rewound"]
    counts = served(out, want)
    restart = (die_at + 1) // EVERY * EVERY  # the step of the last checkpoint
    # steps from the checkpoint on were served twice (before the kill and after), identically
    assert all(counts[(s, r)] == (2 if restart <= s <= die_at else 1) for s, r in want), (
        restart,
        die_at,
        counts,
    )
    assert before == after  # the SourceLoaders were not restarted
    assert [e["step"] for e in events] == [restart]


def test_a_rank_that_reconnects_first_is_served_nothing_until_every_rank_reconnected(
    ray_session, plan, tmp_path
):
    """Its constructor holds the steps it built ahead for the trainer that died: kept back.

    Handed over before the job rewound, they would be counted as consumed by
    the job from before the rewind, which then forgets them, and the ranks
    would wait for each other forever.
    """
    from overlord.roles.api import PlannerRole

    want = uninterrupted(plan)
    out, ckpt = tmp_path / "dump.jsonl", tmp_path / "ckpt"
    die_at = 2 * EVERY  # its step's checkpoint is the newest: the new trainers ask it again
    with Loader(plan, runtime="ray", job="rewind-first") as loader:
        assert trainers("rewind-first", out, ckpt, die_at) == ["", ""]
        before = len(out.read_text().splitlines())
        first = spawn("rewind-first", 0, out, ckpt, die_at=-1)
        deadline = time.monotonic() + 60
        while loader.planner.call(PlannerRole.rewound, 0).result():  # until rank 0 joined
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(2.0)  # a batch at hand would have been served by now
        assert len(out.read_text().splitlines()) == before  # nothing served yet
        second = spawn("rewind-first", 1, out, ckpt, die_at=-1)
        for p in (first, second):
            err = p.communicate(timeout=120)[1]
            assert p.returncode == 0, err[-3000:]
        events = [e for e in loader.stats()["events"] if e["event"] == "trainers-rewound"]
    counts = served(out, want)
    assert all(counts[(s, r)] == (2 if s == die_at else 1) for s, r in want), counts
    assert [e["step"] for e in events] == [die_at]


def test_a_refused_rank_stops_the_rewind_then_all_rewind_to_an_older_checkpoint(
    ray_session, plan, tmp_path
):
    want = uninterrupted(plan)
    out, ckpt = tmp_path / "dump.jsonl", tmp_path / "ckpt"
    die_at = 8  # checkpoints of steps 3 and 6 were written
    with Loader(plan, runtime="ray", job="rewind-refused") as loader:
        before = loader_pids(loader)
        assert trainers("rewind-refused", out, ckpt, die_at) == ["", ""]
        # rank 0 restarts from step 6, rank 1 from step 3: neither is served a step
        errors = trainers("rewind-refused", out, ckpt, -1, start=[6, 3])
        for err in errors:
            assert "every rank must restart from the same checkpoint" in err, err[-2000:]
        assert len({e.strip().splitlines()[-1].split(":", 1)[1] for e in errors}) == 1
        assert len(out.read_text().splitlines()) == DP * (die_at + 1)  # nothing more served
        # then every rank from the older checkpoint (its items released long ago): exact
        assert trainers("rewind-refused", out, ckpt, -1, start=[3, 3]) == ["", ""]
        after = loader_pids(loader)
        events = [e for e in loader.stats()["events"] if e["event"] == "trainers-rewound"]
    counts = served(out, want)
    assert all(counts[(s, r)] == (2 if 3 <= s <= die_at else 1) for s, r in want), counts
    assert before == after  # the SourceLoaders sought in place: not restarted
    assert [(e["step"], e["served_from"]) for e in events] == [(3, "seek")]


def test_a_trainer_restarted_alone_is_told_at_once_and_the_live_rank_is_not_disturbed(
    ray_session, tmp_path
):
    # the live rank waits for rank 1 up to loading.timeout_s: long enough never to end here
    plan = load_plan(two_sources(tmp_path, dp=DP, timeout_s=300))
    out, ckpt = tmp_path / "dump.jsonl", tmp_path / "ckpt"
    with Loader(plan, runtime="ray", job="rewind-alone"):
        live = spawn("rewind-alone", 0, out, ckpt, die_at=-1)
        dead = spawn("rewind-alone", 1, out, ckpt, die_at=7)
        dead.communicate(timeout=120)
        assert dead.returncode == -9
        # rank 1 alone, from its newest checkpoint (step 6), while rank 0 still runs
        alone = spawn("rewind-alone", 1, out, ckpt, die_at=-1)
        err = alone.communicate(timeout=120)[1]
        assert live.poll() is None  # rank 0's trainer still runs: it was not disturbed
        live.kill()
        live.communicate(timeout=60)
    assert alone.returncode == 1
    # told that the others are alive (not the loading.timeout_s wait that blames them)
    assert "alive and consuming (rank 0 at step" in err, err[-2000:]
    assert "stopped consuming" not in err
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    assert max(d["step"] for d in steps if d["rank"] == 1) == 7  # rank 1 was served nothing more


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
    rewind = lambda state: rewound.append(state["step"])  # noqa: E731
    consumption = Consumption(plan, figures, ledger, lambda: 9, lambda *_: None, rewind)
    assert not consumption.stale(0)  # no rewind yet: every client counts
    assert consumption.reconnect(0, state) == 9 and rewound == [9]  # the job rewound to step 9
    assert consumption.stale(0) and consumption.stale(8)  # clients started before it: killed ones
    assert not consumption.stale(9) and not consumption.stale(None)  # reconnected, or unknown
