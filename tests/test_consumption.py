"""The planner's ledger and consumption on their own: plain objects, no Loader, no loaders."""

from __future__ import annotations

from typing import Any

import pytest

from overlord import LoaderError, load_plan
from overlord.monitor.figures import Figures
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.consumption import Consumption
from overlord.roles.ledger import Ledger
from overlord.roles.rewind import STALE_S, Stamps
from overlord.state.format import STATE_VERSION


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
        self.stamps = Stamps(None)  # the job's key: the states it hands out are stamped
        self.consumption = Consumption(
            plan,
            Figures(plan.source_names, plan.world.dp),
            self.ledger,
            planned=lambda: steps,
            settle=self.settle,
            rewind=lambda state: self.rewound.append(int(state["step"])),
            stamps=self.stamps,
        )

    def settle(self, before: int, done: int) -> None:
        """What the planner does when every rank consumed more: here, only prune its states."""
        self.settled.append((before, done))
        self.consumption.prune()

    def handed(self, step: int) -> dict[str, Any]:
        """The state of ``step`` as the job hands it out to a trainer: whole, and stamped."""
        body = {"version": STATE_VERSION, "fingerprint": self.plan.stream_fingerprint()}
        return self.stamps.stamp({**body, **self.state(step)})

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
    job = Job(_plan(job_plan, dp=2))
    c = job.consumption
    for r in range(2):
        for s in range(7):
            c.mark_consumed(r, s)
    five, six = job.handed(5), job.handed(6)
    assert c.reconnect(0, five) == 5 and job.rewound == []  # the job waits for rank 1
    assert c.waits(0) and not c.waits(1)  # rank 0 waits; rank 1's trainer is served as before
    with pytest.raises(LoaderError, match="state of step 6.*state of step 5"):
        c.reconnect(1, six)  # another checkpoint while the rewind is open
    with pytest.raises(LoaderError, match="state of step 6.*state of step 5"):
        c.waits(0)  # the waiting rank receives the same error
    assert job.rewound == [] and c.positions() == [6, 6]  # the job did not move
    # a new rewind, every rank with the same checkpoint: the job rewinds once, when the last joins
    assert c.reconnect(1, five) == 5 and job.rewound == []
    assert not c.stale(4)
    assert c.reconnect(0, five) == 5 and job.rewound == [5]
    assert not c.waits(0) and not c.waits(1)
    assert c.stale(4) and not c.stale(5)


def test_a_state_not_of_this_job_is_refused_naming_why(job_plan):
    job = Job(_plan(job_plan, dp=2))
    c = job.consumption
    for r in range(2):
        for s in range(7):
            c.mark_consumed(r, s)
    three = job.handed(3)
    assert c.reconnect(0, three) == 3  # an older state than any kept: its stamp says it is ours
    another = Stamps(None).stamp({k: v for k, v in three.items() if k != "job"})
    with pytest.raises(LoaderError, match="handed out by job"):
        c.reconnect(1, another)
    with pytest.raises(LoaderError, match="handed out by job"):
        c.waits(0)  # rank 0 waited: it receives the same error
    bare = {k: v for k, v in three.items() if k != "job"}
    with pytest.raises(LoaderError, match="carries no stamp of this job.*keeps steps 7 to"):
        c.reconnect(0, bare)
    assert c.reconnect(0, {k: v for k, v in job.ledger.state_dict(7).items()}) == 7  # kept
    assert job.rewound == []


def test_a_trainer_restarted_alone_is_told_at_once_and_the_live_ranks_go_on(job_plan):
    job = Job(_plan(job_plan, dp=4))
    c = job.consumption
    for r in range(4):
        for s in range(5):
            c.mark_consumed(r, s)
    five = job.handed(5)
    assert c.reconnect(2, five) == 5  # rank 2's trainer restarted; the others did not die
    assert c.reconnect(3, five) == 5  # so did rank 3's
    assert c.waits(2)  # nothing heard from the others yet
    c.mark_consumed(0, 5)  # at once: the last notice of a killed trainer, delivered late?
    assert c.waits(2)  # so not a sign of life yet
    assert c.rewinding.open is not None
    c.rewinding.open.opened -= STALE_S  # later than a killed trainer's calls can arrive:
    c.mark_consumed(0, 5)  # rank 0's trainer consumes on
    c.waiting(1, 6, since=0)  # rank 1's trainer waits for its step 6 (for rank 2)
    with pytest.raises(LoaderError, match=r"alive and consuming \(rank 0 at step 5, rank 1 at "
                       r"step 5\).*restart them all from one checkpoint"):  # fmt: skip
        c.waits(2)
    with pytest.raises(LoaderError, match="alive and consuming"):
        c.waits(3)  # every rank that waited receives it
    assert job.rewound == [] and c.positions() == [5, 4, 4, 4]  # undisturbed
    assert not c.waits(0) and not c.waits(1)


def test_a_rewind_whose_ranks_never_all_reconnect_ends_with_an_error(job_plan):
    job = Job(_plan(job_plan, dp=2))
    c = job.consumption
    state = job.handed(0)
    c.reconnect(0, state)
    assert c.rewinding.open is not None
    c.rewinding.open.opened -= job.plan.loading.timeout_s + 1  # as if it had waited that long
    assert c.reconnect(1, state) == 0  # a new rewind opens; the old one's rank is told why
    with pytest.raises(LoaderError, match=r"rank\(s\) \[1\] did not within"):
        c.waits(0)
    assert c.reconnect(0, state) == 0 and job.rewound == [0]  # rank 0 joins: it completes
    # a mesh peer of a DP rank that reconnects after the rewind is done joins it, once
    assert c.reconnect(1, state) == 0 and job.rewound == [0] and c.rewinding.open is None
    c.mark_consumed(0, 0)
    c.mark_consumed(1, 0)  # the job moved on: the same state now opens a new rewind
    assert c.reconnect(1, state) == 0 and c.rewinding.open is not None


def test_a_restarted_planner_recognises_the_states_of_the_one_before(tmp_path):
    first = Stamps(str(tmp_path))  # the key is kept in the journal's folder
    state = first.stamp({"step": 4, "sources": {}})
    again = Stamps(str(tmp_path))  # a planner Ray restarted, with the same folder
    assert again.id == first.id and again.problem(state) is None
    other = Stamps(str(tmp_path / "another-job"))
    assert "handed out by job" in str(other.problem(state))


def test_a_state_of_another_plan_is_refused(job_plan):
    job = Job(_plan(job_plan, dp=1))
    state = job.handed(0)
    state["sources"]["web"]["fingerprint"] = "0" * 16  # another plan reads this source otherwise
    refused = "(?s)rank 0 cannot reconnect with this state: .*sources.web: fingerprint"
    with pytest.raises(LoaderError, match=refused):
        job.consumption.reconnect(0, state)
    assert job.rewound == [] and job.consumption.rewinding.open is None
