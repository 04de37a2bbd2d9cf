"""Client: what a training script holds, an iterator of one DP rank's batches."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from overlord.batch import Batch
from overlord.errors import LoaderError
from overlord.runtime.base import Handle, Runtime


class Client(Iterator[Batch]):
    """Batches of one DP rank, step after step, from ``start_step`` (until ``stop_step``)."""

    def __init__(
        self,
        rank: int,
        constructor: Handle,
        planner: Handle,
        runtime: Runtime,
        start_step: int,
        stop_step: int | None = None,
    ):
        self.rank = rank
        self._constructor, self._planner, self._runtime = constructor, planner, runtime
        self.step = start_step
        self.stop_step = stop_step
        self._returned: float | None = None  # when the last batch was handed over

    def __next__(self) -> Batch:
        """The next step's batch; marks it consumed for checkpoints."""
        if self.stop_step is not None and self.step >= self.stop_step:
            raise StopIteration
        # the trainer's own time since the last batch: the autoscaler's measure of demand
        now = time.perf_counter()
        train_s = None if self._returned is None else now - self._returned
        while True:
            batch: Batch = self._runtime.get(self._constructor.call("batch", self.step, self.rank))
            if (batch.step, batch.rank) == (self.step, self.rank):
                break
            if batch.step < self.step and batch.rank == self.rank:
                continue  # a delivery repeated by a retry: dropped by its key
            raise LoaderError(
                f"rank {self.rank} asked for step {self.step} and received step {batch.step} "
                f"of rank {batch.rank}"
            )
        # no need to wait: calls from one process reach the planner in order
        self._planner.call("mark_consumed", self.rank, self.step, train_s)
        self.step += 1
        self._returned = time.perf_counter()
        return batch

    def close(self) -> None:
        """Stop a constructor that runs in this process (``placement.constructors: trainer``)."""
        close = getattr(getattr(self._constructor, "obj", None), "close", None)
        if close is not None and getattr(self._constructor, "name", "").startswith(
            "constructor-local"
        ):
            close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The job's state as of this rank's position: what a resumed job starts from.

        Call it where the trainer checkpoints, once every rank has trained on
        the same step (as synchronous data-parallel training does).
        """
        state: dict[str, Any] = self._runtime.get(self._planner.call("state_dict", self.step))
        return state
