"""Client: one rank's batches in order; a repeated delivery is dropped, a wrong one refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.roundtrip import Part, check_save_restore

from overlord import Loader, LoaderError, load_plan
from overlord.batch import Batch
from overlord.ops.run import dump_line
from overlord.roles.client import Client
from overlord.runtime.inline import InlineHandle

STEPS = 7


def batch(step: int, rank: int = 1) -> Batch:
    z = np.zeros(0, dtype=np.int32)
    return Batch(step, rank, z, z, z, z, z, [], 0.0)


class Replays:
    """Answers the first request for step 1 with step 0 again (a retried call)."""

    def __init__(self) -> None:
        self.replayed = False

    def batch(self, step: int, rank: int) -> Batch:
        if step == 1 and not self.replayed:
            self.replayed = True
            return batch(0)
        return batch(step)


class Planner:
    def __init__(self) -> None:
        self.consumed: list[tuple[int, int]] = []

    def mark_consumed(self, rank: int, step: int, train_s=None, wait_s=None, since=None) -> None:
        self.consumed.append((rank, step))

    def state_dict(self, step: int | None = None) -> dict:
        return {"step": step}


def test_a_repeated_delivery_is_dropped_by_its_step_and_rank():
    planner = Planner()
    client = Client(1, InlineHandle(Replays(), "c"), InlineHandle(planner, "p"), 0, 3)
    assert [b.step for b in client] == [0, 1, 2]
    assert client.state_dict() == {"step": 3}  # the state at this rank's position
    assert planner.consumed == [(1, 0), (1, 1), (1, 2)]  # each step marked once, before it


def test_consumption_notices_leave_the_trainers_thread():
    """The planner's mark_consumed runs on the notices' thread; its error reaches next()."""
    import threading

    class Slow(Planner):
        def __init__(self) -> None:
            super().__init__()
            self.threads: set[str] = set()

        def mark_consumed(
            self, rank: int, step: int, train_s=None, wait_s=None, since=None
        ) -> None:
            self.threads.add(threading.current_thread().name)
            if step == 1:
                raise RuntimeError("planner on fire")
            super().mark_consumed(rank, step)

    planner = Slow()
    client = Client(1, InlineHandle(Replays(), "c"), InlineHandle(planner, "p"), 0)
    next(client), next(client)
    with pytest.raises(LoaderError, match="mark_consumed failed: RuntimeError: planner on fire"):
        client._notices.flush()  # what the next next() raises once the call has failed
    assert threading.current_thread().name not in planner.threads
    client.close()


def test_a_batch_of_another_step_is_refused():
    class Wrong(Replays):
        def batch(self, step: int, rank: int) -> Batch:
            return batch(step + 1)

    client = Client(1, InlineHandle(Wrong(), "c"), InlineHandle(Planner(), "p"), 0)
    with pytest.raises(LoaderError, match="asked for step 0 and received step 1"):
        next(client)


@pytest.mark.integration
def test_a_client_resumes_from_its_state(job_plan):
    def make(state: dict[str, Any] | None) -> tuple[Loader, Any]:
        loader = Loader(load_plan(job_plan), state=state)
        return loader, loader.client(0)

    check_save_restore(
        Part(
            make,
            lambda p: dump_line(next(p[1])),
            lambda p: p[1].state_dict(),
            lambda p: p[0].close(),
        ),
        STEPS,
    )


class Rewinding:
    """A planner whose rewind completes after ``waits`` asks, or is refused with ``refused``."""

    def __init__(self, waits: int, refused: str | None = None) -> None:
        self.waits, self.refused, self.asked = waits, refused, 0

    def rewound(self, rank: int) -> bool:
        self.asked += 1
        if self.refused is not None and self.asked > self.waits:
            raise LoaderError(self.refused)
        return self.asked > self.waits


def test_a_reconnected_client_starts_once_the_job_rewound_or_raises_its_refusal():
    """Its constructor may hold the dead trainer's batches of the same steps: not before."""
    from overlord.roles.client import wait_until_rewound

    planner = Rewinding(waits=3)
    wait_until_rewound(InlineHandle(planner, "planner"), 0, timeout_s=5.0)  # type: ignore[arg-type]
    assert planner.asked == 4  # asked until every rank had reconnected
    refused = Rewinding(waits=2, refused="rank(s) [1] did not within 5 s")
    with pytest.raises(LoaderError, match=r"rank\(s\) \[1\] did not"):
        wait_until_rewound(InlineHandle(refused, "planner"), 0, timeout_s=5.0)  # type: ignore[arg-type]
    with pytest.raises(LoaderError, match="did not rewind within"):  # a planner that never says
        wait_until_rewound(InlineHandle(Rewinding(waits=10**9), "planner"), 0, timeout_s=0.01)  # type: ignore[arg-type]
