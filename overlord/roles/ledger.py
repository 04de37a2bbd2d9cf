"""The planner's ledger: the job's state before each step that not every rank has consumed.

A state (:mod:`overlord.state.format`) is where each source's order stands
(its cursor), how far the mixture has come (its target and placed tokens)
and the files each source reads, before one step. The planner records one
after each step it plans; the ledger keeps them until every rank consumed
the step (longer for steps trainers may rewind to) and hands out the one a
checkpoint asks for. It is the only part of the planner a checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from overlord.errors import LoaderError
from overlord.plan.select import MixState
from overlord.plan.spec import Plan
from overlord.roles.cursor import CursorMark, SourceCursor, cursor_state
from overlord.state import format as statefmt
from overlord.state.changes import DROPPED


class Ledger:
    """The states before each step still kept, by step.

    ``files``: each source's file record (constant for the job), as a state
    holds it.
    """

    def __init__(self, plan: Plan, files: dict[str, Any]):
        self.plan, self.names, self.files = plan, plan.source_names, files
        self._states: dict[int, dict[str, Any] | Marked] = {}
        # sources a resume removed, and at which step: part of every state from then on
        # (absent while none was, so that a run that removes none writes what it always did)
        self.dropped: list[dict[str, Any]] = []

    def mark(
        self,
        step: int,
        cursors: Sequence[SourceCursor],
        mix: MixState,
        feedback: dict[str, Any] | None = None,
        quarantine: list[dict[str, Any]] | None = None,
    ) -> Marked:
        """The state before ``step`` of cursors and a mixture that stand there, as marks.

        The few values a state is built from (:meth:`Marked.state`), taken now.
        The planner keeps one after every step (:meth:`keep`), but a state is
        read for few of them (a checkpoint, a journal, a rank's reconnection):
        it is built then.

        ``feedback``: what trainers' reports changed (:mod:`overlord.roles.feedback`);
        None leaves the key out, as a state without reports always had it.
        ``quarantine``: its additions (:mod:`overlord.roles.quarantine`); the key is
        left out when there are none, so a run without one writes what it always wrote.
        """
        dropped = [dict(d) for d in self.dropped] if self.dropped else None
        return Marked(
            self, step, [c.mark() for c in cursors], mix.target.copy(), mix.placed.copy(),
            dropped, feedback, quarantine or None,
        )  # fmt: skip

    def _state(self, step: int, state: dict[str, Any] | Marked) -> dict[str, Any]:
        """A kept state, built (once) if it was kept as a :class:`Marked`."""
        if isinstance(state, Marked):
            state = self._states[step] = state.state()
        return state

    def keep(self, step: int, state: dict[str, Any] | Marked) -> None:
        """Keep ``state``, the state before ``step`` (a :class:`Marked`: built when read)."""
        self._states[step] = state

    def quarantine(self, entries: list[dict[str, Any]]) -> None:
        """Every kept state holds ``entries``: a checkpoint taken from now on carries them."""
        for state in self._states.values():
            if isinstance(state, Marked):
                state.quarantine = [dict(e) for e in entries]
            else:
                state["quarantine"] = [dict(e) for e in entries]

    def restart(self, step: int, state: dict[str, Any] | Marked) -> None:
        """Keep only ``state``, the state before ``step`` (planning starts there)."""
        self._states = {step: state}

    def kept(self, step: int) -> dict[str, Any] | None:
        """The state before ``step``, if it is kept."""
        state = self._states.get(step)
        return None if state is None else self._state(step, state)

    def at(self, step: int) -> dict[str, Any]:
        """The state before ``step``, which must be kept (a step being planned or consumed)."""
        return self._state(step, self._states[step])

    @property
    def first(self) -> int:
        """The earliest step whose state is kept."""
        return min(self._states)

    @property
    def last(self) -> int:
        """The latest step whose state is kept."""
        return max(self._states)

    def state_dict(self, step: int) -> dict[str, Any]:
        """The state before ``step`` as a checkpoint holds it (JSON-serializable)."""
        if step not in self._states:
            raise LoaderError(
                f"no state for step {step}: states are kept from step {self.first} "
                f"to {self.last} (steps not yet consumed by every rank)"
            )
        return {
            "version": statefmt.STATE_VERSION,
            "fingerprint": self.plan.stream_fingerprint(),
            **self.at(step),
        }

    def cursor(self, step: int, source: str) -> dict[str, Any]:
        """Where ``source``'s order stands before ``step`` (a kept mark is read, not built)."""
        kept = self._states[step]
        if isinstance(kept, Marked):
            return cursor_state(kept.cursors[self.names.index(source)])
        cursor: dict[str, Any] = kept["sources"][source]["cursor"]
        return cursor

    def prune(self, first: int) -> None:
        """Forget the states before step ``first``."""
        for s in [s for s in self._states if s < first]:
            del self._states[s]

    def forget(self, step: int) -> None:
        """Forget the state before ``step`` (a step planned only to be looked at)."""
        self._states.pop(step, None)


class Marked:
    """A state before one step, kept as the few values it is built from (:meth:`Ledger.mark`).

    Each source's cursor mark, the mixture's target and placed tokens (copies:
    planning moves them on), the sources dropped, the feedback section and the
    quarantine's additions as they stood then.
    """

    def __init__(
        self,
        ledger: Ledger,
        step: int,
        cursors: list[CursorMark],
        target: np.ndarray,
        placed: np.ndarray,
        dropped: list[dict[str, Any]] | None,
        feedback: dict[str, Any] | None,
        quarantine: list[dict[str, Any]] | None,
    ):
        self.ledger, self.step, self.cursors = ledger, step, cursors
        self.target, self.placed, self.dropped, self.feedback = target, placed, dropped, feedback
        self.quarantine = quarantine  # None: the key is left out

    def state(self) -> dict[str, Any]:
        """The state document (:mod:`overlord.state.format`) these marks stand for."""
        ledger = self.ledger
        target, placed = self.target.tolist(), self.placed.tolist()
        state: dict[str, Any] = {
            "step": self.step,
            "sources": {
                n: {
                    "fingerprint": ledger.plan.source_fingerprint(n),
                    "cursor": cursor_state(c),
                    "target": float(target[i]),
                    "placed": float(placed[i]),
                    "files": ledger.files[n],
                }
                for i, (n, c) in enumerate(zip(ledger.names, self.cursors))
            },
        }
        if self.dropped is not None:
            state[DROPPED] = self.dropped
        if self.feedback is not None:
            state["feedback"] = self.feedback
        if self.quarantine is not None:
            state["quarantine"] = self.quarantine
        return state
