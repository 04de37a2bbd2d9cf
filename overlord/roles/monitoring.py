"""The planner's monitoring reading: its figures, with what it asks of its pool and loaders."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.roles.api import LoaderRole

if TYPE_CHECKING:
    from overlord.roles.planner import Planner


def planner_figures(planner: Planner) -> dict[str, Any]:
    """Everything monitoring shows, from the planner's figures, its pool and its loaders.

    Loader counters are asked of the current primaries; a loader that cannot
    answer (dying, being replaced) is left out of this reading.
    """
    out = planner.figures.as_dict()
    names = planner.names
    pool = planner.pool
    stats: list[dict[str, Any]] = []
    for n in names:
        for k, h in enumerate(list(pool.primaries(n))):
            if h is None:
                continue
            try:
                s = h.call(LoaderRole.stats).result(timeout=10)
            except Exception:  # noqa: BLE001 - a dying loader: left out of this reading
                continue
            stats.append({**s, "slot": k})
    weights = np.asarray(planner.schedule.weights(planner.done + 1), dtype=np.float64)
    weights = weights / max(float(weights.sum()), 1e-300)
    sources: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(names):
        current = set(pool.current(n))
        mine = [s for s in stats if s["source"] == n]
        sources[n] = {
            "tokens": out["tokens"][n],
            "samples": out["samples"][n],
            "share": out["share"][n],
            "target_share": float(weights[i]),
            "epoch": int(planner.epoch_of(n)),
            "loaders": len(current),
            "threads": sum(int(s["threads"]) for s in mine if s["slot"] in current),
            "buffered_tokens": sum(int(s.get("held_tokens", 0)) for s in mine),
            "reads_in_flight": sum(int(s.get("reads_in_flight", 0)) for s in mine),
            "skipped": sum(int(s.get("skipped", 0)) for s in mine),
            "retries": sum(int(s.get("read_retries", 0)) for s in mine),
        }
    events = list(pool.events)
    out["sources"] = sources
    out["failovers"] = {
        "loader": sum(e.get("event") == "failover" for e in events),
        "planner": sum(e.get("event") == "planner-recovered" for e in events),
    }
    out["consumed"] = list(planner.consumed)
    out["next_step"] = planner.next_step
    return out
