"""The device mesh on the embedded runtime: what each global rank receives, and when.

TP peers share one batch object, pipeline stages get only their fields, CP
ranks get slices that reassemble their DP rank's unsliced batch, a DP rank's
batch is built once for all its peers, and its step counts as consumed once
every peer that reads has received it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from overlord import Loader, PlanError, load_plan, validate_plan
from overlord.roles.constructor import DataConstructor

pytestmark = pytest.mark.integration

STEPS = 4
FIELDS = ("input_ids", "labels", "position_ids", "segment_ids")


def mesh_plan(corpus, **world: Any):
    plan = load_plan(corpus)
    data = plan.model_dump(mode="json")
    layout = world.pop("cp_layout", None)
    data["world"] = {"dp": 2, **world}
    data["batch"]["cp_layout"] = layout
    data["balance"]["method"] = "none"  # the same rows whatever the cost: comparable to cp=1
    return validate_plan(data, base_dir=plan.base_dir)


def consume_mesh(plan, steps=STEPS):
    """Every global rank's batches, step by step: ``out[step][global_rank]``."""
    out = []
    with Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        for _ in range(steps):
            out.append([next(c) for c in clients])
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from conftest import make_corpus

    return make_corpus(tmp_path_factory.mktemp("mesh"))


@pytest.fixture(scope="module")
def unsliced(corpus):
    """The cp=1 batches of every DP rank: ``[step][dp]``."""
    return consume_mesh(mesh_plan(corpus))


@pytest.mark.parametrize("layout", ["zigzag", "per_document"])
def test_cp_slices_reassemble_the_cp1_batch_at_every_step_and_rank(corpus, unsliced, layout):
    plan = mesh_plan(corpus, cp=2, tp=2, cp_layout=layout)
    world = plan.world
    for step, batches in enumerate(consume_mesh(plan)):
        for dp in range(world.dp):
            want = unsliced[step][dp]
            got = {k: np.full(want.position_ids.size, -7, dtype=np.int32) for k in FIELDS}
            for cp in range(world.cp):
                b = batches[world.global_rank(dp=dp, cp=cp)]
                assert (b.step, b.rank, b.cp_rank, b.cp_size) == (step, dp, cp, 2)
                assert b.cp_layout == layout and b.samples == want.samples
                g = b.global_positions.reshape(-1)
                for k in FIELDS:
                    got[k][g[g >= 0]] = getattr(b, k).reshape(-1)[g >= 0]
            for k in FIELDS:
                assert np.array_equal(got[k].reshape(want.position_ids.shape), getattr(want, k))


def test_tp_peers_share_one_batch_and_pp_stages_get_their_fields(corpus):
    plan = mesh_plan(corpus, cp=2, tp=2, pp=3)
    world = plan.world
    for batches in consume_mesh(plan, steps=2):
        for g, b in enumerate(batches):
            at = world.coords(g)
            peer = batches[world.global_rank(dp=at.dp, cp=at.cp, tp=1 - at.tp, pp=at.pp)]
            assert peer is b  # TP peers: the very same object
            assert (b.input_ids is not None) == (at.pp == 0)
            assert (b.labels is not None) == (at.pp == world.pp - 1)
            for k in ("position_ids", "segment_ids", "cu_seqlens", "global_positions"):
                assert getattr(b, k) is not None
            if at.pp == 1:  # a middle stage holds no token payload
                assert set(b.arrays()) == {"position_ids", "segment_ids", "cu_seqlens",
                                           "global_positions"}  # fmt: skip
        first = batches[world.global_rank(dp=1, cp=1, pp=0)]
        last = batches[world.global_rank(dp=1, cp=1, pp=2)]
        assert np.shares_memory(first.position_ids, last.position_ids)  # sliced once


def test_a_dp_rank_is_built_once_for_all_its_peers(corpus, monkeypatch):
    built: list[tuple[int, int]] = []
    build = DataConstructor._build

    def counting(self, step, rank, *rest):
        built.append((step, rank))
        return build(self, step, rank, *rest)

    monkeypatch.setattr(DataConstructor, "_build", counting)
    consume_mesh(mesh_plan(corpus, cp=2, tp=2, pp=2), steps=3)
    # steps 0-2 consumed (3-4 may be built ahead, or not yet, when the loader closes)
    assert {(s, d) for s in range(3) for d in range(2)} <= set(built)
    assert len(built) == len(set(built))  # 8 peers per DP rank, one build each


def test_a_step_is_consumed_once_every_attached_peer_received_it(corpus):
    plan = mesh_plan(corpus, tp=2)
    with Loader(plan) as loader:
        a, b, c, d = (loader.rank_client(g) for g in range(4))  # dp 0: a, b; dp 1: c, d
        for client in (a, c, d, a, c, d):
            next(client)
        assert loader.state_dict()["step"] == 0  # b has not received step 0
        next(b)
        assert loader.state_dict()["step"] == 1
        next(b)
        assert loader.state_dict()["step"] == 2


