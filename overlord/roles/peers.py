"""The mesh ranks of one DP rank: what each receives, and when their step counts as consumed.

A DP rank's batch is planned once and built once (by its DataConstructor);
its ``cp * tp * pp`` trainer processes (its *peers*) each receive a view of it:

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from overlord.monitor.figures import Figures
    from overlord.plan.spec import Plan


class PeerConsumption:
    """The planner's part that counts a DP rank's step consumed once its attached peers have.

    Mixed into the Planner, whose ``mark_consumed(dp_rank, step)`` it calls.
    """

    plan: Plan
    consumed: list[int]
    figures: Figures

    def mark_consumed(
        self,
        rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """The planner's: DP rank ``rank`` received ``step``."""
        raise AssertionError("mixed into the Planner, which defines it")  # pragma: no cover

    def _peer_steps(self) -> dict[int, int]:
        """Last step each attached global rank received."""
        steps: dict[int, int] | None = self.__dict__.get("_peer_at")
        if steps is None:
            steps = self.__dict__["_peer_at"] = {}
        return steps

    def attach(self, global_rank: int) -> int:
        """Count ``global_rank`` among its DP rank's readers; the next step it should consume."""
        dp = self.plan.world.coords(global_rank).dp
        at = self._peer_steps().setdefault(global_rank, self.consumed[dp])
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
        world = self.plan.world
        dp = world.coords(global_rank).dp
        steps = self._peer_steps()
        steps[global_rank] = max(step, steps.get(global_rank, step))
        low = min(steps[g] for g in world.ranks_of(dp) if g in steps)
        if low > self.consumed[dp]:
            self.mark_consumed(dp, low, train_s, wait_s, since)
        else:
            self.figures.trainer(dp, step, None, wait_s)
