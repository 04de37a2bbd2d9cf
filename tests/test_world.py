"""Topology as a value: sizes, the DP rank of a global rank, what torchrun sets."""

from __future__ import annotations

import pytest

from overlord import World


def test_detect_reads_torchrun_and_slurm():
    assert World.detect(env={"WORLD_SIZE": "16"}) == World(dp=16)
    assert World.detect(tp=2, cp=2, env={"WORLD_SIZE": "16"}) == World(dp=4, tp=2, cp=2)
    assert World.detect(env={"SLURM_NTASKS": "8"}).dp == 8
    assert World.detect(env={}).dp == 1
    assert World.rank_from_env({"RANK": "5"}) == 5
    assert World.rank_from_env({"SLURM_PROCID": "3"}) == 3


def test_detect_rejects_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="not a multiple of cp\\*tp\\*pp=4"):
        World.detect(tp=4, env={"WORLD_SIZE": "6"})


def test_dp_rank_follows_megatron_order():
    w = World(dp=2, tp=2, pp=2)  # tp fastest, then dp, then pp
    assert [w.dp_rank(r) for r in range(w.size)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="outside a world of 8"):
        w.dp_rank(8)
