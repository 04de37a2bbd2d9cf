"""What each role answers: one Protocol per role, the types of every call across the seam.

A caller names the Protocol's method, ``planner.call(PlannerRole.rank_plan,
step, rank)``, so mypy checks the arguments and the result at every call site;
the runtime sends the method's name. The roles' classes are checked against
these Protocols where they are defined. One actor may serve several
Protocols (the planner serves three, by concern): each caller holds the
handle under the narrowest one it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from overlord.batch import Batch
    from overlord.runtime.base import Handle

# A loader's metadata block: ``epoch``, ``shard_pos``, ``file_index``, ``index`` and the
# items' columns; ``stop`` (the index after the piece's last item) and ``last`` (the
# shard's closing block, with no item). A closing block's end, as a key's index:
SHARD_END = 1 << 62


class LoaderRole(Protocol):
    """A SourceLoader: reads one source's shards ahead and holds their tokens."""

    def metadata(self, timeout: float) -> list[dict[str, Any]]:
        """Blocks of item metadata read since the last call (``timeout`` 0: no wait, no error)."""
        ...

    def take(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """The tokens of items ``[[epoch, shard_pos, index], ...]``."""
        ...

    def release(self, keys: np.ndarray) -> None:
        """Free items whose step every rank consumed."""
        ...

    def promote(self, after: list[int] | None) -> None:
        """Serve metadata after key ``after``, a block's end (a shadow whose primary died)."""
        ...

    def rewind(self, start: dict[str, Any], seek: bool = False) -> None:
        """Serve metadata again from a source cursor's state (a restarted planner, a rewind).

        ``seek``: items the state needs were released; read again from its shard.
        """
        ...

    def freeze(self) -> list[int] | None:
        """Start no new shard; the first shard not started (None: it owns no more)."""
        ...

    def until(self, limit: list[int]) -> None:
        """Read on, but only the shards before ``limit``."""
        ...

    def set_threads(self, threads: int) -> None:
        """Read ``threads`` shards at once."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and measured costs."""
        ...

    def pid(self) -> int:
        """The loader's process."""
        ...

    def close(self) -> None:
        """Stop reading and free every held shard."""
        ...


class PlannerRole(Protocol):
    """The planner as the trainers and constructors see it: step plans and consumption.

    The planner actor serves three Protocols; a caller holds the narrowest it
    needs: this one (clients, constructors), :class:`PoolRole` (whoever meets
    a dead loader or controls the loaders) or :class:`OpsRole` (operations).
    """

    def rank_plan(self, step: int, rank: int) -> dict[str, Any] | None:
        """One rank's plan of one step (None: ask again later)."""
        ...

    def ranks_plan(self, step: int, rank: int, first: int, count: int) -> dict[str, Any] | None:
        """The plans of ``count`` ranks from ``first``, asked by ``rank`` (None: later)."""
        ...

    def mark_consumed(
        self,
        rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """``rank`` received ``step`` (after training ``train_s`` and waiting ``wait_s``).

        ``since``: the step the sender's client started at.
        """
        ...

    def attach(self, global_rank: int) -> int:
        """Count a mesh rank among its DP rank's readers; the next step it should consume."""
        ...

    def mark_rank_consumed(
        self,
        global_rank: int,
        step: int,
        train_s: float | None = None,
        wait_s: float | None = None,
        since: int | None = None,
    ) -> None:
        """Mesh rank ``global_rank`` received ``step`` (``since``: as for mark_consumed)."""
        ...

    def position(self, rank: int) -> int:
        """The next step ``rank`` should consume."""
        ...

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The state before ``step``."""
        ...

    def reconnect(self, rank: int, state: dict[str, Any]) -> int:
        """DP rank ``rank`` restarted from ``state``: rewind the job there; the step."""
        ...

    def waiting(self, rank: int, step: int, since: int | None = None) -> None:
        """A trainer of ``rank`` has waited a while for ``step``: it is alive."""
        ...

    def rewound(self, rank: int) -> bool:
        """Whether DP rank ``rank`` may be served: no rewind it joined waits for other ranks.

        Raises the error of a rewind it joined that was refused.
        """
        ...

    def report(
        self, rank: int, step: int, seconds: float, losses: dict[str, float] | None = None
    ) -> None:
        """DP rank ``rank`` trained ``step`` in ``seconds`` (mean ``losses`` per source)."""
        ...


class PoolRole(Protocol):
    """The planner's loaders (its pool): spawning, failover, partitions, threads."""

    def start(self) -> None:
        """Spawn the loaders (a restarted planner finds its own)."""
        ...

    def primaries(self, source: str) -> list[Handle[LoaderRole] | None]:
        """The primary of every slot of ``source``."""
        ...

    def failover(self, source: str, k: int, dead: str) -> Handle[LoaderRole]:
        """Replace the dead primary of slot ``k`` of ``source``; the new primary."""
        ...

    def slots(self) -> dict[str, list[list[Handle[LoaderRole]]]]:
        """Every slot's replicas (primary first), per source."""
        ...

    def repartition(self, source: str, count: int) -> list[int] | None:
        """Read ``source`` with ``count`` loaders from a shard boundary on."""
        ...

    def set_threads(self, source: str, threads: int) -> None:
        """Reader threads of every current loader of ``source``."""
        ...


class OpsRole(Protocol):
    """The planner as operations see it: dry runs, the job's layout, figures, its process."""

    def dry_run(self, steps: int) -> list[dict[str, Any]]:
        """Plan ``steps`` steps without building batches."""
        ...

    def layout(self) -> dict[str, Any]:
        """What a connecting trainer needs: the plan, the files, the loaders."""
        ...

    def stats(self) -> dict[str, Any]:
        """History, positions, faults, scaling, journal."""
        ...

    def monitor(self) -> dict[str, Any]:
        """What monitoring shows: counters, histograms, per source and per rank figures."""
        ...

    def feedback(self, step: int) -> dict[int, dict[str, float | None]] | None:
        """Each rank's predicted cost and reported seconds for ``step`` (None: not kept)."""
        ...

    def metrics_url(self) -> str | None:
        """The Prometheus endpoint's URL (None: not served)."""
        ...

    def replay_point(self, step: int) -> dict[str, Any]:
        """What a replay of ``step`` needs: the plan, the state before it if kept, the journal."""
        ...

    def add_quarantine(
        self, ids: list[str], files: list[str], from_step: int | None = None
    ) -> dict[str, Any]:
        """Skip samples ``ids`` and the files of ``files`` from ``from_step`` on."""
        ...

    def pid(self) -> int:
        """The planner's process."""
        ...

    def close(self) -> None:
        """Stop serving metrics; close the journal."""
        ...


class AssignerRole(Protocol):
    """An assigner: balances groups of a hierarchical step's ranks for the planner."""

    def assign(self, jobs: list[dict[str, Any]]) -> list[np.ndarray]:
        """The rows of each group's items, among the group's own rows."""
        ...

    def pid(self) -> int:
        """The assigner's process."""
        ...

    def close(self) -> None:
        """Nothing to free."""
        ...


class ConstructorRole(Protocol):
    """A DataConstructor: builds the batches of some DP ranks."""

    def batch(self, step: int, rank: int) -> Batch:
        """The packed batch of ``rank`` for ``step``."""
        ...

    def rank_batch(self, step: int, global_rank: int) -> Batch:
        """What mesh rank ``global_rank`` receives of its DP rank's batch for ``step``."""
        ...

    def rank_batch_ref(self, step: int, global_rank: int) -> list[Any]:
        """The same, as ``[ref]``: one object of the store it was given (the wiring's choice)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Batches packed, of how many distinct ``(step, rank)``, their bytes, calls sent."""
        ...

    def pid(self) -> int:
        """The constructor's process."""
        ...

    def close(self) -> None:
        """Stop building ahead."""
        ...
