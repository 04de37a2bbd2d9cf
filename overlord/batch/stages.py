"""Pipeline-stage views of a batch: which fields each stage of a DP rank's pipeline receives.

The first stage reads ``input_ids``, the last ``labels``; every stage reads the attention
arrays (positions, segments, ``cu_seqlens``) and the samples. A view shares the batch's
arrays; TP ranks of one ``(dp, cp, pp)`` coordinate receive the very same object.
"""

from __future__ import annotations

from dataclasses import replace

from overlord.batch import Batch


def stage_of(pp_rank: int, pp: int) -> str:
    """``all`` (no PP), ``first``, ``middle`` or ``last``: which fields a stage gets.

    >>> [stage_of(s, 3) for s in range(3)], stage_of(0, 1)
    (['first', 'middle', 'last'], 'all')
    """
    if pp == 1:
        return "all"
    return "first" if pp_rank == 0 else "last" if pp_rank == pp - 1 else "middle"


def stage_view(batch: Batch, stage: str) -> Batch:
    """The fields a pipeline stage uses; the arrays are shared with ``batch``, not copied."""
    if stage == "all":
        return batch
    return replace(
        batch,
        input_ids=batch.input_ids if stage == "first" else None,
        labels=batch.labels if stage == "last" else None,
    )
