"""Client: what a training script holds, an iterator of one DP rank's (or mesh rank's) batches."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from overlord.batch import Batch
from overlord.errors import CheckpointError, LoaderError, RanksApart
from overlord.roles.api import ConstructorRole, PlannerRole
from overlord.roles.feedback import check_report
from overlord.runtime.base import Handle, OneWay
from overlord.runtime.objects import ObjectStore

LOST_TRIES = 3  # a stored batch lost with its constructor is asked for again, this many times
# a trainer that waits this long for a batch tells the planner it is alive, and again as often:
# a trainer restarted alone learns at once that the others still run (overlord.roles.rewind)
HEARTBEAT_S = 1.0


class Client(Iterator[Batch]):
    """Batches of one DP rank, step after step, from ``start_step`` (until ``stop_step``).

    With ``global_rank``, the batches of that rank of the device mesh (its CP
    slice, its pipeline stage's fields) of DP rank ``rank``.

    Consumption notices go to the planner one way (the trainer does not wait
    for them); an error of one is raised by the next ``next()``, or by
    :meth:`close`, naming the call.

    ``objects``: the store the constructor puts a mesh rank's view in (given by
    the wiring where the constructor has one); the client then fetches the
    view as the one object its peers share.

    ``heartbeat``: while the trainer waits for a batch, tell the planner every
    :data:`HEARTBEAT_S` that it is alive (a client connected to a job, whose
    trainer may outlive a peer that restarts alone).

    ``sources``: the plan's source names, against which :meth:`report`
    checks the losses it is given (empty: the planner checks them).

    ``rewinding``: the client of a trainer that reconnected with a state
    (``loading.timeout_s``): its first ``next()`` waits until the job rewound,
    every DP rank reconnected (:func:`wait_until_rewound`).
    """

    def __init__(
        self,
        rank: int,
        constructor: Handle[ConstructorRole],
        planner: Handle[PlannerRole],
        start_step: int,
        stop_step: int | None = None,
        owned: ConstructorRole | None = None,
        notices: OneWay | None = None,
        global_rank: int | None = None,
        objects: ObjectStore | None = None,
        heartbeat: bool = False,
        sources: tuple[str, ...] = (),
        rewinding: float | None = None,
    ):
        self.rank, self.global_rank = rank, global_rank
        self._rewinding = rewinding
        self._sources = sources
        self._constructor, self._planner = constructor, planner
        self._owned = owned  # a constructor in this process that this client closes
        # queued by the trainer's thread (for the planner's next call to run, embedded; for a
        # thread of their own to send, elsewhere), in order across a Loader's clients, which
        # share them: the trainer's thread never waits for the planner
        who = f"rank {rank}" if global_rank is None else f"global rank {global_rank}"
        self._shared = notices is not None
        self._notices = notices or OneWay(f"client of {who}", background=True)
        self.step = self._since = start_step
        self.stop_step = stop_step
        self._returned: float | None = None  # when the last batch was handed over
        # a mesh rank takes its view as the one stored object its peers share, given a store
        self._objects = objects if global_rank is not None else None
        self._waits_since: float | None = None  # when the trainer's wait for a batch began
        self._closed = threading.Event()
        if heartbeat:
            threading.Thread(target=self._beat, name=f"overlord-beat-{who}", daemon=True).start()

    def __next__(self) -> Batch:
        """The next step's batch; marks it consumed for checkpoints."""
        self._notices.check()
        if self._rewinding is not None:  # reconnected: served once the job rewound
            wait_until_rewound(self._planner, self.rank, self._rewinding)
            self._rewinding = None
        if self.stop_step is not None and self.step >= self.stop_step:
            raise StopIteration
        # the trainer's own time since the last batch: the autoscaler's measure of demand
        now = time.perf_counter()
        train_s = None if self._returned is None else now - self._returned
        self._waits_since = now
        try:
            batch = self._next_batch()
        finally:
            self._waits_since = None
        wait_s = time.perf_counter() - now
        # no need to wait: calls from one process reach the planner in order
        if self.global_rank is None:
            self._notices.send(
                self._planner,
                PlannerRole.mark_consumed,
                *(self.rank, self.step, train_s, wait_s, self._since),
            )
        else:
            self._notices.send(
                self._planner,
                PlannerRole.mark_rank_consumed,
                *(self.global_rank, self.step, train_s, wait_s, self._since),
            )
        self.step += 1
        self._returned = time.perf_counter()
        return batch

    def report(
        self, step: int, seconds: float, loss_by_source: dict[str, float] | None = None
    ) -> None:
        """Tell the planner this rank trained ``step`` in ``seconds`` (its own compute time).

        ``seconds``: the rank's forward and backward on the step, before it waits
        at the gradient all-reduce (where every rank's time is the slowest's).
        ``loss_by_source``: optionally its mean loss per source (keys are the
        batch's ``source`` names), for a mixture that adapts. Sent one way, as
        the consumption notices are: the trainer does not wait. A report the planner
        cannot pair (a step it no longer keeps) is counted and dropped; a
        malformed one raises ``ValueError`` here.
        """
        losses = check_report(step, seconds, loss_by_source, self._sources)
        self._notices.send(
            self._planner, PlannerRole.report, self.rank, int(step), float(seconds), losses
        )

    def _next_batch(self) -> Batch:
        while True:  # the time spent here is the trainer's wait (monitoring)
            try:
                batch = self._fetch()
            except RanksApart:
                if not self._notices.pending():
                    raise
                self._notices.flush()  # the other ranks' notices were on their way: ask again
                continue
            if (batch.step, batch.rank) == (self.step, self.rank):
                return batch
            if batch.step < self.step and batch.rank == self.rank:
                continue  # a delivery repeated by a retry: dropped by its key
            raise LoaderError(
                f"rank {self.rank} asked for step {self.step} and received step {batch.step} "
                f"of rank {batch.rank}"
            )

    def _beat(self) -> None:
        """While the trainer waits for a batch, tell the planner this trainer is alive."""
        while not self._closed.wait(HEARTBEAT_S):
            since = self._waits_since
            if since is None or time.perf_counter() - since < HEARTBEAT_S:
                continue
            with contextlib.suppress(Exception):  # a planner being restarted: the next beat
                call = self._planner.call(PlannerRole.waiting, self.rank, self.step, self._since)
                call.result(timeout=HEARTBEAT_S)

    def _fetch(self) -> Batch:
        if self.global_rank is None:
            return self._constructor.call(ConstructorRole.batch, self.step, self.rank).result()
        if self._objects is None:
            call = self._constructor.call(ConstructorRole.rank_batch, self.step, self.global_rank)
            return call.result()
        for _ in range(LOST_TRIES):
            asked = self._constructor.call(
                ConstructorRole.rank_batch_ref, self.step, self.global_rank
            )
            batch = self._objects.get(asked.result()[0], "the batch of a DataConstructor")
            if batch is not None:
                return batch
            # the constructor died between putting the object and our get: it was restarted
        raise LoaderError(
            f"global rank {self.global_rank}: the batch of step {self.step} was lost "
            f"{LOST_TRIES} times in a row (its DataConstructor died each time); see the "
            "runtime's logs"
        )

    def flush(self) -> None:
        """Wait until this rank's consumption notices reached the planner (raising errors)."""
        self._notices.flush()

    def close(self) -> None:
        """Wait for the last consumption notices (raising their errors); stop an owned one."""
        self._closed.set()
        try:
            if self._shared:
                self._notices.flush()
            else:
                self._notices.close()
        finally:
            if self._owned is not None:
                self._owned.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The job's state as of this rank's position: what a resumed job starts from.

        Call it where the trainer checkpoints, once every rank has trained on
        the same step (as synchronous data-parallel training does).
        """
        self.flush()  # this rank's consumption reaches the planner first
        return self._planner.call(PlannerRole.state_dict, self.step).result()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that this rank's stream is at ``state``; raise where it is not.

        The roles behind a client (a Loader's, or a job's) started from a state
        of their own and cannot move back for one trainer: a checkpoint's state
        is accepted where it is this rank's position, and refused otherwise with
        how to start the roles from it.
        """
        here = self.state_dict()
        problems = []
        if state.get("fingerprint") != here.get("fingerprint") and not _resumed_from(state, here):
            problems.append(
                f"stream fingerprint: expected {state.get('fingerprint')} (checkpoint), "
                f"found {here.get('fingerprint')} (running): the roles run another plan"
            )
        if state.get("step") != self.step:
            problems.append(
                f"step: expected {state.get('step')} (checkpoint), found {self.step} "
                f"(this rank's position)"
            )
        if problems:
            who = f"rank {self.rank}" if self.global_rank is None else f"rank {self.global_rank}"
            raise CheckpointError(
                f"the running stream is not where the checkpoint resumes ({who}):\n  "
                + "\n  ".join(problems)
                + "\nA running stream is resumed when its roles start, not by its trainers: "
                "start them from this checkpoint ('overlord serve PLAN --name JOB --resume "
                "DIR', Loader(plan, runtime='ray', job=..., state=...), or "
                "Loader(plan, state=...)), then connect again."
            )


