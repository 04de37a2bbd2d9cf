"""A mixture that adapts to reported losses: bounded, floored, followed, and replayed exactly.

A synthetic loss model: one source's loss stays high while the other's is low.
The exponentiated-gradient policy must move weight toward the high-loss source,
never past its bound nor below the floor; the tokens each source places must
follow the adapted targets within one row; and the run must replay exactly
from its journal's recorded adaptations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.jobs import restart_planner

from conftest import make_corpus
from overlord import Loader, PlanError, load_plan
from overlord.ops.run import dump_line
from overlord.plan.refit import adapt_log, adapted, bounded
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.feedback import decisions

DP, STEPS, ROW = 2, 32, 64
LOSS = {"web": 1.0, "code": 2.5}  # code's loss stays high
PRIOR = {"web": 0.7, "code": 0.3}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapt")
    sources = {
        "web": {"files": {f"data/web/part-{i}.jsonl": 60 for i in range(3)}, "loaders": 2},
        "code": {"files": {f"data/code/part-{i}.jsonl": 60 for i in range(2)}},
    }
    return make_corpus(
        root,
        sources,
        batch={"tokens_per_step": 512, "max_seq_len": ROW, "prefetch_steps": 1},
        world={"dp": DP},
        mixture={"schedule": [{"step": 0, "weights": PRIOR}]},
    )


def plan_of(corpus: Path, journal: Path | None = None, **adapt: Any) -> Plan:
    plan = load_plan(corpus)
    data = plan.model_dump(mode="json")
    if adapt:
        data["mixture"]["adapt"] = adapt
    if journal is not None:
        data["recovery"].update(journal_dir=str(journal), snapshot_every=5)
    return validate_plan(data, base_dir=plan.base_dir)


ADAPT = {"every": 4, "eta": 0.5, "bounds": {"code": [0.1, 0.6]}, "floor": 0.2}


def run(
    plan: Plan,
    report: bool = True,
    follow: dict[str, Any] | None = None,
    actions: dict[int, Any] | None = None,
) -> tuple[list[str], dict[str, Any], dict[str, Any], Path | None]:
    """Every rank's batches, each rank reporting its mean loss per source of the step."""
    lines = []
    with Loader(plan) as loader:
        if follow is not None:
            loader.planner.obj.loop.follow(follow)  # type: ignore[attr-defined]
        clients = [loader.client(r) for r in range(DP)]
        for step in range(STEPS):
            batches = [next(clients[0])]
            if actions and step in actions:  # step planned, not consumed by every rank yet
                actions[step](loader)
            batches += [next(c) for c in clients[1:]]
            lines += [dump_line(b) for b in batches]
            if report:
                for c, b in zip(clients, batches):
                    losses = {s.source: LOSS[s.source] for s in b.samples}
                    c.report(b.step, 1.0, losses)
                clients[0].flush()
        journal = Path(loader.journal) if loader.journal else None
        loader.journal = None
        return lines, loader.stats(), loader.state_dict(), journal


def test_weight_moves_toward_the_high_loss_source_up_to_its_bound(corpus, tmp_path):
    lines, stats, state, _ = run(plan_of(corpus, tmp_path, **ADAPT))
    weights = [dict(zip(stats["sources"], h["weights"])) for h in stats["history"]]
    code = [w["code"] for w in weights]
    assert code[0] == pytest.approx(PRIOR["code"])  # the prior until the first adaptation
    assert code[-1] == pytest.approx(0.6)  # moved up to its bound, not past it
    assert all(b >= a - 1e-12 for a, b in zip(code, code[1:]))  # only ever toward it
    assert all(0.1 - 1e-12 <= c <= 0.6 + 1e-12 for c in code)
    assert all(w["web"] >= 0.2 - 1e-12 for w in weights)  # the floor
    assert state["feedback"]["mix"]["adapts"]
    # the realized tokens follow the adapted targets: within one row per source
    for name, s in state["sources"].items():
        assert abs(s["placed"] - s["target"]) <= ROW, name
    tokens = np.array([h["tokens"] for h in stats["history"] if h["step"] < STEPS]).sum(axis=0)
    target = sum(
        np.array(h["weights"]) * sum(h["tokens"]) for h in stats["history"] if h["step"] < STEPS
    )
    assert np.abs(tokens - target).max() <= ROW


def test_the_run_replays_exactly_from_its_journal(corpus, tmp_path):
    plan = plan_of(corpus, tmp_path / "a", **ADAPT)
    # the steps before adaptations, planned again: the recorded adaptation is applied
    actions = {s: restart_planner for s in (7, 15)}
    lines, stats, _, journal = run(plan, actions=actions)
    assert journal is not None
    found = decisions(journal)
    assert len(found["mix"]) >= 3 and set(found["mix"]) & {s + 1 for s in actions}
    again, _, _, _ = run(plan_of(corpus, tmp_path / "b", **ADAPT), report=False, follow=found)
    assert again == lines


def test_without_reports_an_adaptive_mixture_keeps_the_prior(corpus):
    adaptive = run(plan_of(corpus, every=4, eta=0.5), report=False)
    fixed = run(plan_of(corpus), report=False)
    assert adaptive[0] == fixed[0]
    assert "feedback" not in fixed[2]


# ---- the rule ------------------------------------------------------------------------------


def test_adapted_weights_stay_within_bounds_above_the_floor_and_sum_to_one():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 6))
        prior = rng.dirichlet(np.ones(n))
        log = rng.normal(0, 5, n)
        lo = rng.uniform(0, 0.3 / n, n)
        hi = rng.uniform(1.0 / n, 1.0, n)  # room for the weights to sum to 1
        floor = float(rng.uniform(0, 0.5 / n))
        w = adapted(prior, log, lo, hi, floor, 0.0)
        assert w.sum() == pytest.approx(1.0)
        assert (w >= np.maximum(lo, floor) - 1e-9).all() and (w <= hi + 1e-9).all()


def test_a_source_the_schedule_turns_off_stays_off():
    w = adapted(np.array([0.5, 0.5, 0.0]), np.array([0.0, 0.0, 5.0]), np.zeros(3), np.ones(3),
                0.1, 0.0)  # fmt: skip
    assert w[2] == 0.0 and w.sum() == pytest.approx(1.0)


def test_bounds_that_leave_no_room_scale_the_minimums():
    w = bounded(np.array([0.5, 0.5]), np.array([0.8, 0.8]), np.ones(2), np.array([True, True]))
    assert w.tolist() == [0.5, 0.5]


def test_the_policy_raises_the_log_weight_of_the_higher_loss():
    log = adapt_log(np.zeros(3), np.array([1.0, 3.0, np.nan]), np.array([0.5, 0.5, 0.0]), 1.0)
    assert log[1] > 0 > log[0] and log[2] == 0.0


def test_bounds_of_unknown_sources_or_without_room_are_plan_errors(corpus):
    plan = load_plan(corpus)
    data = plan.model_dump(mode="json")
    data["mixture"]["adapt"] = {"every": 4, "bounds": {"nope": [0, 1], "web": [0.9, 1.0]},
                                "floor": 0.2}  # fmt: skip
    with pytest.raises(PlanError) as e:
        validate_plan(data, base_dir=plan.base_dir)
    assert "mixture.adapt.bounds.nope" in str(e.value)
    assert "minimums sum to 1.1" in str(e.value)
