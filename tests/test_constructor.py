"""DataConstructor: batches built ahead, off the trainer's thread, without changing the stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from conftest import on_threads
from overlord import Loader, LoaderError, load_plan
from overlord.ops.run import dump_line

pytestmark = pytest.mark.integration


def recording(calls: set[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.add(threading.current_thread().name)
        return fn(*args, **kwargs)

    return wrapped


def test_the_embedded_runtime_plans_and_packs_off_the_trainers_thread(job_plan, monkeypatch):
    import overlord.plan.step as step_module
    import overlord.roles.constructor as constructor_module

    planned: set[str] = set()
    packed: set[str] = set()
    monkeypatch.setattr(step_module, "select_items", recording(planned, step_module.select_items))
    monkeypatch.setattr(constructor_module, "pack", recording(packed, constructor_module.pack))
    plan = load_plan(job_plan).with_dp(2)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(2)]
        got = [dump_line(next(c)) for _ in range(8) for c in clients]
    trainer = threading.current_thread().name
    assert len(got) == 16 and planned and packed  # it did plan and pack every step
    assert trainer not in planned and trainer not in packed


def test_a_rank_far_ahead_is_still_an_error_not_a_hang_when_building_ahead(job_plan):
    plan = load_plan(job_plan).with_dp(2)
    with Loader(plan) as loader:
        ahead = loader.client(0)
        with pytest.raises(LoaderError, match="ranks may run at most"):
            for _ in range(plan.batch.prefetch_steps + 3):
                next(ahead)


def _batches(plan: Any, steps: int) -> tuple[list[Any], int]:
    """Every rank's batches of ``steps`` steps, and how many packs built them."""
    import overlord.roles.constructor as constructor_module

    packs = []
    real = constructor_module.pack

    def counted(*args: Any) -> Any:
        packs.append(1)
        return real(*args)

    constructor_module.pack = counted
    try:
        with Loader(plan) as loader:
            clients = [loader.client(r) for r in range(plan.world.dp)]
            got = [next(c) for _ in range(steps) for c in clients]
    finally:
        constructor_module.pack = real
    return got, len(packs)


def test_one_constructor_builds_its_ranks_together_as_each_would_alone(job_plan):
    plan = load_plan(job_plan).with_dp(4)
    steps = 5
    apart = plan.model_copy(
        update={"placement": plan.placement.model_copy(update={"ranks_per_constructor": 1})}
    )
    together, packs_together = _batches(plan, steps)  # embedded: one constructor, 4 ranks
    alone, packs_alone = _batches(apart, steps)
    assert packs_alone >= 4 * steps  # a pack per rank and step (and some ahead)
    assert packs_together <= steps + plan.batch.prefetch_steps + 1  # one per step (and ahead)
    assert [dump_line(b) for b in together] == [dump_line(b) for b in alone]
    for a, b in zip(together, alone):
        assert (a.step, a.rank) == (b.step, b.rank)
        for name, x in a.arrays().items():
            y = b.arrays()[name]
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert (x == y).all(), (a.step, a.rank, name)


def test_sample_records_are_made_when_read_and_read_as_a_list(job_plan, monkeypatch):
    import json
    import pickle

    from overlord.batch import Sample, Samples
    from overlord.roles import constructor

    made: list[int] = []  # a mark each time a step's columns are asked for
    original = constructor.Samples

    def counting(columns: Callable[[], Any], lengths: Any) -> Samples:
        def counted() -> Any:
            made.append(1)
            return columns()

        return original(counted, lengths)

    monkeypatch.setattr(constructor, "Samples", counting)
    plan = load_plan(job_plan).with_dp(2)
    with Loader(plan) as loader:
        clients = [iter(loader.client(r)) for r in range(2)]
        first = [next(c) for c in clients]
        assert all(b.num_tokens > 0 for b in first)
        assert made == []  # the token count needs no records
        b = first[1]
        records = b.samples  # a list, as ever: made now
        assert made and type(records) is list and all(isinstance(s, Sample) for s in records)
        assert b.samples is records  # made once
        assert json.loads(json.dumps(b.samples)) == [list(s) for s in records]
        assert b.num_tokens == sum(s.tokens for s in records)
        kept = pickle.loads(pickle.dumps(first[0]))  # records not read yet: pickled as columns
        assert type(kept.__dict__["_samples"]) is Samples
        assert kept.samples == first[0].samples and type(kept.samples) is list
        second = next(clients[0])  # a later batch's records are made from its own columns
        assert [s.id for s in second.samples] != [s.id for s in first[0].samples]


def test_built_on_the_asking_thread_the_stream_is_the_same_and_each_step_is_packed_once(
    job_plan, monkeypatch
):
    """``build_ahead=False`` (the data process's roles): no thread builds; same batches."""
    from overlord import validate_plan
    from overlord.roles import constructor

    plan = load_plan(job_plan).with_dp(4)
    ahead, _ = _batches(plan, 5)
    counted, packed = on_threads(constructor.pack)
    monkeypatch.setattr(constructor, "pack", counted)
    with Loader(plan, build_ahead=False) as loader:
        clients = [loader.client(r) for r in range(4)]
        here = [next(c) for _ in range(5) for c in clients]
        assert not [t for t in threading.enumerate() if "constructor" in t.name]
    assert packed == [threading.current_thread().name] * 5  # the 4 ranks together, per step
    assert [dump_line(b) for b in here] == [dump_line(b) for b in ahead]
    for a, b in zip(here, ahead):
        for name, x in a.arrays().items():
            assert (x == b.arrays()[name]).all(), (a.step, a.rank, name)

    data = load_plan(job_plan).model_dump(mode="json")
    data["world"] = {"dp": 2, "tp": 2}  # a DP rank's two TP peers share its one build
    mesh = validate_plan(data, base_dir=load_plan(job_plan).base_dir)
    packed.clear()
    with Loader(mesh, build_ahead=False) as loader:
        ranks = [loader.rank_client(g) for g in range(4)]
        views = [[next(r) for r in ranks] for _ in range(3)]
    assert len(packed) == 3  # a step: both DP ranks in one pack, whatever the peers
    for step in views:
        for g, view in enumerate(step):
            peer = step[mesh.world.ranks_of(mesh.world.coords(g).dp)[0]]
            assert view is peer  # TP peers receive the same object