def wait_until_rewound(planner: Handle[PlannerRole], rank: int, timeout_s: float) -> None:
    """Return once the rewind DP rank ``rank`` joined is done: every DP rank reconnected.

    Asked at a reconnected trainer's first ``next()`` (not in ``connect``: a
    process may connect several ranks one after the other before it asks for
    a batch). Its constructor may hold batches it built ahead for the trainer
    that died, of the very steps the new one asks for, and would hand them
    over without asking the planner, so a rank would consume steps of a job
    that has not rewound yet (and the rewind, when it comes, would forget that
    it did). The planner refuses a rewind that waits longer than
    ``loading.timeout_s`` (``timeout_s``): its error is raised here.
    """
    deadline = time.monotonic() + 2 * timeout_s + HEARTBEAT_S
    pause = 0.001
    while not planner.call(PlannerRole.rewound, rank).result():
        if time.monotonic() > deadline:
            raise LoaderError(
                f"rank {rank} reconnected, and the job did not rewind within "
                f"{2 * timeout_s:.0f} s (twice loading.timeout_s), nor did its planner refuse "
                "the rewind: see the planner's log"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _resumed_from(state: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether ``state``, of another plan, is where the running stream stands.

    So it is when the roles started from it with a plan changed only in what a
    resume allows (:mod:`overlord.state.changes`): every source both hold is
    read the same way (its fingerprint) and stands at the same place (its cursor).
    """
    mine, theirs = here.get("sources", {}), state.get("sources")
    if not isinstance(theirs, dict):
        return False
    shared = [n for n in mine if n in theirs and isinstance(theirs[n], dict)]
    return bool(shared) and all(
        theirs[n].get(key) == mine[n].get(key) for n in shared for key in ("fingerprint", "cursor")
    )

