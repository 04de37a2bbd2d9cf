"""Trainers' step reports in node mode: every rank's reach the node's planner, through rank 0.

Node mode's channel (:mod:`overlord.dist.channel`) carries batches from rank 0
to the other ranks; a report (:meth:`overlord.roles.client.Client.report`)
travels the other way, in the same gloo group under a tag of its own
(:data:`TAG`), as one float64 tensor of fixed size: the step, the seconds,
then the mean loss of each source of the plan in plan order (NaN where not
reported). Nothing is pickled.

Rank 0 keeps one receive posted per rank (:class:`ReportReceiver`) and hands
what arrived to its Loader's client of that rank whenever it polls (between
the batches it sends). A rank sends without waiting (:class:`ReportSender`);
past :data:`IN_FLIGHT` reports not yet taken, a report is dropped and
counted, never waited on. At its end a rank sends a last message (step -1),
so that rank 0 does not leave a receive pending when the stream ends.
"""

from __future__ import annotations

import datetime
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

TAG = 7  # reports travel under their own tag: they never meet a batch's messages
IN_FLIGHT = 64  # a rank's reports not yet taken by rank 0; past it, one is dropped
_LAST = -1.0  # the step of a rank's last message: it sends no more reports

Forward = Callable[[int, int, float, dict[str, float] | None], None]


def _vector(
    names: Sequence[str], step: float, seconds: float, losses: dict[str, float] | None
) -> torch.Tensor:
    losses = losses or {}
    values = [step, seconds] + [losses.get(n, math.nan) for n in names]
    return torch.tensor(values, dtype=torch.float64)


class ReportSender:
    """A rank's reports to rank 0 (any rank but 0), sent without waiting."""

    def __init__(self, group: Any, names: Sequence[str], timeout_s: float):
        self.group, self.names, self.timeout_s = group, list(names), timeout_s
        self._sent: deque[Any] = deque()
        self.dropped = 0
        self._ended = False

    def send(self, step: int, seconds: float, losses: dict[str, float] | None) -> None:
        """Send one report; dropped (counted) if rank 0 has not taken the earlier ones."""
        while self._sent and self._sent[0].is_completed():
            self._sent.popleft()
        if self._ended or len(self._sent) >= IN_FLIGHT:
            self.dropped += 1
            return
        t = _vector(self.names, float(step), float(seconds), losses)
        self._sent.append(dist.isend(t, dst=0, group=self.group, tag=TAG))

    def end(self) -> None:
        """The last message: rank 0 stops receiving from this rank (waits at most the timeout)."""
        if self._ended:
            return
        self._ended = True
        work = dist.isend(_vector(self.names, _LAST, 0.0, None), dst=0, group=self.group, tag=TAG)
        try:
            if work is not None:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - rank 0 is gone: nothing waits for this rank's reports
            pass


class ReportReceiver:
    """Rank 0's receives of every other rank's reports, handed to ``forward(rank, ...)``."""

    def __init__(self, group: Any, names: Sequence[str], ranks: Sequence[int], forward: Forward):
        self.group, self.names, self.forward = group, list(names), forward
        self._posted: dict[int, tuple[torch.Tensor, Any]] = {}
        for r in ranks:
            self._post(r)

    def _post(self, rank: int) -> None:
        t = torch.empty(2 + len(self.names), dtype=torch.float64)
        self._posted[rank] = (t, dist.irecv(t, src=rank, group=self.group, tag=TAG))

    def _take(self, rank: int) -> None:
        t, _ = self._posted.pop(rank)
        values = t.tolist()
        if values[0] == _LAST:
            return  # the rank sends no more: its receive is not posted again
        losses = {n: v for n, v in zip(self.names, values[2:]) if not math.isnan(v)}
        self._post(rank)
        self.forward(rank, int(values[0]), float(values[1]), losses or None)

    def poll(self) -> None:
        """Hand over every report that has arrived; post the next receives."""
        for rank in list(self._posted):
            while rank in self._posted and self._posted[rank][1].is_completed():
                self._take(rank)

    def drain(self, ranks: Sequence[int], timeout_s: float) -> None:
        """At the stream's end: take ``ranks``' reports up to their last message (bounded waits)."""
        wait = datetime.timedelta(seconds=timeout_s)
        for rank in ranks:
            while rank in self._posted:
                try:
                    self._posted[rank][1].wait(timeout=wait)
                except Exception:  # noqa: BLE001 - the rank is gone: nothing more comes
                    self._posted.pop(rank, None)
                    break
                self._take(rank)
