"""The state format: a step's delta, and applying it.

Every stateful part goes through one save/restore check (``support/roundtrip.py``),
in the test file of its module: test_cursor, test_select (the mixture),
test_autoscale, test_client, test_planner and test_torch (the dataset).
"""

from __future__ import annotations

from typing import Any

from overlord.state import format as statefmt

STEPS = 7


def test_apply_of_a_delta_gives_the_state_it_was_taken_from():
    def source(shard: int, placed: float, target: float) -> dict[str, Any]:
        cursor = {"epoch": 0, "shard_pos": shard, "index": 3, "skip": [[0, shard, 5, 1]]}
        return {"cursor": cursor, "placed": placed, "target": target, "files": [[0, []]]}

    before = {"step": 4, "sources": {"web": source(1, 100.0, 90.5), "code": source(0, 20.0, 30.5)}}
    after = {"step": 5, "sources": {"web": source(2, 164.0, 0.0), "code": source(0, 20.0, 0.0)}}
    weights = {"web": 0.75, "code": 0.25}
    # the targets grow by each weight times the step's tokens, as select_step adds them
    after["sources"]["web"]["target"] = 90.5 + 0.75 * 64
    after["sources"]["code"]["target"] = 30.5 + 0.25 * 64
    change = statefmt.delta(before, after)
    assert change == {"c": {"web": [0, 2, 3, [[0, 2, 5, 1]]]}, "p": {"web": 64}}
    assert statefmt.apply(before, change, lambda step: weights) == after
    assert before["sources"]["web"]["placed"] == 100.0  # apply copies
