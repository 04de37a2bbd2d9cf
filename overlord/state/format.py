"""The job's state as data: its format, and how one step changes it.

A state is the JSON document a checkpoint holds: where each source's order
resumes, what the mixture has placed, and each source's files::

    {"version": 3, "fingerprint": "...", "step": 12,
     "sources": {"web": {"fingerprint": "...", "cursor": {"epoch", "shard_pos", "index", "skip"},
                         "target": 812.5, "placed": 790.0,
                         "files": [[0, [["data/web/a.jsonl", 1234], ...]]]}}}

One planned step changes only the cursors that moved and the tokens each
source placed: that is its *delta*. The mixture targets follow from the placed
tokens and the schedule, so :func:`apply` recomputes them exactly as
:func:`overlord.plan.select.select_step` adds them. The planner's journal
(:mod:`overlord.state.journal`) stores snapshots and deltas; :func:`replay` turns
them back into states. Nothing here imports a role.

A job whose trainers report (:mod:`overlord.roles.feedback`) may hold one more
key, ``feedback``: the cost model in force and its refits, the adapted mixture
and its adaptations. It is absent until something was refit or adapted, and a
step that changes it carries it whole in its delta (``"f"``); its ``weights``,
when present, are the weights the last step was planned with, which
:func:`apply` then uses for the targets instead of the schedule's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# 2: each source's files are part of the state (1 held a fingerprint of their names)
# 3: shards stream in blocks and windows; an item's index is its place in that order
STATE_VERSION = 3

Weights = Callable[[int], Mapping[str, float]]  # the schedule's weight of each source at a step


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one step changed: the cursors that moved, and the tokens each source placed.

    A cursor is ``[epoch, shard_pos, index, skip]``. JSON round trip, so that
    it compares equal to a delta read back from the journal.

    >>> a = {"sources": {"web": {"cursor": {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []},
    ...                          "placed": 0.0}}}
    >>> b = {"sources": {"web": {"cursor": {"epoch": 0, "shard_pos": 1, "index": 0, "skip": []},
    ...                          "placed": 64.0}}}
    >>> delta(a, b)
    {'c': {'web': [0, 1, 0, []]}, 'p': {'web': 64}}
    """
    cursors, placed = {}, {}
    for name, b in before["sources"].items():
        a = after["sources"][name]
        if a["cursor"] != b["cursor"]:
            c = a["cursor"]
            cursors[name] = [c["epoch"], c["shard_pos"], c["index"], c["skip"]]
        inc = a["placed"] - b["placed"]
        if inc:
            placed[name] = int(inc)
    change: dict[str, Any] = {"c": cursors, "p": placed}
    if after.get("feedback") != before.get("feedback"):  # absent unless trainers report
        change["f"] = after.get("feedback")
    out: dict[str, Any] = json.loads(json.dumps(change))
    return out


def apply(state: dict[str, Any], change: dict[str, Any], weights: Weights) -> dict[str, Any]:
    """The state after planning step ``state["step"]``, from that step's delta."""
    # a state is JSON: a round trip copies it whole, files lists and all, many times faster
    # than a deep copy (a replay applies a segment's deltas, up to snapshot_every of them)
    out: dict[str, Any] = json.loads(json.dumps(state))
    step = int(state["step"])
    out["step"] = step + 1
    if "f" in change:
        out["feedback"] = change["f"]
    for name, (epoch, shard_pos, index, skip) in change.get("c", {}).items():
        cursor = {"epoch": epoch, "shard_pos": shard_pos, "index": index, "skip": skip}
        out["sources"][name]["cursor"] = cursor
    total = 0.0
    for name, inc in change.get("p", {}).items():
        out["sources"][name]["placed"] += inc
        total += inc
    # the mixture target grows by each source's weight times the step's tokens,
    # exactly as select_step adds it
    w = (out.get("feedback") or {}).get("mix", {}).get("weights") or weights(step)
    for name, source in out["sources"].items():
        source["target"] = float(np.float64(source["target"]) + np.float64(w[name]) * total)
    return out


def replay(
    segments: Sequence[tuple[dict[str, Any], Sequence[dict[str, Any]]]], weights: Weights
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Every state and every delta that journal segments (a snapshot, then deltas) hold.

    Returns ``(states by step, deltas by step)``; the first segment to reach a
    step wins.
    """
    states: dict[int, dict[str, Any]] = {}
    deltas: dict[int, dict[str, Any]] = {}
    for snapshot, changes in segments:
        state = snapshot
        states.setdefault(state["step"], state)
        for change in changes:
            deltas[state["step"]] = change
            state = apply(state, change, weights)
            states.setdefault(state["step"], state)
    return states, deltas
