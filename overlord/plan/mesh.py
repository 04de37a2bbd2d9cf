"""The plan's device mesh: which CP layout applies, and the checks between mesh and batch.

Pure functions over the plan's plain data (validation) or a validated plan.
"""

from __future__ import annotations

from typing import Any

from overlord.world import DYNAMIC, CPLayout


def resolved_layout(cp: int, layout: CPLayout | None) -> CPLayout | None:
    """The CP layout in force: None without CP, ``per_document`` unless the plan says.

    >>> resolved_layout(1, CPLayout.ZIGZAG) is None, resolved_layout(2, None).value
    (True, 'per_document')
    """
    if cp <= 1:
        return None
    return layout if layout is not None else CPLayout.PER_DOCUMENT


def mesh_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Problems between ``world`` and ``batch`` in a plan's plain data, all of them.

    ``zigzag`` cuts every row of ``max_seq_len`` tokens into ``2 * cp`` equal
    chunks, so ``max_seq_len`` must be a multiple of ``2 * cp``.
    """
    world = data.get("world") if isinstance(data.get("world"), dict) else {}
    batch = data.get("batch") if isinstance(data.get("batch"), dict) else {}
    assert isinstance(world, dict) and isinstance(batch, dict)
    cp, seq, layout = world.get("cp", 1), batch.get("max_seq_len"), batch.get("cp_layout")
    problems: list[tuple[str, str]] = []
    if cp == DYNAMIC and layout is not None:
        problems.append(
            (
                "batch.cp_layout",
                f"cp: dynamic cuts each document for its own CP degree "
                f"(overlord.batch.cp_dynamic): leave cp_layout unset, found '{layout}'",
            )
        )
    if not (isinstance(cp, int) and isinstance(seq, int) and cp > 1 and seq > 0):
        return problems
    if layout == CPLayout.ZIGZAG.value and seq % (2 * cp):
        problems.append(
            (
                "batch.max_seq_len",
                f"cp_layout zigzag cuts each row into 2*cp={2 * cp} equal chunks: max_seq_len "
                f"must be a multiple of {2 * cp}, found {seq} (or use cp_layout: per_document)",
            )
        )
    return problems
