"""Trainers rewind a live job to any state it handed out (inline runtime, no Ray).

The job runs in this process; its trainers are clients that reconnect with a
checkpoint's state, each DP rank. What they receive from the state on must be
the uninterrupted stream: the same samples and the same token ids, whether
the loaders still held the items (served from memory) or had released them
(they seek to the state and read again).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import two_sources
from overlord import Loader, LoaderError, load_plan
from overlord.ops.run import dump_line
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.api import PlannerRole
from overlord.roles.client import Client
from overlord.roles.rewind import STAMP, Stamps

DP, STEPS = 2, 14


def _plan(tmp_path: Path, rewind_steps: int = 0) -> Plan:
    plan = load_plan(two_sources(tmp_path, dp=DP))
    data = plan.model_dump(mode="json")
    data["recovery"]["rewind_steps"] = rewind_steps
    return validate_plan(data, base_dir=plan.base_dir)


def line(batch: Any) -> str:
    """The samples of a rank's step and a digest of its token ids."""
    ids = hashlib.sha256(np.asarray(batch.input_ids).tobytes()).hexdigest()[:16]
    return json.dumps({"line": json.loads(dump_line(batch)), "ids": ids})


def reference(plan: Plan, steps: int = STEPS) -> dict[tuple[int, int], str]:
    """Every (step, rank) of the uninterrupted stream."""
    out = {}
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(DP)]
        for _ in range(steps):
            for c in clients:
                b = next(c)
                out[(b.step, b.rank)] = line(b)
    return out


def stamped(loader: Loader) -> Any:
    """The planner of an inline Loader, made to stamp its states as a job on Ray does."""
    planner = loader.planner.obj  # type: ignore[attr-defined]
    planner.stamps = planner.consumption.stamps = Stamps(None)
    return planner


def reconnect(loader: Loader, state: dict[str, Any]) -> list[Client]:
    """Every DP rank reconnects with ``state``; their new clients.

    They send their consumption notices from one thread, as ``Loader.client``'s do: the
    embedded runtime refuses a rank far ahead at once (``RanksApart``) unless its own
    notices are in flight, so clients of one process with a thread each would race.
    """
    for r in range(DP):
        assert loader.planner.call(PlannerRole.reconnect, r, state).result() == state["step"]
    constructors = loader._constructor_of  # noqa: SLF001 - the trainers' side of this Loader
    notices = loader._notices  # noqa: SLF001
    return [
        Client(r, constructors[r], loader.planner, state["step"], notices=notices)
        for r in range(DP)
    ]


@pytest.mark.integration
@pytest.mark.parametrize("rewind_steps", [0, 4])
def test_a_rewind_to_the_newest_or_an_older_state_serves_the_uninterrupted_stream(
    tmp_path, rewind_steps
):
    plan = _plan(tmp_path, rewind_steps)
    want = reference(plan)
    with Loader(plan) as loader:
        planner = stamped(loader)
        clients = [loader.client(r) for r in range(DP)]
        states = {}
        for step in range(10):
            for c in clients:
                assert line(next(c)) == want[(step, c.rank)]
            if step + 1 in (3, 8):
                states[step + 1] = clients[0].state_dict()
        assert all(STAMP in s for s in states.values())

        def rewind(target: int, until: int) -> list[Client]:
            for c in clients:
                c.close()  # its last notices landed (a killed trainer's land before it restarts)
            new = reconnect(loader, states[target])
            for step in range(target, until):
                for c in new:
                    assert line(next(c)) == want[(step, c.rank)], (target, step, c.rank)
            return new

        clients = rewind(8, 11)  # the newest checkpoint, with steps consumed since
        states[11] = clients[0].state_dict()
        clients = rewind(11, STEPS)  # the newest, nothing consumed since
        clients = rewind(3, 6)  # an older checkpoint
        clients = rewind(11, STEPS)  # a later one again: the loaders read on to it
        events = [e for e in planner.pool.events if e["event"] == "trainers-rewound"]
    served = [(e["step"], e["served_from"]) for e in events]
    assert [s for s, _ in served] == [8, 11, 3, 11]
    # within rewind_steps of the newest checkpoint, items stay held: served from memory
    assert served[0][1] == ("memory" if rewind_steps >= 2 else "seek")
    assert served[1][1] == "memory"  # its items were never released
    assert served[2][1] == "seek"  # released long ago: the loaders read again


@pytest.mark.integration
def test_a_state_of_another_job_or_edited_is_refused_and_the_job_goes_on(tmp_path):
    plan = _plan(tmp_path)
    with Loader(plan) as loader:
        stamped(loader)
        clients = [loader.client(r) for r in range(DP)]
        for step in range(4):
            for c in clients:
                next(c)
            if step == 1:
                two = clients[0].state_dict()
        state = clients[0].state_dict()
        # the state of step 2 as another job would stamp it (this job no longer keeps it)
        other = Stamps(None).stamp({k: v for k, v in two.items() if k != STAMP})
        with pytest.raises(LoaderError, match="handed out by job .* and this job is"):
            loader.planner.call(PlannerRole.reconnect, 0, other).result()
        edited = {**state, "step": 2}
        with pytest.raises(LoaderError, match="digest does not match"):
            loader.planner.call(PlannerRole.reconnect, 0, edited).result()
        bare = {k: v for k, v in state.items() if k != STAMP}
        bare["sources"] = {**bare["sources"]}
        web = bare["sources"]["web"]
        bare["sources"]["web"] = {**web, "cursor": {**web["cursor"], "index": 1}}
        with pytest.raises(LoaderError, match="carries no stamp of this job"):
            loader.planner.call(PlannerRole.reconnect, 0, bare).result()
        for _ in range(2):  # refused: the job did not move
            for c in clients:
                assert next(c).step == 4 + _


@pytest.mark.integration
def test_a_rewind_before_a_repartition_starts_the_retired_loaders_again(tmp_path, make_corpus):
    path = make_corpus(
        tmp_path,
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 3 for i in range(8)}, "loaders": 2},
            "code": {"files": {f"data/code/p{i}.jsonl": 3 for i in range(8)}},
        },
        world={"dp": DP},
    )
    plan, steps = load_plan(path), 30
    want = reference(plan, steps)
    with Loader(plan) as loader:
        planner = stamped(loader)
        clients = [loader.client(r) for r in range(DP)]
        for step in range(steps):
            if step == 2:
                state = clients[0].state_dict()
                at = planner.repartition("web", 3)  # 2 -> 3 loaders from a shard boundary on
            for c in clients:
                assert line(next(c)) == want[(step, c.rank)]
        assert at is not None and planner.pool.slots["web"][:2] == [[], []]  # retired
        for c in clients:
            c.close()
        clients = reconnect(loader, state)
        assert all(planner.pool.slots["web"][:2])  # the retired partition's loaders, again
        for step in range(2, steps):
            for c in clients:
                assert line(next(c)) == want[(step, c.rank)], (step, c.rank)
