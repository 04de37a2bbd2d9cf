"""LoaderPool on stand-in loaders: what it measures for the autoscaler, how it re-sizes a source.

The loaders here are stubs spawned through the seam, so the pool's own logic
runs alone: no reading, no threads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord import load_plan
from overlord.plan.partition import partitions
from overlord.plan.spec import validate_plan
from overlord.roles.api import LoaderRole
from overlord.roles.loader_pool import LoaderPool, PoolConfig
from overlord.roles.source_loader import SourceLoader
from overlord.runtime.base import DEFAULT_OPTIONS, RoleOptions
from overlord.runtime.inline import InlineRuntime
from overlord.sources.catalog import job_files


class StubLoader:
    """Answers what the pool asks of a SourceLoader, from numbers a test sets."""

    def __init__(self, plan: Any, files: Any, source: str, index: int, count: int, *rest: Any):
        self.source, self.index, self.count = source, index, count
        self.cost = 2e-6  # CPU seconds per token it measured (NaN: nothing read yet)
        self.threads = 1
        self.next = [0, 4]  # the first shard it has not started
        self.limit: list[int] | None = None

    def stats(self) -> dict[str, Any]:
        return {"cpu_s_per_token": self.cost, "rss_bytes": 1e8, "threads": self.threads}

    def freeze(self) -> list[int]:
        return self.next

    def until(self, limit: list[int]) -> None:
        self.limit = limit

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def close(self) -> None:
        pass


class StubRuntime(InlineRuntime):
    """The inline runtime, with stubs wherever a SourceLoader is asked for."""

    def spawn(self, cls: type, *args: Any, name: str, options: RoleOptions = DEFAULT_OPTIONS):
        stub = StubLoader if cls is SourceLoader else cls
        return super().spawn(stub, *args, name=name, options=options)


def pool_of(tmp_path, processes: int | None = None, **autoscale: Any) -> LoaderPool:
    path = make_corpus(
        tmp_path,
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 3 for i in range(8)}, "loaders": 2},
            "code": {"files": {f"data/code/p{i}.jsonl": 3 for i in range(8)}},
        },
    )
    plan = load_plan(path)
    data = plan.model_dump(mode="json")
    data["autoscale"].update(autoscale)
    plan = validate_plan(data, base_dir=plan.base_dir)
    files = job_files([(s.name, [s.path]) for s in plan.sources], str(plan.base_dir))
    start = {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []}
    pool = LoaderPool(
        plan, files, StubRuntime(), PoolConfig(shadows={"web": 1, "code": 0}, processes=processes),
        consumed=lambda source: start, clock=lambda: 0,
    )  # fmt: skip
    pool.start()
    return pool


def weights(step: int) -> np.ndarray:
    return np.array([0.8, 0.2])


def test_a_repartition_starts_new_loaders_from_the_boundary_and_limits_the_old(tmp_path):
    pool = pool_of(tmp_path)
    assert [len(slot) for slot in pool.slots["web"]] == [2, 2]  # a primary and a shadow each
    at = pool.repartition("web", 3)
    assert at == (0, 4)  # the first shard none of the old loaders has started
    old = [replica.obj for slot in pool.slots["web"][:2] for replica in slot]  # type: ignore[attr-defined]
    assert all(loader.limit == [0, 4] for loader in old)
    assert partitions(pool.parts["web"]) == [((0, 0), 0, 2), ((0, 4), 2, 3)]
    assert pool.current("web") == [2, 3, 4]
    assert pool.repartition("web", 3) is None  # already that size
    with pytest.raises(ValueError, match="at least one loader"):
        pool.repartition("web", 0)


def test_loaders_hosted_together_are_recorded_by_host_and_found_again(tmp_path):
    """``placement.loader_processes``: the loaders share hosts, their shadows other hosts."""
    pool = pool_of(tmp_path, processes=1)
    record = pool.record()
    web, code = record["slots"]["web"], record["slots"]["code"]
    primaries = {name.partition("/")[0] for name in (web[0][0], web[1][0], code[0][0])}
    shadows = {name.partition("/")[0] for name in (web[0][1], web[1][1])}
    assert len(primaries) == len(shadows) == 1 and primaries != shadows
    assert [web[0][0].partition("/")[2], code[0][0].partition("/")[2]] == ["web-0", "code-0"]
    pool.restore(record)  # a restarted planner finds them by those names
    assert pool.slots["web"][1][0].name == web[1][0]
    pool.set_threads("web", 3)
    assert [h.call(LoaderRole.stats).result()["threads"] for h in pool.primaries("web")] == [3, 3]


def test_loaders_a_repartition_just_started_keep_their_source_measured(tmp_path):
    """A source's cost outlives the loaders that measured it.

    Loaders a re-partition just started have read nothing yet. Were the source
    then unmeasured, the autoscaler would count it at one core per reader
    thread and shrink it to fit the budget, and the next decision would grow it
    again: a flap, each turn a re-partition.
    """
    pool = pool_of(tmp_path, cpus=5)
    before = pool.autoscale(6, 0.5, weights)
    for name in pool.names:  # every current loader as a fresh one: nothing measured
        for k in pool.current(name):
            pool.slots[name][k][0].obj.cost = math.nan  # type: ignore[attr-defined]
    after = pool.autoscale(7, 0.5, weights)
    assert before is not None and after is not None
    for b, a in zip(before.sources, after.sources):
        assert a.capacity_tokens_per_s == b.capacity_tokens_per_s > 0
        assert (a.loaders, a.threads) == (b.loaders, b.threads)
    assert pool.record()["autoscaler"]["cost"] == {"web": 2e-6, "code": 2e-6}


def test_a_decision_is_carried_out_and_recorded(tmp_path):
    pool = pool_of(tmp_path, cpus=8)
    decision = pool.autoscale(10, 1e-4, weights)  # a fast trainer: web needs more readers
    assert decision is not None
    web = decision.source("web")
    assert (web.loaders, web.threads) != (2, 1)  # it did move
    assert (len(pool.current("web")), pool.slots["web"][pool.current("web")[0]][0].obj.threads) == (  # type: ignore[attr-defined]
        web.loaders,
        web.threads,
    )
    (record,) = pool.scaling
    assert record["step"] == 10 and record["sources"]["web"]["loaders"] == web.loaders
