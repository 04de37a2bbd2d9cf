"""How far a source reads ahead: the token budget its loaders share. Pure."""

from __future__ import annotations

from overlord.plan.spec import Plan


def peak_share(plan: Plan, source: str) -> float:
    """The largest share of a step's tokens ``source`` has at any point of the schedule.

    Between two points a linear schedule's weight lies between theirs, so the
    largest share over the points is the largest over every step.
    """
    if plan.mixture is None:
        return 1.0 / len(plan.sources)
    shares = []
    for point in plan.mixture.schedule:
        total = sum(point.weights.values())
        shares.append(point.weights.get(source, 0.0) / total if total > 0 else 0.0)
    return max(shares)


def token_budget(plan: Plan, loaders: int = 1, source: str | None = None) -> int:
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

    With ``source``, the budget is scaled by the source's peak share of the
    mixture (a source of 1/32 reads 1/32 as far ahead), with a floor of two
    rows: a job of many sources holds its read-ahead about once in all, not
    once per source. What that leaves out of the worst case (every skipped
    item of a step from one source, every one a full row) the lift above
    covers when it happens.
    """
    b = plan.batch
    total = (b.prefetch_steps + 3) * b.tokens_per_step + b.lookahead * b.max_seq_len
    total += plan.recovery.rewind_steps * b.tokens_per_step  # kept for trainers that rewind
    if source is not None:
        total = max(2 * b.max_seq_len, int(total * peak_share(plan, source)) + 1)
    return -(-total // max(1, loaders))
