"""How far a source reads ahead: the token budget its loaders share. Pure."""

from __future__ import annotations

from overlord.plan.spec import Plan


def token_budget(plan: Plan, loaders: int = 1) -> int:
    """Tokens one of ``loaders`` loaders of a source holds before its reader waits.

    Items stay held until their step is consumed by every rank. The planner
    plans at most ``prefetch_steps + 1`` steps past the last consumed one, so a
    source may have to hold those steps, the step being planned and the items
    its lookahead skips; one step more of slack covers releases in flight.
    That is the source's read-ahead, shared by its loaders: more loaders read
    in parallel, not further ahead (which would cost memory, push a
    re-partition's boundary further out, and read tokens a run never uses).

    A share can be smaller than what the planner holds of one loader (its
    shards are the large ones), so the budget alone could stop a loader whose
    next shard the planner waits for. It does not: a waiting ``metadata`` or
    ``take`` lets the reader publish past the budget. The excess is bounded by
    what the planner can hold (the steps above), as it waits only for items it
    needs.
    """
    b = plan.batch
    total = (b.prefetch_steps + 3) * b.tokens_per_step + b.lookahead * b.max_seq_len
    total += plan.recovery.rewind_steps * b.tokens_per_step  # kept for trainers that rewind
    return -(-total // max(1, loaders))
