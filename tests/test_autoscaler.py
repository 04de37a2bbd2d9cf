"""The Autoscaler's policy on recorded figures: pure, no roles, no threads, no sleeping."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.plan.schedule import Schedule
from overlord.plan.spec import validate_plan
from overlord.roles.autoscaler import (
    ActionKind,
    Autoscaler,
    Budget,
    Decision,
    SourceDecision,
    SourceProfile,
    plan_actions,
)

GiB = 2.0**30
TOKENS_PER_STEP = 1_000_000.0
STEP_TIME_S = 1.0  # so a weight w asks w * 1M tok/s


def prof(name: str, cost: float, loaders: int = 1, threads: int = 1, **kw: object) -> SourceProfile:
    kw.setdefault("memory_bytes_per_loader", 0.5 * GiB)
    return SourceProfile(name, cost, loaders=loaders, threads=threads, **kw)  # type: ignore[arg-type]


def apply(profiles: Sequence[SourceProfile], d: Decision) -> list[SourceProfile]:
    """The profiles after the runtime carried out ``d``."""
    return [
        replace(p, loaders=d.source(p.name).loaders, threads=d.source(p.name).threads)
        for p in profiles
    ]


def shape(d: Decision, name: str) -> tuple[int, int]:
    return d.source(name).loaders, d.source(name).threads


def run(
    scaler: Autoscaler,
    profiles: list[SourceProfile],
    weights: Callable[[int], Sequence[float]],
    steps: range,
    noise: Callable[[int, int], float] | None = None,
) -> list[Decision]:
    """Decide at every step and apply each decision; ``noise(step, source)`` scales costs."""
    out = []
    for step in steps:
        ahead = scaler.weights_ahead(lambda s: np.asarray(weights(s), dtype=float), step)
        seen = [
            replace(p, cpu_s_per_token=p.cpu_s_per_token * noise(step, i)) if noise else p
            for i, p in enumerate(profiles)
        ]
        d = scaler.decide(step, seen, ahead, TOKENS_PER_STEP, STEP_TIME_S)
        profiles[:] = apply(profiles, d)
        out.append(d)
    return out


def changes(decisions: list[Decision]) -> int:
    shapes = [[(s.loaders, s.threads) for s in d.sources] for d in decisions]
    return sum(a != b for a, b in zip(shapes, shapes[1:]))


def within_budget(d: Decision, budget: Budget) -> bool:
    return d.cpus <= budget.cpus and d.memory_bytes <= budget.memory_bytes * (1 + 1e-9)


# ---- sizing ---------------------------------------------------------------------------------


def test_sizes_a_source_to_its_demand_with_headroom() -> None:
    # 0.52 of 1M tok/s at 1e-5 CPU-s per token: 5.2 CPUs, 6.5 with headroom, so 7 threads
    scaler = Autoscaler(Budget(cpus=64, memory_bytes=math.inf))
    d = scaler.decide(0, [prof("web", 1e-5)], np.array([[0.52]]), TOKENS_PER_STEP, STEP_TIME_S)
    web = d.source("web")
    assert web.cpus == 7 and web.threads <= 4
    assert web.demand_tokens_per_s == pytest.approx(5.2e5)
    assert web.capacity_tokens_per_s == pytest.approx(7e5)
    assert d.bottleneck is None
    assert "web: demand 520k tok/s now (weight 0.52) needs 6.5 CPUs" in web.reason


@pytest.mark.parametrize(
    "thread_efficiency, memory_bytes, expected",
    [
        (1.0, 64 * GiB, (2, 3)),  # threads scale and loaders cost memory: fill loaders first
        (0.0, 64 * GiB, (6, 1)),  # GIL-bound: a second thread buys nothing
        (0.5, math.inf, (6, 1)),  # memory free: half-useful threads waste CPUs
        (0.5, 8 * GiB, (3, 3)),  # memory dear: half-useful threads are cheaper than loaders
    ],
)
def test_shape_is_the_cheapest_share_of_the_budget(
    thread_efficiency: float, memory_bytes: float, expected: tuple[int, int]
) -> None:
    scaler = Autoscaler(Budget(cpus=64, memory_bytes=memory_bytes))
    web = prof("web", 1e-5, thread_efficiency=thread_efficiency, memory_bytes_per_loader=1 * GiB)
    d = scaler.decide(0, [web], np.array([[0.48]]), TOKENS_PER_STEP, STEP_TIME_S)
    assert shape(d, "web") == expected
    assert d.source("web").capacity_tokens_per_s == pytest.approx(6e5)


def test_unmeasured_sources_keep_their_size() -> None:
    scaler = Autoscaler(Budget(cpus=16))
    profiles = [prof("a", 0.0, loaders=2, threads=3), prof("b", math.nan), prof("c", 1e-5)]
    d = scaler.decide(0, profiles, np.full((1, 3), 1 / 3), TOKENS_PER_STEP, STEP_TIME_S)
    assert shape(d, "a") == (2, 3) and shape(d, "b") == (1, 1)
    assert d.source("a").reason == "a: no cost measured yet; keeps 2 loaders x 3 threads"
    assert math.isnan(d.source("a").capacity_tokens_per_s)
    assert d.source("c").cpus == 5  # 1/3 of 1M tok/s at 1e-5: 3.3 CPUs, 4.2 with headroom


# ---- the schedule ahead ---------------------------------------------------------------------


def test_scales_up_before_a_rising_weight() -> None:
    plan = validate_plan(
        {
            "sources": [
                {"name": "web", "path": "w", "format": "jsonl"},
                {"name": "code", "path": "c", "format": "jsonl"},
            ],
            "batch": {"tokens_per_step": 8, "max_seq_len": 8},
            "mixture": {
                "interpolation": "step",
                "schedule": [
                    {"step": 0, "weights": {"web": 0.9, "code": 0.1}},
                    {"step": 100, "weights": {"web": 0.4, "code": 0.6}},
                ],
            },
        }
    )
    schedule = Schedule(plan)
    scaler = Autoscaler(Budget(cpus=64), horizon_steps=50)
    profiles = [prof("web", 1e-6), prof("code", 1e-5)]
    ahead = scaler.weights_ahead(schedule.weights, 40)
    assert ahead.shape == (51, 2) and ahead[-1].tolist() == pytest.approx([0.9, 0.1])
    early = scaler.decide(40, profiles, ahead, TOKENS_PER_STEP, STEP_TIME_S)
    assert early.source("code").cpus == 1  # 0.1 share: 1 CPU, which 1 loader x 1 thread meets
    profiles = apply(profiles, early)

    d = scaler.decide(
        60, profiles, scaler.weights_ahead(schedule.weights, 60), TOKENS_PER_STEP, STEP_TIME_S
    )
    code = d.source("code")
    assert code.cpus == 8  # 0.6 share: 6 CPUs, 7.5 with headroom, 40 steps before it starts
    assert code.capacity_tokens_per_s >= 6e5
    assert "demand 600k tok/s at step 100 (weight 0.60 in 40 steps) needs 7.5 CPUs" in code.reason
    assert "1 loader x 1 thread (100k tok/s) -> 2 loaders x 4 threads (800k tok/s)" in code.reason


# ---- hysteresis -----------------------------------------------------------------------------


def test_noisy_measurements_do_not_flap() -> None:
    # demand sits exactly on 5 threads' worth: without hysteresis every wobble of the
    # measured cost moves the size between 5 and 6 threads
    rng = np.random.default_rng(0)
    noise = np.exp(rng.normal(0.0, 0.05, size=300))
    budget = Budget(cpus=64)

    def sizes(scaler: Autoscaler) -> list[Decision]:
        return run(
            scaler,
            [prof("web", 1e-5)],
            lambda s: [0.5],
            range(300),
            noise=lambda s, i: float(noise[s]),
        )

    steady = sizes(Autoscaler(budget))
    naive = sizes(Autoscaler(budget, headroom=1.0, down_threshold=1.0, cooldown_steps=0))
    assert changes(steady) == 0
    assert changes(naive) > 50


def test_scale_down_waits_for_the_cooldown() -> None:
    scaler = Autoscaler(Budget(cpus=64), cooldown_steps=20, horizon_steps=10)
    profiles = [prof("web", 1e-5)]
    weights = lambda s: [0.6 if s < 100 else 0.1]  # noqa: E731
    ds = run(scaler, profiles, weights, range(0, 130))
    assert ds[99].source("web").cpus == 8
    # the need falls at step 100; the size holds for 20 steps, then shrinks once
    assert all(d.source("web").cpus == 8 for d in ds[100:120])
    assert "needs under 60% of its capacity for 5 of 20 steps" in ds[105].source("web").reason
    assert ds[120].source("web").cpus == 2
    assert "after 20 steps below 60% of capacity" in ds[120].source("web").reason
    assert changes(ds) == 1


def test_a_dip_shorter_than_the_cooldown_changes_nothing_and_counts_steps() -> None:
    scaler = Autoscaler(Budget(cpus=64), cooldown_steps=20, horizon_steps=0)
    profiles = [prof("web", 1e-5)]
    dips = lambda s: [0.1 if 100 <= s < 115 or 130 <= s < 145 else 0.6]  # noqa: E731
    ds = run(scaler, profiles, dips, range(0, 200, 5))  # a decision every 5 steps
    assert changes(ds) == 0
    # a dip that lasts: the cooldown is in steps, however often the planner decides
    ds = run(scaler, profiles, lambda s: [0.1], range(200, 240, 5))
    shrunk = [d.step for d in ds if d.source("web").cpus < 8]
    assert shrunk[0] == 220


def test_a_rise_during_the_cooldown_scales_up_at_once() -> None:
    scaler = Autoscaler(Budget(cpus=64), cooldown_steps=20, horizon_steps=0)
    profiles = [prof("web", 1e-5)]
    ds = run(scaler, profiles, lambda s: [0.6 if s < 10 else 0.1 if s < 20 else 0.9], range(25))
    assert ds[19].source("web").cpus == 8 and scaler.state_dict()["low_since"] == {}
    assert ds[20].source("web").cpus == 12


# ---- the budget -----------------------------------------------------------------------------


def test_a_short_budget_is_divided_fairly() -> None:
    scaler = Autoscaler(Budget(cpus=8, memory_bytes=math.inf))
    profiles = [prof("a", 1e-5), prof("b", 1e-5)]  # each needs 5 CPUs, 6.25 with headroom
    d = scaler.decide(0, profiles, np.array([[0.5, 0.5]]), TOKENS_PER_STEP, STEP_TIME_S)
    assert d.source("a").cpus == 4 and d.source("b").cpus == 4
    assert d.bottleneck == "a"  # equal shortfall: the first is named
    assert d.reason.startswith("budget short: demand with 25% headroom wants 14 CPUs")


def test_the_bottleneck_is_the_source_furthest_below_its_demand() -> None:
    # cheap needs half a CPU, expensive 5 CPUs; 4 CPUs in all
    scaler = Autoscaler(Budget(cpus=4, memory_bytes=math.inf))
    profiles = [prof("cheap", 1e-6), prof("expensive", 1e-5)]
    d = scaler.decide(0, profiles, np.array([[0.5, 0.5]]), TOKENS_PER_STEP, STEP_TIME_S)
    assert (d.source("cheap").cpus, d.source("expensive").cpus) == (1, 3)
    assert d.bottleneck == "expensive"
    assert "bottleneck expensive: capacity 300k tok/s for demand 500k tok/s (60%)" in d.reason
    assert "budget allows 60% of demand" in d.source("expensive").reason


def test_a_source_capped_by_its_shards_is_the_bottleneck() -> None:
    scaler = Autoscaler(Budget(cpus=64))
    gil_bound = prof("gil", 1e-5, thread_efficiency=0.0, max_loaders=2)
    d = scaler.decide(0, [gil_bound], np.array([[0.5]]), TOKENS_PER_STEP, STEP_TIME_S)
    assert shape(d, "gil") == (2, 1) and d.bottleneck == "gil"
    assert "capped at 2 loaders (max_loaders)" in d.source("gil").reason


def test_sizes_kept_by_hysteresis_give_way_to_a_short_source() -> None:
    scaler = Autoscaler(Budget(cpus=10, memory_bytes=math.inf), cooldown_steps=100)
    # "old" holds 8 threads it no longer needs (its cooldown has not run out); "new" now needs 7
    profiles = [prof("old", 1e-5, loaders=2, threads=4), prof("new", 1e-5)]
    d = scaler.decide(0, profiles, np.array([[0.1, 0.5]]), TOKENS_PER_STEP, STEP_TIME_S)
    assert d.source("old").cpus == 2 and d.source("new").cpus == 7 and d.bottleneck is None
    assert "shrunk at once to fit the budget" in d.source("old").reason


def test_a_short_budget_does_not_flap_either() -> None:
    # both sources want more than 12 CPUs can give; the fair division moves with every
    # wobble of their measured costs unless re-dividing must gain rebalance_gain
    noise = np.exp(np.random.default_rng(1).normal(0.0, 0.05, size=(200, 2)))

    def sizes(scaler: Autoscaler) -> list[Decision]:
        profiles = [prof("a", 1e-5), prof("b", 2e-5)]
        return run(scaler, profiles, lambda s: [0.5, 0.5], range(200),
                   noise=lambda s, i: float(noise[s, i]))  # fmt: skip

    budget = Budget(cpus=12, memory_bytes=math.inf)
    steady = sizes(Autoscaler(budget))
    assert all(d.cpus <= 12 and d.bottleneck is not None for d in steady)
    assert changes(steady) == 0 and "kept as it is" in steady[-1].reason
    assert changes(sizes(Autoscaler(budget, rebalance_gain=0.0))) > 3


def test_a_budget_below_the_minimum_is_an_error() -> None:
    scaler = Autoscaler(Budget(cpus=2, min_loaders=1))
    profiles = [prof(n, 1e-5) for n in "abc"]
    with pytest.raises(
        ValueError, match="cannot hold the minimum .* each of 3 sources, which takes 3 CPUs"
    ):
        scaler.decide(0, profiles, np.full((1, 3), 1 / 3), TOKENS_PER_STEP, STEP_TIME_S)


profile_st = st.builds(
    SourceProfile,
    name=st.just("x"),
    cpu_s_per_token=st.one_of(st.just(0.0), st.just(math.nan), st.floats(1e-8, 1e-3)),
    memory_bytes_per_loader=st.floats(0, 4 * GiB),
    loaders=st.integers(0, 12),
    threads=st.integers(1, 8),
    thread_efficiency=st.floats(0, 1),
    max_loaders=st.one_of(st.none(), st.integers(1, 16)),
)


@st.composite
def scenario(draw: st.DrawFn) -> tuple[Budget, list[SourceProfile], np.ndarray]:
    n = draw(st.integers(1, 5))
    profiles = [replace(draw(profile_st), name=f"s{i}") for i in range(n)]
    min_loaders = draw(st.integers(1, 2))
    cpus = draw(st.integers(n * min_loaders, 200))
    floor = sum(
        min(min_loaders, p.max_loaders or min_loaders) * p.memory_bytes_per_loader for p in profiles
    )
    memory = draw(st.one_of(st.just(math.inf), st.floats(1.0, 8.0).map(lambda f: f * floor + 1)))
    budget = Budget(
        cpus=cpus,
        memory_bytes=memory,
        min_loaders=min_loaders,
        max_threads_per_loader=draw(st.integers(1, 8)),
    )
    rows = draw(st.integers(1, 6))
    w = np.array(
        draw(
            st.lists(
                st.lists(st.floats(0, 1), min_size=n, max_size=n), min_size=rows, max_size=rows
            )
        )
    )
    return budget, profiles, w


@settings(max_examples=300, deadline=None)
@given(scenario(), st.floats(1e3, 1e8))
def test_the_budget_is_never_exceeded(
    case: tuple[Budget, list[SourceProfile], np.ndarray], tokens_per_s: float
) -> None:
    budget, profiles, w = case
    scaler = Autoscaler(budget)
    for step in range(3):  # from the profiles' sizes, then from the decisions' own
        d = scaler.decide(step, profiles, w, tokens_per_s, 1.0)
        assert within_budget(d, budget)
        for p, s in zip(profiles, d.sources):
            lo = min(budget.min_loaders, p.max_loaders or budget.min_loaders)
            assert s.loaders >= lo and 1 <= s.threads <= budget.max_threads_per_loader
            assert p.max_loaders is None or s.loaders <= p.max_loaders
        short = {
            s.name: s.capacity_tokens_per_s / s.demand_tokens_per_s
            for s in d.sources
            if s.capacity_tokens_per_s < s.demand_tokens_per_s * (1 - 1e-9)
        }
        assert d.bottleneck == (min(short, key=lambda k: short[k]) if short else None)
        profiles = apply(profiles, d)


@settings(max_examples=200, deadline=None)
@given(scenario(), st.floats(1e3, 1e7))
def test_an_ample_budget_meets_every_demand(
    case: tuple[Budget, list[SourceProfile], np.ndarray], tokens_per_s: float
) -> None:
    _, profiles, w = case
    profiles = [replace(p, max_loaders=None) for p in profiles]
    scaler = Autoscaler(Budget(cpus=1e9))
    d = scaler.decide(0, profiles, w, tokens_per_s, 1.0)
    assert d.bottleneck is None
    for p, s in zip(profiles, d.sources):
        if p.measured:
            assert s.capacity_tokens_per_s >= s.demand_tokens_per_s * (1 - 1e-9)


@pytest.mark.parametrize("cpus", [64, 6])
def test_a_curriculum_toward_an_expensive_source(cpus: int) -> None:
    # the expensive source costs 10x per token and rises from 10% to 60% of the mixture
    budget = Budget(cpus=cpus, memory_bytes=16 * GiB)
    scaler = Autoscaler(budget, horizon_steps=50)
    profiles = [prof("cheap", 1e-6), prof("expensive", 1e-5)]

    def weights(step: int) -> list[float]:
        e = 0.1 + 0.5 * min(step, 1000) / 1000
        return [1 - e, e]

    ds = run(scaler, profiles, weights, range(0, 1200, 10))
    workers = [d.source("expensive").cpus for d in ds]
    assert all(within_budget(d, budget) for d in ds)
    assert workers == sorted(workers)  # never shrinks while its weight rises
    assert workers[-1] >= 2 * workers[0]
    assert all(d.source("expensive").cpus > d.source("cheap").cpus for d in ds)
    if cpus == 64:
        assert all(d.bottleneck is None for d in ds)
    else:  # at 60% it needs 6 CPUs and the cheap source one: the budget falls short
        assert ds[-1].bottleneck == "expensive" and ds[-1].source("expensive").cpus == 5


# ---- determinism and state ------------------------------------------------------------------


def test_the_same_input_gives_the_same_decision() -> None:
    def decisions() -> list[Decision]:
        scaler = Autoscaler(Budget(cpus=12, memory_bytes=4 * GiB))
        profiles = [prof("a", 2e-6), prof("b", 1e-5), prof("c", 4e-6, thread_efficiency=0.3)]
        return run(
            scaler,
            profiles,
            lambda s: [0.5 - s / 400, 0.25 + s / 800, 0.25 + s / 800],
            range(0, 100, 3),
        )

    assert decisions() == decisions()


def test_state_survives_a_json_round_trip() -> None:
    budget = Budget(cpus=64)
    weights = lambda s: [0.6 if s < 100 else 0.1]  # noqa: E731
    first = Autoscaler(budget, cooldown_steps=20, horizon_steps=0)
    profiles = [prof("web", 1e-5)]
    run(first, profiles, weights, range(110))  # 10 steps into the cooldown
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"version": 1, "low_since": {"web": 100}}

    second = Autoscaler(budget, cooldown_steps=20, horizon_steps=0)
    second.load_state_dict(state)
    a = run(first, list(profiles), weights, range(110, 130))
    b = run(second, list(profiles), weights, range(110, 130))
    assert a == b and a[10].source("web").cpus == 2 and a[9].source("web").cpus == 8


@pytest.mark.parametrize(
    "state, match",
    [
        ({"low_since": {}}, "expected version 1, found None"),
        ({"version": 2, "low_since": {}}, "expected version 1, found 2"),
        ({"version": 1, "low_since": {"web": -1}}, "map source names to steps >= 0"),
        ({"version": 1, "low_since": [["web", 3]]}, "map source names to steps >= 0"),
    ],
)
def test_a_bad_state_is_refused(state: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Autoscaler(Budget(cpus=4)).load_state_dict(state)


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "profiles, weights, tokens, step_time, match",
    [
        ([], np.zeros((1, 0)), 1e6, 1.0, "no source profiles"),
        ([prof("a", 1e-5)], np.ones((1, 2)), 1e6, 1.0, r"shape \(steps >= 1, 1 sources\)"),
        ([prof("a", 1e-5)], np.ones(1), 1e6, 1.0, r"found \(1,\)"),
        ([prof("a", 1e-5)], np.ones((1, 1)), 1e6, 0.0, "step_time_s must be > 0"),
        ([prof("a", 1e-5)], np.ones((1, 1)), -1.0, 1.0, "tokens_per_step must be > 0"),
        ([prof("a", 1e-5)], np.array([[math.nan]]), 1e6, 1.0, "finite and >= 0"),
        ([prof("a", 1e-5), prof("a", 1e-5)], np.ones((1, 2)), 1e6, 1.0, r"found \['a'\] more"),
    ],
)
def test_bad_input_is_refused(
    profiles: list[SourceProfile], weights: np.ndarray, tokens: float, step_time: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Autoscaler(Budget(cpus=4)).decide(0, profiles, weights, tokens, step_time)


def test_every_problem_of_a_profile_budget_or_policy_is_named_at_once() -> None:
    with pytest.raises(ValueError, match=r"3 problem\(s\)") as e:
        SourceProfile("web", -1.0, memory_bytes_per_loader=math.inf, loaders=1, threads=0)
    assert "cpu_s_per_token" in str(e.value) and "memory_bytes_per_loader" in str(e.value)
    with pytest.raises(ValueError, match=r"budget: 2 problem\(s\)"):
        Budget(cpus=0, max_threads_per_loader=0)
    with pytest.raises(ValueError, match=r"autoscaler: 2 problem\(s\)"):
        Autoscaler(Budget(cpus=4), headroom=0.5, down_threshold=1.5)


# ---- actions --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(1, 6), st.integers(1, 4)),
        min_size=1,
        max_size=4,
    )
)
def test_actions_reach_the_decision_shrinking_first(moves: list[tuple[int, int, int, int]]) -> None:
    profiles = [
        prof(f"s{i}", 1e-5, loaders=l0, threads=t0) for i, (l0, t0, _, _) in enumerate(moves)
    ]
    decision = Decision(
        0,
        tuple(
            SourceDecision(f"s{i}", l1, t1, 1.0, 1.0, 0.0, "why")
            for i, (_, _, l1, t1) in enumerate(moves)
        ),
        None,
        "",
    )
    sizes = {p.name: [p.loaders, p.threads] for p in profiles}
    start = sum(lo * t for lo, t in sizes.values())
    peak = start
    for a in plan_actions(profiles, decision):
        if a.kind is ActionKind.ADD_LOADERS:
            sizes[a.source][0] += a.count
        elif a.kind is ActionKind.REMOVE_LOADERS:
            sizes[a.source][0] -= a.count
        else:
            sizes[a.source][1] = a.count
        peak = max(peak, sum(lo * t for lo, t in sizes.values()))
    assert sizes == {s.name: [s.loaders, s.threads] for s in decision.sources}
    assert peak == max(start, decision.cpus)
    assert decision.changed(profiles) == any((l0, t0) != (l1, t1) for l0, t0, l1, t1 in moves)
