"""LoaderPool on stand-in loaders: what it measures for the autoscaler, how it re-sizes a source.

The loaders here are stubs spawned through the seam, so the pool's own logic
runs alone: no reading, no threads.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord import LoaderError, load_plan
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
        self.released: list[list[list[int]]] = []  # the keys of each release call

    def release(self, keys: np.ndarray) -> None:
        self.released.append(np.asarray(keys).tolist())

    def rewind(self, start: dict[str, Any], seek: bool = False) -> None:
        pass

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


def test_shadows_are_told_of_releases_every_few_steps_and_never_past_a_rewind(tmp_path):
    """Primaries at once; a shadow serves nothing, so it is told once per few steps."""
    from overlord.roles.loader_pool import SHADOW_RELEASE_STEPS as EVERY

    pool = pool_of(tmp_path)  # web: 2 slots, each with a shadow; code: no shadow
    primary, shadow = (r.obj for r in pool.slots["web"][0])  # type: ignore[attr-defined]

    def release(step: int) -> None:  # one item of slot web[0] and one of code[0] per step
        keys = np.array([[0, 0, step], [0, 0, step]], dtype=np.int64)
        pool.release(np.array([0, 1]), np.array([0, 0]), keys)

    for step in range(EVERY - 1):
        release(step)
    assert len(primary.released) == EVERY - 1 and shadow.released == []
    release(EVERY - 1)
    assert shadow.released == [[[0, 0, s] for s in range(EVERY)]]  # in one call
    release(EVERY)
    pool.rewind({n: {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []} for n in pool.names})
    for step in range(EVERY + 1, 2 * EVERY + 1):
        release(step)
    # what was released before the rewind is not sent after it (it is needed again)
    assert shadow.released[1:] == [[[0, 0, s] for s in range(EVERY + 1, 2 * EVERY + 1)]]
    assert len(primary.released) == 2 * EVERY + 1


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


def real_pool(tmp_path, processes: int | None) -> LoaderPool:
    """A pool of real SourceLoaders (inline), hosted ``processes`` to a process (None: apart)."""
    path = make_corpus(
        tmp_path,
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 5 for i in range(6)}, "loaders": 2},
            "code": {"files": {f"data/code/p{i}.jsonl": 5 for i in range(6)}},
        },
    )
    plan = load_plan(path)
    files = job_files([(s.name, [s.path]) for s in plan.sources], str(plan.base_dir))
    start = {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []}
    config = PoolConfig(shadows={"web": 0, "code": 0}, processes=processes)
    pool = LoaderPool(
        plan, files, InlineRuntime(), config, consumed=lambda source: start, clock=lambda: 0
    )
    pool.start()
    return pool


def blocks_of(pool: LoaderPool, asks: list[tuple[str, int]]) -> list[tuple[Any, ...]]:
    """What each ask of ``asks`` returned: every block's slot, shard and items, in order."""
    out = []
    for source, k in asks:
        for b in pool.metadata(source, k, 20.0):
            out.append((source, k, int(b["epoch"]), int(b["shard_pos"]), b["index"].tolist()))
    return out


MATES = [("web", 0), ("web", 1), ("code", 0)]  # the loaders of real_pool's one process


def wait_all_queued(pool: LoaderPool) -> None:
    """Until every loader of the process has queued a block (so that one ask takes theirs)."""
    for source, k in MATES:
        loader = pool.slots[source][k][0]
        while not loader.host.obj._member(loader.member)._queue:  # type: ignore[attr-defined]
            time.sleep(0.01)


def assert_same_blocks(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> None:
    """Each slot served the same blocks in the same order (as far as both asked)."""
    for slot in MATES:
        mine, theirs = ([g[2:] for g in b if g[:2] == slot] for b in (got, want))
        n = min(len(mine), len(theirs))
        assert n >= 3 and mine[:n] == theirs[:n], slot


def kill_all(*pools: LoaderPool) -> None:
    for pool in pools:
        for slots in pool.slots.values():
            for slot in slots:
                for h in slot:
                    pool.runtime.kill(h)


def test_loaders_of_one_process_hand_over_their_metadata_in_one_call(tmp_path):
    """Asked for one loader's blocks, a process's other loaders hand theirs over too.

    The pool keeps them for their own asks, which then need no call: the
    blocks each slot serves, and their order, are those of loaders apart.
    """
    asks = [("web", 0), ("code", 0), ("web", 1), ("code", 0), ("web", 0), ("web", 1)] * 3
    apart, together = real_pool(tmp_path / "apart", None), real_pool(tmp_path / "together", 1)
    try:
        want = blocks_of(apart, asks)
        wait_all_queued(together)  # then ask one of them
        got = blocks_of(together, asks[:1])
        # the mates' blocks came with that call, kept for their own asks
        assert set(together._polled) == {("web", 1), ("code", 0)}
        got += blocks_of(together, asks[1:])
        assert_same_blocks(got, want)
    finally:
        kill_all(apart, together)


def test_a_loader_asked_without_waiting_answers_at_once_even_as_a_shadow(tmp_path):
    """``metadata(0)``: what is queued or nothing, never a wait nor an error (a shadow's too)."""
    path = make_corpus(tmp_path, {"web": {"files": {"data/web/p0.jsonl": 3}}})
    plan = load_plan(path)
    files = job_files([("web", ["data/web/*"])], str(plan.base_dir))
    start = {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []}
    shadow = SourceLoader(plan, files["web"], "web", 0, 1, start, True, True)
    try:
        assert shadow.metadata(0.0) == []
        with pytest.raises(LoaderError, match="shadow"):
            shadow.metadata(0.5)
    finally:
        shadow.close()


def test_blocks_kept_for_a_process_mate_are_dropped_by_a_rewind(tmp_path):
    """A rewind has every loader serve again from the state: what the pool kept is not served.

    The blocks a loader handed over with a process mate's were sent before the
    rewind; the rewound loader sends them again, so serving the kept ones too
    would hand the planner each of them twice.
    """
    start = {"epoch": 0, "shard_pos": 0, "index": 0, "skip": []}
    asks = [("web", 0), ("code", 0), ("web", 1), ("code", 0), ("web", 0), ("web", 1)] * 3
    apart, together = real_pool(tmp_path / "apart", None), real_pool(tmp_path / "together", 1)
    try:
        want = blocks_of(apart, asks)
        wait_all_queued(together)
        blocks_of(together, asks[:1])
        assert together._polled  # the mates' blocks came along, kept for their asks
        together.forget_received()
        together.rewind({n: start for n in together.names})
        assert_same_blocks(blocks_of(together, asks), want)
    finally:
        kill_all(apart, together)
