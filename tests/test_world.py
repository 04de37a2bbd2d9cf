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


def test_coords_follow_the_default_megatron_formula():
    w = World(dp=3, cp=2, tp=2, pp=2)
    for g in range(w.size):
        dp, cp, tp, pp = w.coords(g)
        assert g == tp + w.tp * (cp + w.cp * (dp + w.dp * pp))
        assert w.global_rank(dp=dp, cp=cp, tp=tp, pp=pp) == g
    assert sorted(w.coords(g) for g in range(w.size)) == sorted(
        (d, c, t, p) for d in range(3) for c in range(2) for t in range(2) for p in range(2)
    )


def test_order_lists_the_axes_fastest_first():
    w = World(dp=2, cp=2, tp=2, order="dp-tp-cp-pp")
    assert [w.coords(g).dp for g in range(4)] == [0, 1, 0, 1]
    assert w.coords(2) == (0, 0, 1, 0)
    assert w.global_rank(dp=1, cp=1, tp=1) == 1 + 2 * (1 + 2 * 1)
    assert w.ranks_of(1) == [1, 3, 5, 7]


def test_bad_order_and_coordinates_are_refused():
    with pytest.raises(ValueError, match="must name each of dp, cp, tp, pp once"):
        World(order="tp-dp-pp")
    with pytest.raises(ValueError, match="tp=2 \\(size 2\\)"):
        World(dp=2, tp=2).global_rank(tp=2)
    with pytest.raises(ValueError, match="outside a world of 4 processes"):
        World(dp=2, cp=2).coords(4)


def test_detect_takes_the_plan_axes_and_checks_rank():
    plan_world = World(dp=1, cp=2, tp=2, order="cp-tp-dp-pp")
    w = World.detect(env={"WORLD_SIZE": "12", "RANK": "11"}, plan=plan_world)
    assert w == World(dp=3, cp=2, tp=2, order="cp-tp-dp-pp")
    with pytest.raises(ValueError, match="rank 12 is outside a world of 12"):
        World.detect(env={"WORLD_SIZE": "12", "RANK": "12"}, plan=plan_world)


def test_dynamic_cp_is_a_cp_axis_of_cp_max_ranks():
    w = World(dp=2, cp="dynamic", cp_max=4, tokens_per_cp_rank=1024, tp=2)
    assert (w.cp, w.cp_dynamic, w.size) == (4, True, 16)
    assert w.coords(w.global_rank(dp=1, cp=3, tp=1)) == (1, 3, 1, 0)
    found = World.detect(env={"WORLD_SIZE": "32", "RANK": "31"}, plan=w)
    assert found.dp == 4 and found.cp_dynamic and found.tokens_per_cp_rank == 1024
    assert World.model_validate(w.model_dump()) == w and not World(cp=4).cp_dynamic
