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
checkpoint (a state the planner handed out, at step ``S``) while the job
keeps running, each reconnects with that state (``overlord.connect(job,
rank, state=...)``). The first to do so rewinds the job to ``S``: the plans
of ``S`` on are dropped, the cursors and the mixture go back to the state of
``S``, and the SourceLoaders (not restarted) serve again what they hold from
there on, read-ahead included, so the steps from ``S`` are planned again
exactly as the uninterrupted stream had them.

That needs the loaders to still hold the items of steps ``S`` and later,
which every rank had consumed. So the planner keeps the items of the steps
from the newest state it handed out (a trainer's checkpoint), at most
``recovery.rewind_steps`` steps back, instead of releasing them once
consumed: a job can rewind to a checkpoint of the last ``rewind_steps``
steps, at that cost in memory (each loader's budget grows by as much).

A rewind is one transaction over the ranks: it is open until every DP rank
has reconnected, and a rank that reconnects with another state meanwhile is
refused with both states named, never served a mixed stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from overlord.errors import CheckpointError, LoaderError
from overlord.monitor.figures import Figures
from overlord.plan.spec import Plan
from overlord.roles.ledger import Ledger
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
    - ``rewind(step)``: the planner plans again from the kept state before
      ``step`` (it calls :meth:`restart` on the way).
    """

    def __init__(
        self,
        plan: Plan,
        figures: Figures,
        ledger: Ledger,
        planned: Callable[[], int],
        settle: Callable[[int, int], None],
        rewind: Callable[[int], None],
    ):
        self.plan, self.figures, self.ledger = plan, figures, ledger
        self._world = plan.world
        self._dp = plan.world.dp
        self._planned, self._settle, self._rewind = planned, settle, rewind
        self.train_s: float | None = None  # moving average of the trainer's step time
        self._peers: dict[int, int] = {}  # last step each attached global rank received
        # the newest step whose state was handed out (trainers may rewind to it)
        self._checkpoint: int | None = None
        # the rewind in progress: its step, and the DP ranks that reconnected
        self._open: int | None = None
        self._joined: set[int] = set()
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
        """DP rank ``rank`` restarted from ``state``: rewind the job there (once); its step."""
        try:
            check_state(state, self.plan)
        except CheckpointError as e:
            raise LoaderError(f"rank {rank} cannot reconnect with this state: {e}") from None
        step = int(state["step"])
        if self._open is not None and len(self._joined) < self._dp:
            if step != self._open:
                raise LoaderError(
                    f"rank {rank} reconnects with the state of step {step}, but rank(s) "
                    f"{sorted(self._joined)} reconnected with the state of step {self._open}: "
                    "every rank must restart from the same checkpoint (a step goes to all "
                    "ranks or to none); restart the trainers from one checkpoint"
                )
            self._joined.add(rank)
            return step
        self._check_kept(step, state)
        self._rewind(step)
        for g in self._peers:
            self._peers[g] = step - 1
        self._open, self._joined = step, {rank}
        log.warning("trainers reconnected from step %d: the job rewound there", step)
        return step

    def _check_kept(self, step: int, state: dict[str, Any]) -> None:
        """Refuse a rewind to a state this job no longer keeps, or never had."""
        kept = self.ledger.kept(step)
        if kept is None:
            raise LoaderError(
                f"cannot rewind the job to step {step}: it keeps states from step "
                f"{self.ledger.first} to {self.ledger.last} "
                f"(recovery.rewind_steps={self.plan.recovery.rewind_steps} steps before the "
                "newest checkpoint handed out); restart the job from the checkpoint instead "
                "(overlord serve --resume), or raise recovery.rewind_steps"
            )
        mine = {n: s["cursor"] for n, s in state["sources"].items()}
        if {n: s["cursor"] for n, s in kept["sources"].items() if n in mine} != mine:
            raise LoaderError(
                f"the state of step {step} a trainer reconnects with is not this job's state of "
                "that step (another run's checkpoint?): its source positions differ"
            )
