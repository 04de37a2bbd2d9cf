"""Trainers that restart against a live job: the planner rewinds to their checkpoint.

When every trainer process dies and restarts from its own checkpoint (a
state the planner handed out, at step ``S``) while the job keeps running,
each reconnects with that state (``overlord.connect(job, rank, state=...)``).
The first to do so rewinds the job to ``S``: the plans of ``S`` on are
dropped, the cursors and the mixture go back to the state of ``S``, and the
SourceLoaders (not restarted) serve again what they hold from there on,
read-ahead included, so the steps from ``S`` are planned again exactly as
the uninterrupted stream had them.

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
from typing import TYPE_CHECKING, Any

from overlord.errors import CheckpointError, LoaderError
from overlord.state.checkpoint import check_state

if TYPE_CHECKING:
    from overlord.roles.planner import Planner

log = logging.getLogger("overlord.planner")


class TrainerRewind:
    """The planner's part that keeps checkpointed steps and rewinds to them (a mixin)."""

    def _rewind_state(self) -> dict[str, Any]:
        state: dict[str, Any] | None = self.__dict__.get("_rewind")
        if state is None:
            # checkpoint: the newest step whose state was handed out; open: the rewind in
            # progress (its step and the DP ranks that reconnected)
            state = self.__dict__["_rewind"] = {"checkpoint": None, "open": None, "joined": set()}
        return state

    def stale(self, since: int | None) -> bool:
        """Whether a notice of a client started at ``since`` predates the last rewind."""
        rewound = self._rewind_state()["open"]
        return since is not None and rewound is not None and since < rewound

    def checkpointed(self, step: int) -> None:
        """A state of ``step`` was handed out: trainers may rewind to it."""
        r = self._rewind_state()
        if r["checkpoint"] is None or step > r["checkpoint"]:
            r["checkpoint"] = step

    def keep_from(self, first: int) -> int:
        """The first step whose items stay held when every rank consumed up to ``first - 1``."""
        planner: Planner = self  # type: ignore[assignment]
        hold = planner.plan.recovery.rewind_steps
        ckpt = self._rewind_state()["checkpoint"]
        if not hold or ckpt is None:
            return first
        return max(min(ckpt, first), first - hold)

    def reconnect(self, rank: int, state: dict[str, Any]) -> int:
        """DP rank ``rank`` restarted from ``state``: rewind the job there (once); its step."""
        planner: Planner = self  # type: ignore[assignment]
        try:
            check_state(state, planner.plan)
        except CheckpointError as e:
            raise LoaderError(f"rank {rank} cannot reconnect with this state: {e}") from None
        step = int(state["step"])
        r = self._rewind_state()
        dp = planner.plan.world.dp
        if r["open"] is not None and len(r["joined"]) < dp:
            if step != r["open"]:
                raise LoaderError(
                    f"rank {rank} reconnects with the state of step {step}, but rank(s) "
                    f"{sorted(r['joined'])} reconnected with the state of step {r['open']}: "
                    "every rank must restart from the same checkpoint (a step goes to all "
                    "ranks or to none); restart the trainers from one checkpoint"
                )
            r["joined"].add(rank)
            return step
        self._rewind_to(step, state)
        r["open"], r["joined"] = step, {rank}
        return step

    def _rewind_to(self, step: int, state: dict[str, Any]) -> None:
        planner: Planner = self  # type: ignore[assignment]
        kept = planner.snapshots.get(step)
        if kept is None:
            lo, hi = min(planner.snapshots), max(planner.snapshots)
            raise LoaderError(
                f"cannot rewind the job to step {step}: it keeps states from step {lo} to {hi} "
                f"(recovery.rewind_steps={planner.plan.recovery.rewind_steps} steps before the "
                "newest checkpoint handed out); restart the job from the checkpoint instead "
                "(overlord serve --resume), or raise recovery.rewind_steps"
            )
        mine = {n: s["cursor"] for n, s in state["sources"].items()}
        if {n: s["cursor"] for n, s in kept["sources"].items() if n in mine} != mine:
            raise LoaderError(
                f"the state of step {step} a trainer reconnects with is not this job's state of "
                "that step (another run's checkpoint?): its source positions differ"
            )
        history = [h for h in planner.history if h["step"] < step]
        peers = planner.__dict__.get("_peer_at")
        planner._build(planner.state_dict(step))
        planner.history.extend(history)
        if peers is not None:
            for g in peers:
                peers[g] = step - 1
        # what each slot last sent is past the rewind: a shadow promoted now serves from the
        # cursor's own position (the pool asks the cursor, as after a planner restart)
        planner.pool._received.clear()
        planner.pool.rewind({n: planner._consumed_cursor(n) for n in planner.names})
        if planner.journal is not None:  # a planner restarted later resumes from here
            planner.journal.restart(planner._snapshot(), step - 1, planner.pool.record())
        planner.pool.events.append({"event": "trainers-rewound", "step": step})
        log.warning("trainers reconnected from step %d: the job rewound there", step)
