"""TP peers of a node share one stored object per view; it is dropped once they all moved on.

On Ray a mesh rank's client asks its DataConstructor for ``[ref]``: the view
of its ``(step, dp, cp, stage)``, put in the node's object store once for all
its TP peers. The bookkeeping is checked on the embedded runtime given a fake
store as its capability (fast, no Ray); the real store under Ray (tools/loopback).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord import Loader, LoaderError, load_plan, validate_plan
from overlord.ops.run import dump_line
from overlord.roles.api import ConstructorRole
from overlord.runtime.inline import InlineRuntime

pytestmark = pytest.mark.integration

STEPS = 4


def mesh_plan(path: Path, **world: Any):
    plan = load_plan(path)
    data = plan.model_dump(mode="json")
    data["world"] = {"dp": 2, **world}
    return validate_plan(data, base_dir=plan.base_dir)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """Views of about 128 KiB: above Ray's inlining threshold, so they live in the store."""
    rng = np.random.default_rng(0)
    docs = [{"text": "overlord " * int(rng.integers(5, 60))} for _ in range(600)]
    return make_corpus(
        tmp_path_factory.mktemp("store"),
        {"web": {"files": {"data/web/a.jsonl": docs[:300], "data/web/b.jsonl": docs[300:]}}},
        batch={"tokens_per_step": 16384, "max_seq_len": 2048},
    )


class FakeRef:
    """What the fake store's ``put`` returns: the value itself."""

    def __init__(self, value: Any):
        self.value = value


class FakeStore:
    """An object store for the embedded runtime: puts counted, refs that hold their value."""

    def __init__(self) -> None:
        self.puts: list[tuple[int, int, int]] = []
        self.lost = 0  # the next gets that find the object gone (its owner died)

    def put(self, value: Any) -> FakeRef:
        self.puts.append((value.step, value.rank, value.cp_rank))
        return FakeRef(value)

    def get(self, ref: FakeRef, what: str) -> Any:
        if self.lost:
            self.lost -= 1
            return None
        return ref.value


def with_store(monkeypatch) -> FakeStore:
    """The embedded runtime offers ``store``: the Loader hands it to constructors and clients."""
    store = FakeStore()
    monkeypatch.setattr(InlineRuntime, "objects", store)
    return store


def test_tp_peers_share_one_put_per_view_and_old_ones_are_dropped(big, monkeypatch):
    store = with_store(monkeypatch)
    plan = mesh_plan(big, cp=2, tp=2)
    with Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        for _ in range(STEPS):
            got = [next(c) for c in clients]
            # the TP peers of each (dp, cp) receive the very same object
            for g in range(0, plan.world.size, 2):
                assert got[g] is got[g + 1]
        held = [obj._stored for obj in (h.obj for h in loader.constructors)]
        packed = [h.obj.stats() for h in loader.constructors]
    # one put per (step, dp, cp), not per rank
    every = {(s, d, c) for s in range(STEPS) for d in (0, 1) for c in (0, 1)}
    assert sorted(store.puts) == sorted(every)
    # each DP rank's batch packed once per step for its 4 peers (steps built ahead included)
    assert all(p["builds"] == p["distinct"] >= STEPS and p["bytes"] > 0 for p in packed)
    # every peer asked for the last step: the constructor holds no earlier step's object
    assert all(key[0] == STEPS - 1 for stored in held for key in stored)


def test_a_rewind_drops_the_stored_objects_of_the_rank(big, monkeypatch):
    with_store(monkeypatch)
    plan = mesh_plan(big, tp=2)
    with Loader(plan) as loader:
        obj = loader.constructors[0].obj
        for step in range(3):
            for g in (0, 1):
                obj.rank_batch_ref(step, g)
        assert {k[0] for k in obj._stored} == {2}
        again = obj.rank_batch_ref(0, 0)[0]  # trainers rewound the job to step 0
        assert {k[0] for k in obj._stored} == {0} and again.value.step == 0


def test_a_batch_lost_with_its_constructor_is_asked_for_again_then_named(big, monkeypatch):
    store = with_store(monkeypatch)
    plan = mesh_plan(big, tp=2)
    with Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        for step in range(2):
            for c in clients:  # the first get of every batch finds the object gone
                store.lost = 1
                assert next(c).step == step
        store.lost = 3
        with pytest.raises(LoaderError, match="rank 0: the batch of step 2 was lost 3 times"):
            next(clients[0])


@pytest.mark.ray
def test_on_ray_each_view_is_one_stored_object_that_peers_map_read_only(ray_session, big):
    torch = pytest.importorskip("torch")
    from overlord.torch import to_torch

    plan = mesh_plan(big, tp=2)
    with Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        want = [[next(c) for c in clients] for _ in range(STEPS)]
    with Loader(plan, runtime="ray", job="t-store") as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        got = [[next(c) for c in clients] for _ in range(STEPS)]
        # the TP peers of a DP rank get a reference to one object; the DP ranks one each
        step = STEPS
        refs = [
            loader._constructor_of[plan.world.coords(g).dp]
            .call(ConstructorRole.rank_batch_ref, step, g)
            .result()[0]
            for g in range(plan.world.size)
        ]
        assert refs[0] == refs[1] and refs[2] == refs[3] and refs[0] != refs[2]
    for mine, theirs in zip(got, want):
        assert [dump_line(b) for b in mine] == [dump_line(b) for b in theirs]
        for b, w in zip(mine, theirs):
            assert all(np.array_equal(b.arrays()[k], a) for k, a in w.arrays().items())
            # mapped from the object store, not copied: numpy says so by being read-only
            assert not b.input_ids.flags.writeable
            assert sum(a.nbytes for a in b.arrays().values()) > 100 * 1024  # not inlined
    # to_torch shares the read-only int32 arrays (no warning: pytest turns them into errors)
    tensors = to_torch(got[0][0])
    assert tensors["input_ids"].dtype == torch.int64
    assert np.array_equal(tensors["position_ids"].numpy(), want[0][0].position_ids)
    assert json.dumps(got[0][0].samples) == json.dumps(want[0][0].samples)


@pytest.mark.ray
def test_a_connected_mesh_rank_maps_its_view_from_the_object_store(ray_session, big):
    from overlord import connect

    plan = mesh_plan(big, tp=2)
    with Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(plan.world.size)]
        want = [[dump_line(next(c)) for c in clients] for _ in range(2)]
    with Loader(plan, runtime="ray", job="t-store-connect"):
        clients = [
            connect("t-store-connect", global_rank=g, stop_step=2) for g in range(plan.world.size)
        ]
        got = [[next(c) for c in clients] for _ in range(2)]
        for c in clients:
            c.close()
    assert [[dump_line(b) for b in step] for step in got] == want
    assert all(not b.input_ids.flags.writeable for step in got for b in step)  # mapped
