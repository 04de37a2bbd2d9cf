"""Trainers that rewind a live job: which states are the job's, and the rewind as one transaction.

**A state of this job.** A job whose ranks are processes of their own (the
only kind trainers reconnect to) stamps every state it hands out with its
identity and a keyed digest: HMAC-SHA256, under a key the planner draws when
the job starts, over the canonical JSON of the state without its stamp. The
key is kept in the planner's journal folder, so a planner that Ray restarts
verifies the states of its predecessor. Recognising a state costs nothing per
step: the job keeps no list of the states it handed out, and any of them (the
newest, or an older checkpoint) is recognised. A state of another job,
another plan, or one edited by hand is refused with why. A state without a
stamp (written before stamps, or by a job resumed from it) is accepted only
where it equals a state the job can compare it with: the one it started
from, or one it still keeps.

**The transaction.** The first DP rank that reconnects opens a rewind; the
job does not move until every DP rank reconnected with the same state, and no
rank is served a step of it before. A rank refused meanwhile (another state,
another job, another plan) closes it: every rank that waited receives the
same error, and the job, which did not move, stays as it was (trainers may
reconnect again, each with one same checkpoint). A rank whose trainer is still
alive (its notices or its waits keep arriving while the rewind is open) shows
that a trainer restarted alone: the rewind is refused at once, naming the live
ranks and their steps, and they go on undisturbed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAMP = "job"  # the key of a state's stamp: {"id": job id, "digest": hex HMAC-SHA256}
KEY_FILE = "job-key.json"  # in the planner's journal folder: the key of a restarted planner
# A killed trainer's last calls (its consumption notices, a wait signal) can reach the planner
# after its successor reconnected: calls of different processes are not ordered. Only a sign
# of life this long after a rewind opened shows a trainer that still runs (a live one that
# waits signals every second; one that consumes, every step).
STALE_S = 3.0


def canonical(state: dict[str, Any]) -> bytes:
    """The bytes a stamp signs: ``state`` without its stamp, as sorted compact JSON."""
    body = {k: v for k, v in state.items() if k != STAMP}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


class Stamps:
    """The job's identity and key; stamps states and says whether one is the job's.

    ``folder``: where the key is kept (the planner's journal folder; None: in
    memory only, for a job no planner restarts).

    >>> stamps = Stamps(None)
    >>> state = stamps.stamp({"step": 3, "sources": {}})
    >>> stamps.problem(state) is None
    True
    >>> print(stamps.problem({**state, "step": 4}))
    its digest does not match its content: the state was edited after the job handed it out
    """

    def __init__(self, folder: str | None):
        found = _load(folder)
        if found is None:
            found = {"id": secrets.token_hex(8), "key": secrets.token_hex(32)}
            _save(folder, found)
        self.id: str = found["id"]
        self._key = bytes.fromhex(found["key"])

    def digest(self, state: dict[str, Any]) -> str:
        """The keyed digest of ``state``'s content."""
        return hmac.new(self._key, canonical(state), hashlib.sha256).hexdigest()

    def stamp(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with this job's stamp."""
        return {**state, STAMP: {"id": self.id, "digest": self.digest(state)}}

    def problem(self, state: dict[str, Any]) -> str | None:
        """Why a stamped ``state`` is not this job's; None: it is (raises on an unstamped one)."""
        stamp = state[STAMP]
        if not isinstance(stamp, dict) or not {"id", "digest"} <= set(stamp):
            return f"its stamp '{STAMP}' is not {{'id', 'digest'}}: found {stamp!r:.80}"
        if stamp["id"] != self.id:
            return (
                f"it was handed out by job {stamp['id']!r:.40}, and this job is {self.id!r} "
                "(another run, or the job before a restart from a checkpoint)"
            )
        if not hmac.compare_digest(str(stamp["digest"]), self.digest(state)):
            return (
                "its digest does not match its content: the state was edited after the job "
                "handed it out"
            )
        return None


def _load(folder: str | None) -> dict[str, str] | None:
    if folder is None:
        return None
    path = Path(folder) / KEY_FILE
    if not path.exists():
        return None
    found = json.loads(path.read_text())
    if not isinstance(found, dict) or not {"id", "key"} <= set(found):
        raise ValueError(f"{path}: not a job key (expected {{'id', 'key'}})")
    return {"id": str(found["id"]), "key": str(found["key"])}


def _save(folder: str | None, found: dict[str, str]) -> None:
    if folder is None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / KEY_FILE
    # readable by the job's owner only: the key is what makes a stamp the job's
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(found, f)


@dataclass
class Rewind:
    """A rewind in progress: the state, the DP ranks that reconnected with it, since when."""

    step: int
    body: bytes  # the state's canonical content: a rank reconnects with the same state or none
    state: dict[str, Any]
    joined: set[int]
    opened: float = field(default_factory=time.monotonic)


class Transaction:
    """The rewind in progress of a job of ``dp`` DP ranks, and the errors its ranks receive.

    ``heard(rank)``: a trainer of ``rank`` from before the rewind is alive
    (a notice, or a wait). The caller turns what :meth:`join`,
    :meth:`alive` and :meth:`age` say into a rewind or an error.
    """

    def __init__(self, dp: int):
        self.dp = dp
        self.open: Rewind | None = None
        self._refused: dict[int, str] = {}  # DP rank -> the error its waiting trainer receives
        self._alive: dict[int, tuple[float, int]] = {}  # rank -> (when, step) last heard

    def join(self, rank: int, state: dict[str, Any]) -> Rewind:
        """``rank`` reconnects with ``state`` (already found to be the job's); the rewind.

        Raises :class:`ValueError` with both states named if a rewind to
        another state is open (the caller refuses every waiting rank).
        """
        self._refused.pop(rank, None)
        body, step = canonical(state), int(state["step"])
        now = self.open
        if now is None:
            self.open = Rewind(step, body, state, {rank})
            return self.open
        if body != now.body:
            same = f"the state of step {step}"
            if step == now.step:
                same = f"another state of step {step}"
            raise ValueError(
                f"rank {rank} reconnects with {same}, but rank(s) {sorted(now.joined)} "
                f"reconnected with the state of step {now.step}: every rank must restart from "
                "the same checkpoint (a step goes to all ranks or to none); restart the "
                "trainers from one checkpoint"
            )
        now.joined.add(rank)
        return now

    def complete(self) -> bool:
        """Whether every DP rank joined the open rewind."""
        return self.open is not None and len(self.open.joined) == self.dp

    def close(self) -> Rewind | None:
        """The rewind is done (every rank joined): no rank waits any more."""
        done, self.open = self.open, None
        return done

    def refuse(self, message: str) -> None:
        """Close the open rewind with ``message``: each rank that waited receives it."""
        if self.open is not None:
            for r in self.open.joined:
                self._refused[r] = message
        self.open = None

    def heard(self, rank: int, step: int) -> None:
        """A trainer of ``rank`` from before the rewind is alive, at ``step``."""
        self._alive[rank] = (time.monotonic(), step)

    def alive(self) -> dict[int, int]:
        """The ranks not in the open rewind heard since it opened (after :data:`STALE_S`)."""
        now = self.open
        if now is None:
            return {}
        return {
            r: step
            for r, (when, step) in sorted(self._alive.items())
            if r not in now.joined and when >= now.opened + STALE_S
        }

    def refused(self, rank: int) -> str | None:
        """The error ``rank``'s waiting trainer receives (it stays until it reconnects)."""
        return self._refused.get(rank)

    def age(self) -> float:
        """Seconds the open rewind has waited (0: none open)."""
        return 0.0 if self.open is None else time.monotonic() - self.open.opened