def test_dp_rank_clients_are_refused_in_a_mesh_and_equal_rank_clients_without(corpus):
    plan = mesh_plan(corpus, cp=2)
    with Loader(plan) as loader, pytest.raises(ValueError, match="use Loader.rank_client"):
        loader.client(0)
    plain = mesh_plan(corpus)
    with Loader(plain) as l1, Loader(plain) as l2:
        by_dp = [l1.client(r) for r in range(2)]
        by_global = [l2.rank_client(r) for r in range(2)]
        for _ in range(2):
            for x, y in zip(by_dp, by_global):
                bx, by = next(x), next(y)
                assert bx.samples == by.samples and np.array_equal(bx.input_ids, by.input_ids)
                assert by.global_positions is None and by.cp_size == 1


def test_zigzag_needs_rows_that_cut_into_2cp_chunks(corpus):
    data = load_plan(corpus).model_dump(mode="json")
    data["world"] = {"dp": 2, "cp": 3}
    data["batch"]["cp_layout"] = "zigzag"
    with pytest.raises(PlanError, match="batch.max_seq_len.*multiple of 6, found 64"):
        validate_plan(data)
    data["batch"]["cp_layout"] = "per_document"  # pads documents instead: any length
    assert validate_plan(data).world.cp == 3


DYNAMIC = {"cp": "dynamic", "cp_max": 4, "tokens_per_cp_rank": 12}


def test_dynamic_cp_slices_reassemble_the_cp1_batch_at_every_step_and_rank(corpus, unsliced):
    """cp: dynamic (cp_max 4, 12 tokens per rank: the corpus's 12-50-byte documents get
    degrees 1-4); with tp 2, TP peers share each slice."""
    plan = mesh_plan(corpus, tp=2, **DYNAMIC)
    world = plan.world
    assert world.cp == 4 and world.size == 16
    for step, batches in enumerate(consume_mesh(plan)):
        for dp in range(world.dp):
            want = unsliced[step][dp]
            got = {k: np.full(want.position_ids.size, -7, dtype=np.int32) for k in FIELDS}
            hits = np.zeros(want.position_ids.size, dtype=np.int64)
            groups: dict[tuple[int, int], set[int]] = {}  # (first, degree) -> ranks listing it
            for cp in range(world.cp):
                b = batches[world.global_rank(dp=dp, cp=cp)]
                assert b is batches[world.global_rank(dp=dp, cp=cp, tp=1)]
                assert (b.step, b.rank, b.cp_rank, b.cp_size) == (step, dp, cp, 4)
                assert b.cp_layout == "dynamic" and b.samples == want.samples
                assert b.input_ids.shape == batches[world.global_rank(dp=dp)].input_ids.shape
                g = b.global_positions.reshape(-1)
                np.add.at(hits, g[g >= 0], 1)
                for k in FIELDS:
                    got[k][g[g >= 0]] = getattr(b, k).reshape(-1)[g >= 0]
                for first, degree in b.cp_groups.tolist():
                    groups.setdefault((first, degree), set()).add(cp)
            assert (hits == 1).all()
            for k in FIELDS:
                assert np.array_equal(got[k].reshape(want.position_ids.shape), getattr(want, k))
            for (first, degree), ranks in groups.items():
                if degree > 1:
                    assert ranks == set(range(first, first + degree))
            assert max(d for _, d in groups) > 1  # some documents are spread


@pytest.mark.parametrize(
    ("world", "batch", "match"),
    [
        ({"cp": "dynamic", "tokens_per_cp_rank": 8}, {}, r"world.cp_max: cp: dynamic needs it"),
        ({"cp": "dynamic", "cp_max": 6, "tokens_per_cp_rank": 8}, {},
         r"world.cp_max: must be a power of two >= 2, found 6"),
        ({"cp": "dynamic", "cp_max": 1, "tokens_per_cp_rank": 8}, {}, r"power of two >= 2"),
        ({"cp": "dynamic", "cp_max": 4, "tokens_per_cp_rank": 0}, {},
         r"world.tokens_per_cp_rank: must be an integer > 0, found 0"),
        ({"cp": "dynamic", "cp_max": 4}, {}, r"world.tokens_per_cp_rank: cp: dynamic needs it"),
        ({"cp": 2, "cp_max": 4}, {}, r"world.cp_max: only with cp: dynamic"),
        ({"tokens_per_cp_rank": 4}, {}, r"world.tokens_per_cp_rank: only with cp: dynamic"),
        ({"cp": "dynamc"}, {}, r"world.cp: must be an integer >= 1 or 'dynamic', found 'dynamc'"),
        ({**DYNAMIC}, {"cp_layout": "zigzag"}, r"batch.cp_layout: cp: dynamic cuts each"),
    ],
)  # fmt: skip
def test_dynamic_cp_keys_are_validated_with_their_field_path(corpus, world, batch, match):
    data = load_plan(corpus).model_dump(mode="json")
    data["world"] = {"dp": 2, **world}
    data["batch"].update(batch)
    with pytest.raises(PlanError, match=match):
        validate_plan(data)


def test_a_dynamic_plan_dumps_and_validates_back_to_itself(corpus):
    plan = mesh_plan(corpus, **DYNAMIC)
    data = plan.model_dump(mode="json")
    assert data["world"]["cp"] == "dynamic" and plan.with_dp(1).world.cp_dynamic
    assert validate_plan(data).world == plan.world
    assert "cp_max" not in mesh_plan(corpus, cp=2).model_dump(mode="json")["world"]
