"""Training topology as a value: the device mesh DP x CP x TP x PP and its rank order."""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from typing import Any, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

AXES = ("dp", "cp", "tp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"  # Megatron's: tp varies fastest, pp slowest
DYNAMIC = "dynamic"  # world.cp: each document its own CP degree (overlord.batch.cp_dynamic)


class CPLayout(str, Enum):
    """How a DP rank's rows are cut among its CP ranks (see :mod:`overlord.batch.cp`)."""

    ZIGZAG = "zigzag"
    PER_DOCUMENT = "per_document"


class Launch(NamedTuple):
    """Where the launcher (``torchrun``, SLURM) put this process: what the environment says."""

    rank: int  # this process's global rank
    size: int  # processes in all
    local_size: int | None  # processes on this process's node, where the launcher says
    launcher: str | None  # "torchrun" (WORLD_SIZE is set), "slurm", or None: started alone


class Coords(NamedTuple):
    """Where one trainer process sits in the mesh."""

    dp: int
    cp: int
    tp: int
    pp: int


class World(BaseModel):
    """The parallel layout of the trainer: a mesh of ``dp * cp * tp * pp`` processes.

    ``dp`` decides what the loader plans: each DP rank receives its own share of
    every step. The CP ranks of a DP rank each get a slice of its batch; its TP
    ranks get the same batch as each other; its pipeline stages get the fields
    they use. ``order`` lists the axes from the fastest-varying to the slowest,
    as Megatron does: with the default ``tp-cp-dp-pp`` the global rank is
    ``tp + TP * (cp + CP * (dp + DP * pp))``.

    >>> World(dp=4, tp=2).size
    8
    >>> World(dp=4, tp=2).dp_rank(5)
    2
    >>> w = World(dp=2, cp=2, tp=2, pp=2)
    >>> w.coords(13), w.global_rank(dp=1, cp=1, tp=1, pp=1)
    (Coords(dp=1, cp=0, tp=1, pp=1), 15)

    ``cp="dynamic"`` (ByteScale's HDP) gives each DP rank ``cp_max`` CP ranks
    (the CP axis has ``cp_max`` ranks: ``cp`` reads ``cp_max`` then) and each
    document its own degree (:func:`overlord.plan.cp.cp_degrees`), from
    ``tokens_per_cp_rank``:

    >>> d = World(dp=2, cp="dynamic", cp_max=4, tokens_per_cp_rank=8192)
    >>> d.cp, d.cp_dynamic, d.size, d.model_dump()["cp"]
    (4, True, 8, 'dynamic')
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(1, ge=1, description="data-parallel size")
    cp: int = Field(1, ge=1, description="context-parallel size")
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size")
    order: str = Field(
        DEFAULT_ORDER, description="the axes, fastest-varying first, joined by '-' (Megatron's)"
    )
    cp_max: int | None = Field(
        None, description="cp: dynamic only: CP ranks per DP rank, the largest degree"
    )
    tokens_per_cp_rank: int | None = Field(
        None, description="cp: dynamic only: the most tokens of one document on one CP rank"
    )

    @model_validator(mode="before")
    @classmethod
    def _dynamic(cls, data: Any) -> Any:
        """``cp: dynamic`` becomes ``cp = cp_max``; every problem of the CP keys at once."""
        if not isinstance(data, dict):
            return data
        problems = dynamic_problems(data)
        if problems:
            raise ValueError("; ".join(f"world.{field}: {msg}" for field, msg in problems))
        if data.get("cp") == DYNAMIC:
            data = {**data, "cp": data["cp_max"]}
        return data

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.cp_dynamic:
            out["cp"] = DYNAMIC  # what the plan said: a dump validates back to the same world
        else:  # a static world dumps as it always did
            out.pop("cp_max", None)
            out.pop("tokens_per_cp_rank", None)
        return out

    @field_validator("order")
    @classmethod
    def _order(cls, v: str) -> str:
        if sorted(v.split("-")) != sorted(AXES):
            raise ValueError(
                f"must name each of dp, cp, tp, pp once, joined by '-' (e.g. {DEFAULT_ORDER}), "
                f"found '{v}'"
            )
        return v

    @property
    def cp_dynamic(self) -> bool:
        """Whether each document gets its own CP degree (``cp: dynamic``)."""
        return self.tokens_per_cp_rank is not None

    @property
    def size(self) -> int:
        """Number of trainer processes: dp * cp * tp * pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def peers(self) -> int:
        """Processes that share one DP rank's batch: cp * tp * pp."""
        return self.cp * self.tp * self.pp

    def _axes(self) -> list[str]:
        return self.order.split("-")

    def coords(self, global_rank: int) -> Coords:
        """The ``(dp, cp, tp, pp)`` coordinates of a global rank."""
        self._check(global_rank)
        at: dict[str, int] = {}
        rest = global_rank
        for axis in self._axes():
            size = getattr(self, axis)
            at[axis], rest = rest % size, rest // size
        return Coords(**at)

    def global_rank(self, dp: int = 0, cp: int = 0, tp: int = 0, pp: int = 0) -> int:
        """The global rank at the given coordinates (the inverse of :meth:`coords`)."""
        at = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
        bad = [f"{a}={at[a]} (size {getattr(self, a)})" for a in AXES
               if not 0 <= at[a] < getattr(self, a)]  # fmt: skip
        if bad:
            raise ValueError(f"coordinates outside the world: {', '.join(bad)}")
        rank, stride = 0, 1
        for axis in self._axes():
            rank += at[axis] * stride
            stride *= getattr(self, axis)
        return rank

    def dp_rank(self, global_rank: int) -> int:
        """DP rank of a global rank, in the world's order."""
        return self.coords(global_rank).dp

    def ranks_of(self, dp: int) -> list[int]:
        """Every global rank of DP rank ``dp`` (its CP, TP and PP peers), ascending."""
        return sorted(
            self.global_rank(dp=dp, cp=c, tp=t, pp=p)
            for c in range(self.cp)
            for t in range(self.tp)
            for p in range(self.pp)
        )

    def _check(self, global_rank: int) -> None:
        if not 0 <= global_rank < self.size:
            raise ValueError(
                f"rank {global_rank} is outside a world of {self.size} processes "
                f"(dp={self.dp}, cp={self.cp}, tp={self.tp}, pp={self.pp})"
            )

    @classmethod
    def detect(
        cls,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        env: Mapping[str, str] | None = None,
        plan: Any = None,
    ) -> World:
        """Read the world size that ``torchrun`` (or SLURM) put in the environment.

        The model-parallel sizes are not in the environment: pass them, or pass
        the plan (a :class:`~overlord.Plan` or its ``World``), whose ``cp``,
        ``tp``, ``pp`` and ``order`` are then used. The data-parallel size is
        what remains of ``WORLD_SIZE``; ``RANK`` must fall inside the world.
        """
        launch = cls.launch(env)
        axes: World | None = getattr(plan, "world", plan)
        dynamic: dict[str, Any] = {}
        if axes is not None:
            cp, tp, pp = axes.cp, axes.tp, axes.pp
            if axes.cp_dynamic:
                per_rank = axes.tokens_per_cp_rank
                dynamic = {"cp": DYNAMIC, "cp_max": cp, "tokens_per_cp_rank": per_rank}
        order = axes.order if axes is not None else DEFAULT_ORDER
        size = launch.size
        per_replica = cp * tp * pp
        if size % per_replica:
            raise ValueError(
                f"WORLD_SIZE={size} is not a multiple of cp*tp*pp={per_replica}: "
                "check the parallel sizes passed to World.detect()"
            )
        world = cls(**{"dp": size // per_replica, "cp": cp, "tp": tp, "pp": pp, "order": order,
                       **dynamic})  # fmt: skip
        world._check(launch.rank)
        return world

    @staticmethod
    def launch(env: Mapping[str, str] | None = None) -> Launch:
        """Where the launcher put this process: the one reader of the environment.

        ``RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (torchrun), or
        ``SLURM_PROCID`` and ``SLURM_NTASKS``; a process started alone is rank 0
        of 1. Nothing else in overlord reads these variables: the rest takes a
        :class:`World` or this value.

        >>> World.launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
        Launch(rank=3, size=8, local_size=4, launcher='torchrun')
        >>> World.launch({})
        Launch(rank=0, size=1, local_size=None, launcher=None)
        """
        env = os.environ if env is None else env
        size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
        rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
        local = env.get("LOCAL_WORLD_SIZE")
        launcher = "torchrun" if "WORLD_SIZE" in env else "slurm" if "SLURM_NTASKS" in env else None
        return Launch(rank, size, None if local is None else int(local), launcher)

    @staticmethod
    def rank_from_env(env: Mapping[str, str] | None = None) -> int:
        """Global rank of this process, from ``RANK`` (torchrun) or ``SLURM_PROCID``."""
        return World.launch(env).rank


def _power_of_two(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 2 and x & (x - 1) == 0


def dynamic_problems(world: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Problems of a world's CP keys (plain data), each with its field under ``world``.

    >>> for problem in dynamic_problems({"cp": "dynamic", "cp_max": 3}):
    ...     print(problem)
    ('cp_max', 'must be a power of two >= 2, found 3')
    ('tokens_per_cp_rank', 'cp: dynamic needs it (an integer > 0), found none')
    >>> dynamic_problems({"cp": 2, "cp_max": 4})
    [('cp_max', "only with cp: dynamic (this world's cp is 2)")]
    """
    cp = world.get("cp", 1)
    cp_max, per_rank = world.get("cp_max"), world.get("tokens_per_cp_rank")
    problems: list[tuple[str, str]] = []
    if cp != DYNAMIC:
        if isinstance(cp, str) and not cp.strip().isdigit():
            problems.append(("cp", f"must be an integer >= 1 or '{DYNAMIC}', found '{cp}'"))
        for field, value in (("cp_max", cp_max), ("tokens_per_cp_rank", per_rank)):
            if value is not None:
                problems.append((field, f"only with cp: {DYNAMIC} (this world's cp is {cp})"))
        return problems
    if cp_max is None:
        problems.append(("cp_max", "cp: dynamic needs it (a power of two >= 2), found none"))
    elif not _power_of_two(cp_max):
        problems.append(("cp_max", f"must be a power of two >= 2, found {cp_max!r}"))
    if per_rank is None:
        problems.append(("tokens_per_cp_rank", "cp: dynamic needs it (an integer > 0), found none"))
    elif not (isinstance(per_rank, int) and not isinstance(per_rank, bool) and per_rank > 0):
        problems.append(("tokens_per_cp_rank", f"must be an integer > 0, found {per_rank!r}"))
    return problems
