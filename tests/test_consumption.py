"""The planner's ledger and consumption on their own: plain objects, no Loader, no loaders."""

from __future__ import annotations

from typing import Any

import pytest

from overlord import LoaderError, load_plan
from overlord.monitor.figures import Figures
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.consumption import Consumption
from overlord.roles.ledger import Ledger


def _plan(job_plan: Any, dp: int = 3, tp: int = 1, rewind_steps: int = 0) -> Plan:
    base = load_plan(job_plan)
    data = base.model_dump(mode="json")
    data["world"].update(dp=dp, tp=tp)
    data["recovery"]["rewind_steps"] = rewind_steps
    return validate_plan(data, base_dir=base.base_dir)


class Job:
    """A Consumption over a ledger that keeps a bare state before each of ``steps``."""

    def __init__(self, plan: Plan, steps: int = 10):
        self.plan = plan
        self.ledger = Ledger(plan, {})
        self.ledger.restart(0, self.state(0))
        for s in range(1, steps + 1):
            self.ledger.keep(s, self.state(s))
        self.settled: list[tuple[int, int]] = []
        self.rewound: list[int] = []
        self.consumption = Consumption(
            plan,
            Figures(plan.source_names, plan.world.dp),
            self.ledger,
            planned=lambda: steps,
            settle=self.settle,
            rewind=self.rewound.append,
        )

    def settle(self, before: int, done: int) -> None:
        """What the planner does when every rank consumed more: here, only prune its states."""
        self.settled.append((before, done))
        self.consumption.prune()

    def state(self, step: int) -> dict[str, Any]:
        """A state as a run writes one (a resume range-checks it), its cursor at ``step``."""
        web = {
            "fingerprint": self.plan.source_fingerprint("web"),
            "cursor": {"epoch": 0, "shard_pos": 0, "index": step, "skip": []},
            "placed": 64.0 * step,
            "target": 64.0 * step,
        }
        return {"step": step, "sources": {"web": web}}


def test_a_step_is_consumed_once_every_rank_received_it(job_plan):
    job = Job(_plan(job_plan, dp=4))
    c = job.consumption
    for r in range(3):
        c.mark_consumed(r, 0)
    assert job.settled == [] and c.done == -1 and c.positions() == [0, 0, 0, -1]
    c.mark_consumed(3, 1)  # the last rank at the old minimum moved
    assert job.settled == [(-1, 0)] and c.done == 0
    c.mark_consumed(0, 2)
    for r in (1, 2):
        c.mark_consumed(r, 1)
    assert job.settled == [(-1, 0), (0, 1)] and [c.position(r) for r in range(4)] == [3, 2, 2, 2]
    c.mark_consumed(1, 1)  # a step received again counts once
    assert job.settled == [(-1, 0), (0, 1)]
    # where the order stands: after step 1
    assert c.consumed_cursor("web") == {"epoch": 0, "shard_pos": 0, "index": 2, "skip": []}
    assert job.ledger.first == 2  # the states before are no rank's any more


def test_a_dp_ranks_step_waits_for_every_attached_peer(job_plan):
    plan = _plan(job_plan, dp=1, tp=2)
    job = Job(plan)
    c = job.consumption
    peers = plan.world.ranks_of(0)
    assert [c.attach(g) for g in peers] == [0, 0]
    c.mark_rank_consumed(peers[0], 0)
    assert job.settled == []  # the other peer has not received it
    c.mark_rank_consumed(peers[1], 0)
    assert job.settled == [(-1, 0)]


def test_consumed_states_are_kept_back_to_the_newest_checkpoint_within_rewind_steps(job_plan):
    job = Job(_plan(job_plan, dp=1, rewind_steps=3))
    c = job.consumption
    assert c.keep_from(6) == 6  # no state handed out: nothing kept for a rewind
    c.checkpointed(5)
    assert (c.keep_from(6), c.keep_from(7), c.keep_from(9)) == (5, 5, 6)  # at most 3 steps back
    for s in range(8):
        c.mark_consumed(0, s)
    assert job.ledger.first == 5  # pruned up to the checkpoint, not to the consumed step
    with pytest.raises(LoaderError, match="no state for step 4: states are kept from step 5"):
        job.ledger.state_dict(4)


def test_a_rewind_is_one_transaction_over_the_ranks(job_plan):
    job = Job(_plan(job_plan, dp=2, rewind_steps=4))
    c = job.consumption
    c.checkpointed(5)  # a trainer's checkpoint
    for r in range(2):
        for s in range(7):
            c.mark_consumed(r, s)
    five, six = job.ledger.state_dict(5), job.ledger.state_dict(6)
    assert c.reconnect(0, five) == 5 and job.rewound == [5]
    with pytest.raises(LoaderError, match="state of step 6.*state of step 5"):
        c.reconnect(1, six)  # another checkpoint while the rewind is open
    assert c.reconnect(1, five) == 5 and job.rewound == [5]  # joins: rewound once
    assert c.stale(4) and not c.stale(5)
    elsewhere = {"epoch": 0, "shard_pos": 0, "index": 99, "skip": []}
    other = {**five, "sources": {"web": {**five["sources"]["web"], "cursor": elsewhere}}}
    with pytest.raises(LoaderError, match="not this job's state"):
        c.reconnect(0, other)  # a new rewind, from a state this job never had
    with pytest.raises(LoaderError, match="cannot rewind the job to step 0"):
        c.reconnect(0, {**five, "step": 0})  # no longer kept
