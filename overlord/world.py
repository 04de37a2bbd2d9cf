"""Training topology as a value: data, context, tensor and pipeline parallel sizes."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field


class World(BaseModel):
    """The parallel layout of the trainer.

    Only ``dp`` changes what the loader does: each DP rank receives its own
    share of every step. The other axes are carried so that a rank can find its
    DP rank and so that constructors can slice (CP) or share (TP, PP) batches.

    >>> World(dp=4, tp=2).size
    8
    >>> World(dp=4, tp=2).dp_rank(5)
    2
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(1, ge=1, description="data-parallel size")
    cp: int = Field(1, ge=1, description="context-parallel size")
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size")

    @property
    def size(self) -> int:
        """Number of trainer processes: dp * cp * tp * pp."""
        return self.dp * self.cp * self.tp * self.pp

    def dp_rank(self, global_rank: int) -> int:
        """DP rank of a global rank, in Megatron's default order (tp fastest, then cp, dp, pp)."""
        if not 0 <= global_rank < self.size:
            raise ValueError(f"rank {global_rank} is outside a world of {self.size} processes")
        return (global_rank // (self.tp * self.cp)) % self.dp

    @classmethod
    def detect(
        cls, cp: int = 1, tp: int = 1, pp: int = 1, env: Mapping[str, str] | None = None
    ) -> World:
        """Read the world size that ``torchrun`` (or SLURM) put in the environment.

        The model-parallel sizes are not in the environment: pass them. The data
        parallel size is what remains of ``WORLD_SIZE``.
        """
        env = os.environ if env is None else env
        size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
        per_replica = cp * tp * pp
        if size % per_replica:
            raise ValueError(
                f"WORLD_SIZE={size} is not a multiple of cp*tp*pp={per_replica}: "
                "check the parallel sizes passed to World.detect()"
            )
        return cls(dp=size // per_replica, cp=cp, tp=tp, pp=pp)

    @staticmethod
    def rank_from_env(env: Mapping[str, str] | None = None) -> int:
        """Global rank of this process, from ``RANK`` (torchrun) or ``SLURM_PROCID``."""
        env = os.environ if env is None else env
        return int(env.get("RANK", env.get("SLURM_PROCID", "0")))
