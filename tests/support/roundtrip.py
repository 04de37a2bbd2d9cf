"""One save/restore check for every stateful part of overlord.

``check_save_restore`` runs a part step by step, takes its state at every
step boundary (through JSON, as a checkpoint would hold it), rebuilds a fresh
part from each of those states and checks that it continues with exactly the
outputs the uninterrupted part gave, and passes through the same states:
mid-stream, at the start, at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Generic, TypeVar

P = TypeVar("P")


class Part(Generic[P]):
    """How to drive one kind of stateful part."""

    def __init__(
        self,
        make: Callable[[dict[str, Any] | None], P],
        advance: Callable[[P], Any],
        save: Callable[[P], dict[str, Any]],
        close: Callable[[P], None] = lambda part: None,
    ):
        self.make, self.advance, self.save, self.close = make, advance, save, close


def check_save_restore(part: Part[P], steps: int) -> list[Any]:
    """Compare the stream after every cut with the uninterrupted one; returns the outputs."""
    whole = part.make(None)
    outputs, states = [], []
    try:
        for _ in range(steps):
            states.append(json.loads(json.dumps(part.save(whole))))
            outputs.append(part.advance(whole))
    finally:
        part.close(whole)
    assert len({json.dumps(o, sort_keys=True, default=str) for o in outputs}) > 1, (
        "every step gave the same output: the check would not see a wrong restore"
    )
    for cut, state in enumerate(states):
        resumed = part.make(state)
        try:
            rest, seen = [], []
            for _ in range(steps - cut):
                seen.append(json.loads(json.dumps(part.save(resumed))))
                rest.append(part.advance(resumed))
        finally:
            part.close(resumed)
        assert rest == outputs[cut:], f"restored from the state before step {cut}: another stream"
        assert seen == states[cut:], f"restored from the state before step {cut}: other states"
    return outputs
