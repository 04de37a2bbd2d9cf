"""What the trainers consumed: when a step counts as consumed, and trainers that rewind the job.

**DP ranks.** Each DP rank reports the steps it received
(``mark_consumed``); a step is consumed once every rank has received it.
Then its state becomes the checkpoint's and its payloads can go (the
planner, told through ``settle``, releases them and prunes its ledger).

**Mesh ranks.** A DP rank's batch is planned once and built once (by its
DataConstructor); its ``cp * tp * pp`` trainer processes (its *peers*) each
receive a view of it:

- the CP rank's slice (:mod:`overlord.batch.cp`), cut once per step
  for every CP rank together;
- the pipeline stage's fields: ``input_ids`` on the first stage, ``labels``
  on the last, the attention arrays on every stage; the rest ``None``;
- TP ranks of one ``(dp, cp, pp)`` coordinate receive the very same object.

A DP rank's step is consumed (and its payloads released, its state the
checkpoint's) once every peer that reads from the loader has received it:
peers that *attached* (``Loader.rank_client``, ``overlord.connect(...,
global_rank=)``) or reported a step. Peers that get their batch from another
rank (``overlord.torch.broadcast_batch``) never attach and are not waited for.

**Rewinds.** When every trainer process dies and restarts from its own
checkpoint (a state the job handed out, at step ``S``: the newest, or an
older one) while the job keeps running, each reconnects with that state
(``overlord.connect(job, rank, state=...)``). Which states are the job's, and
the rewind as one transaction over the DP ranks, are
:mod:`overlord.roles.rewind`: once every DP rank reconnected with the same
state, the job rewinds to ``S``: the plans of ``S`` on are dropped, the
cursors and the mixture go back to the state of ``S``, and the SourceLoaders
(not restarted) serve again from there, so the steps from ``S`` are planned
again exactly as the uninterrupted stream had them.

A loader serves from memory what it still holds; where an item the state
needs was released already, it seeks in place to the state's shard and reads
again from there (:meth:`overlord.roles.source_loader.SourceLoader.rewind`).
So any state of the job can be rewound to. ``recovery.rewind_steps`` is a
speed and memory knob, not a precondition: the planner keeps the items of
the steps from the newest state it handed out (a trainer's checkpoint), at
most ``rewind_steps`` steps back, instead of releasing them once consumed, so
that a rewind to one of those is served from memory, at that cost in memory
(each loader's budget grows by as much).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from overlord.errors import CheckpointError, LoaderError
from overlord.monitor.figures import Figures
from overlord.plan.spec import Plan
from overlord.roles.ledger import Ledger
from overlord.roles.rewind import STAMP, Stamps, Transaction, canonical
from overlord.state.checkpoint import check_state

log = logging.getLogger("overlord.planner")

TRAIN_EMA = 0.2  # weight of the newest step in the trainer's step-time average


class Consumption:
    """Where each rank stands, the step every rank consumed, and rewinds to a checkpoint.

    What it needs of the planner comes through its arguments:

    - ``figures``: the monitoring counters it adds the trainers' figures to;
    - ``ledger``: the states kept, which it prunes and rewinds to;
    - ``planned()``: the next step the planner will plan;
    - ``settle(before, done)``: every rank has now consumed up to step
      ``done`` (up to ``before`` until this notice): the planner releases
      what it no longer needs;
    - ``rewind(state)``: the planner plans again from ``state`` (a state of
      this job, checked here; it calls :meth:`restart` on the way);
    - ``stamps``: the job's identity and key (None: a job no trainer
      reconnects to, whose states are not stamped).
    """

    def __init__(
        self,
        plan: Plan,
        figures: Figures,
        ledger: Ledger,
        planned: Callable[[], int],
        settle: Callable[[int, int], None],
        rewind: Callable[[dict[str, Any]], None],
        stamps: Stamps | None = None,
    ):
        self.plan, self.figures, self.ledger = plan, figures, ledger
        self._world = plan.world
        self._dp = plan.world.dp
        self._planned, self._settle, self._rewind = planned, settle, rewind
        self.train_s: float | None = None  # moving average of the trainer's step time
        self._peers: dict[int, int] = {}  # last step each attached global rank received
        # the newest step whose state was handed out (trainers may rewind to it)
        self._checkpoint: int | None = None
        # the step of the last rewind: notices of clients started before it are stale
        self._open: int | None = None
        self.stamps = stamps
        self.rewinding = Transaction(self._dp)  # the rewind in progress, and its refusals
        self._done_body = b""  # the state of the last rewind done, as its ranks sent it
        self.origin: dict[str, Any] | None = None  # the state the job (re)started from
        self.restart(0)

    def restart(self, step: int) -> None:
        """Every DP rank stands before ``step`` (the job starts, or rewinds, there)."""
        self._consumed = [step - 1] * self._dp
        # the step every rank consumed (written here only), and how many ranks are still
        # there: kept as ranks move, so that a step's calls cost O(1) each, not O(dp)
        self.done, self._at_done = step - 1, self._dp

    # ---- DP ranks --------------------------------------------------------------------------

    def position(self, rank: int) -> int:
        """The next step DP rank ``rank`` should consume."""
        return self._consumed[rank] + 1

    def positions(self) -> list[int]:
        """The last step each DP rank consumed."""
        return list(self._consumed)

    def mark_consumed(
        self,
        rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """Record that ``rank`` received step ``step``; settle what every rank has consumed.

        ``train_s`` is the time the trainer spent on its last step before asking
        for this one (not waiting for data): the autoscaler's demand. ``wait_s``
        is how long it waited for this one (monitoring). ``since`` is the step
        the sender's client started at: a notice of a client that started
        before the last rewind comes from a trainer that was killed (it arrives
        late, one-way) and is dropped.
        """
        if self.stale(since):
            return
        self.rewinding.heard(rank, step)
        self.figures.trainer(rank, step, train_s, wait_s)
        if train_s is not None and train_s >= 0:
            old = self.train_s
            self.train_s = train_s if old is None else old + TRAIN_EMA * (train_s - old)
        before, was = self.done, self._consumed[rank]
        if step <= was:
            return
        self._consumed[rank] = step
        if was == before:
            self._at_done -= 1
            if self._at_done == 0:  # the last rank at the old minimum moved: once per step
                self.done = min(self._consumed)
                self._at_done = self._consumed.count(self.done)
        if self.done > before:
            self._settle(before, self.done)

    def consumed_step(self) -> int:
        """The step after the last one every rank consumed (or the next to plan, if earlier).

        A restarted planner may learn that ranks consumed steps it has not
        re-planned yet; its state is then the one before the next step to plan.
        """
        return min(self.done + 1, self._planned())

    def consumed_cursor(self, source: str) -> dict[str, Any]:
        """Where ``source``'s order stands once every rank consumed what it received."""
        return self.ledger.cursor(self.consumed_step(), source)

    def prune(self) -> None:
        """Forget the states no rank needs: consumed, and not kept for a rewind."""
        self.ledger.prune(self.keep_from(self.consumed_step()))

    # ---- mesh ranks ------------------------------------------------------------------------

    def attach(self, global_rank: int) -> int:
        """Count ``global_rank`` among its DP rank's readers; the next step it should consume."""
        dp = self._world.coords(global_rank).dp
        now = self.rewinding.open
        if now is not None and dp in now.joined:  # it reconnected: it starts at the rewind
            self._peers[global_rank] = now.step - 1
        at = self._peers.setdefault(global_rank, self._consumed[dp])
        return at + 1

    def mark_rank_consumed(
        self,
        global_rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """``global_rank`` received ``step``; its DP rank's step is consumed once all peers have.

        Every peer's wait is counted (under its DP rank), its step time once.
        """
        dp = self._world.coords(global_rank).dp
        steps = self._peers
        steps[global_rank] = max(step, steps.get(global_rank, step))
        low = min(steps[g] for g in self._world.ranks_of(dp) if g in steps)
        if low > self._consumed[dp]:
            self.mark_consumed(dp, low, train_s, wait_s, since)
        else:
            self.figures.trainer(dp, step, None, wait_s)

    # ---- rewinds ---------------------------------------------------------------------------

    def stale(self, since: int | None) -> bool:
        """Whether a notice of a client started at ``since`` predates the last rewind."""
        return since is not None and self._open is not None and since < self._open

    def checkpointed(self, step: int) -> None:
        """A state of ``step`` was handed out: trainers may rewind to it."""
        if self._checkpoint is None or step > self._checkpoint:
            self._checkpoint = step

    def keep_from(self, first: int) -> int:
        """The first step whose items stay held when every rank consumed up to ``first - 1``."""
        hold = self.plan.recovery.rewind_steps
        if not hold or self._checkpoint is None:
            return first
        return max(min(self._checkpoint, first), first - hold)

    def reconnect(self, rank: int, state: dict[str, Any]) -> int:
        """DP rank ``rank`` restarted from ``state``: join the rewind there; its step.

        The job rewinds once every DP rank reconnected with the same state; a
        rank refused closes the rewind for every rank that waited.
        """
        if self.rewinding.age() > self.plan.loading.timeout_s:
            self.rewinding.refuse(self._late())  # its ranks are told; this one opens anew
        try:
            problem = self._not_ours(state)
        except CheckpointError as e:
            problem = str(e)
        if problem is not None:
            self._refuse(f"rank {rank} cannot reconnect with this state: {problem}")
        step = int(state["step"])
        if self.rewinding.open is None and self._joins_done(state):
            return step  # a mesh peer of the rewind just done (its DP rank reconnected)
        try:
            now = self.rewinding.join(rank, state)
        except ValueError as e:
            self._refuse(str(e))
        alive = self.rewinding.alive()
        if alive:
            self._refuse(self._alone(alive))
        if self.rewinding.complete():
            self.rewinding.close()
            self._done_body = canonical(now.state)
            self._rewind(now.state)
            for g in self._peers:
                self._peers[g] = step - 1
            self._open = step
            log.warning("trainers reconnected from step %d: the job rewound there", step)
        return step

    def _joins_done(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` is that of the last rewind, whose first step no rank consumed yet.

        The other processes of a DP rank (its CP, TP and PP peers) reconnect
        too, each with the same state, and may come after the rewind is done.
        """
        step = int(state["step"])
        return self._open == step and self.done < step and canonical(state) == self._done_body

    def waits(self, rank: int) -> bool:
        """Whether ``rank`` must wait before it is served (a rewind waits for ranks to reconnect).

        Raises the error of a rewind that ``rank`` joined and that was
        refused: a rank restarted alone (other ranks are alive), another rank
        refused, or ranks that never reconnected.
        """
        refused = self.rewinding.refused(rank)
        if refused is not None:
            raise LoaderError(refused)
        now = self.rewinding.open
        if now is None or rank not in now.joined:
            return False  # ranks not in a rewind are served as before: nothing moved yet
        alive = self.rewinding.alive()
        if alive:
            self.rewinding.refuse(self._alone(alive))
        elif self.rewinding.age() > self.plan.loading.timeout_s:
            self.rewinding.refuse(self._late())
        refused = self.rewinding.refused(rank)
        if refused is not None:
            raise LoaderError(refused)
        return True

    def waiting(self, rank: int, step: int, since: int | None) -> None:
        """A trainer of ``rank`` waits for ``step``: it is alive (``since``: its start step)."""
        now = self.rewinding.open
        if now is not None and rank in now.joined:
            return  # a trainer that reconnected, waiting for the others
        if not self.stale(since):
            self.rewinding.heard(rank, step - 1)

    def _refuse(self, message: str) -> NoReturn:
        log.warning("a rewind was refused: %s", message)
        self.rewinding.refuse(message)
        raise LoaderError(message)

    def _alone(self, alive: dict[int, int]) -> str:
        now = self.rewinding.open
        assert now is not None
        where = ", ".join(f"rank {r} at step {s}" for r, s in alive.items())
        return (
            f"rank(s) {sorted(now.joined)} reconnected with the state of step {now.step}, "
            f"but the trainers of other ranks are alive and consuming ({where}): a trainer "
            "restarted alone cannot rewind a job that other ranks still read (a step goes to "
            "all ranks or to none). The live ranks go on undisturbed; to rewind, stop every "
            "trainer and restart them all from one checkpoint"
        )

    def _late(self) -> str:
        now = self.rewinding.open
        assert now is not None
        missing = sorted(set(range(self._dp)) - now.joined)
        return (
            f"rank(s) {sorted(now.joined)} reconnected with the state of step {now.step}, and "
            f"rank(s) {missing} did not within {self.plan.loading.timeout_s:.0f} s "
            "(loading.timeout_s): the job did not rewind; every rank must reconnect with the "
            "same checkpoint"
        )

    def _not_ours(self, state: dict[str, Any]) -> str | None:
        """Why ``state`` is not a state of this job (None: it is); raises CheckpointError."""
        check_state(state, self.plan)
        if STAMP in state and self.stamps is not None:
            problem = self.stamps.problem(state)
            if problem is None or not self._known(state):
                return problem
            return None  # another job's stamp, on the very state this job started from
        if self._known(state):
            return None
        step = int(state["step"])
        return (
            f"the state of step {step} carries no stamp of this job (written before "
            f"stamps, or by another job), and the job keeps no state of step {step} to "
            f"compare it with (it keeps steps {self.ledger.first} to {self.ledger.last}): "
            "restart the job from it instead (overlord serve --resume), or reconnect with a "
            "checkpoint this job handed out"
        )

    def _known(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` equals the state the job started from, or one it keeps."""
        step = int(state["step"])
        mine = {n: s.get("cursor") for n, s in state["sources"].items()}
        for kept in (self.ledger.kept(step), self.origin):
            if kept is None or int(kept["step"]) != step:
                continue
            # the sources both hold: a checkpoint of before a resume that added or removed
            # sources (overlord.state.changes) is the state the job started from (one that
            # shares none is refused before, by check_state)
            ours = {n: s["cursor"] for n, s in kept["sources"].items() if n in mine}
            if ours == {n: c for n, c in mine.items() if n in ours}:
                return True
        return False
