"""Trainers report step times; the planner refits its cost model, records it, and replays it.

A synthetic trainer takes ``A * S1 + B * S2`` seconds on a rank's step (``S1``
and ``S2`` the sums of its documents' lengths and their squares), with a
``beta`` the plan gets wrong. Its reports must move the plan's ``beta`` toward
the truth within the refit's bounds, every decision must be recorded (state,
journal) and applied again where a step is planned again, and a run without
reports must be what it was before reports existed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.jobs import restart_planner

from conftest import make_corpus
from overlord import Loader, load_plan
from overlord.ops.run import dump_line
from overlord.plan.cost import CostModel
from overlord.plan.refit import REFIT_FACTOR, ratio_bounds, refit_cost
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.api import OpsRole
from overlord.roles.client import Client
from overlord.roles.feedback import check_report, decisions, reports

DP, STEPS = 2, 24
A, B = 1.0, 0.02  # the trainer's true seconds per token and per token squared (scaled)
PLAN_BETA = 0.005  # the plan's beta: 4x too small


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("feedback")
    sources = {
        "web": {"files": {f"data/web/part-{i}.jsonl": 40 for i in range(3)}, "loaders": 2},
        "code": {"files": {"data/code/part-0.jsonl": 60}},
    }
    return make_corpus(
        root,
        sources,
        batch={"tokens_per_step": 512, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": DP},
        balance={"cost": {"alpha": 1.0, "beta": PLAN_BETA}},
    )


def plan_of(corpus: Path, journal: Path | None = None, **refit: Any) -> Plan:
    plan = load_plan(corpus)
    data = plan.model_dump(mode="json")
    if refit:
        data["balance"]["refit"] = refit
    if journal is not None:
        data["recovery"].update(journal_dir=str(journal), snapshot_every=5)
    return validate_plan(data, base_dir=plan.base_dir)


def seconds_of(batch: Any) -> float:
    """The synthetic trainer's time on a batch."""
    t = np.array([s.tokens for s in batch.samples], dtype=np.float64)
    return float(A * t.sum() + B * (t * t).sum())


def run(
    plan: Plan,
    steps: int = STEPS,
    report: bool = True,
    state: dict[str, Any] | None = None,
    actions: dict[int, Any] | None = None,
    follow: dict[str, Any] | None = None,
) -> tuple[list[str], dict[str, Any], dict[str, Any], Path | None]:
    """Every rank's batches, reported as the synthetic trainer trains them."""
    lines = []
    with Loader(plan, state=state) as loader:
        if follow is not None:
            loader.planner.obj.loop.follow(follow)  # type: ignore[attr-defined]
        clients = [loader.client(r) for r in range(DP)]
        for step in range(loader.start_step, steps):
            batches = [next(clients[0])]
            if actions and step in actions:  # step planned, not consumed by every rank yet
                actions[step](loader)
            batches += [next(c) for c in clients[1:]]
            lines += [dump_line(b) for b in batches]
            if report:
                for c, b in zip(clients, batches):
                    c.report(b.step, seconds_of(b))
                clients[0].flush()
        journal = Path(loader.journal) if loader.journal else None
        loader.journal = None  # kept for the test to read
        return lines, loader.stats(), loader.state_dict(), journal


def test_without_reports_the_stream_and_the_state_are_those_of_a_plan_without_refit(corpus):
    base = run(plan_of(corpus), report=False)
    refit = run(plan_of(corpus, every=4, window=8, min_samples=4), report=False)
    assert refit[0] == base[0]
    assert refit[2] == base[2] and "feedback" not in refit[2]
    assert refit[1]["feedback"]["refits"] == 0


def test_reports_move_beta_toward_the_truth_and_every_refit_is_recorded(corpus, tmp_path):
    plan = plan_of(corpus, tmp_path, every=4, window=8, min_samples=4)
    lines, stats, state, journal = run(plan)
    fb = stats["feedback"]
    assert fb["refits"] >= 3 and fb["dropped"] == 0 and fb["received"] == DP * STEPS
    assert fb["beta"] == pytest.approx(B, rel=1e-6)  # the trainer is exactly a*S1 + b*S2
    assert fb["cost_model_error"] < 0.01
    cost = state["feedback"]["cost"]
    assert cost["beta"] == pytest.approx(B, rel=1e-6) and cost["alpha"] == 1.0
    assert [r[0] for r in cost["refits"]] == sorted(r[0] for r in cost["refits"])
    assert all(r[0] % 4 == 0 for r in cost["refits"])
    # after the first refit, the batches carry costs of the refitted model
    first = cost["refits"][0][0]
    later = [json.loads(x) for x in lines if json.loads(x)["step"] >= first + 2]
    t = np.array([s["tokens"] for s in later[0]["samples"]], dtype=np.float64)
    assert later[0]["cost"] == pytest.approx(float((t + cost["beta"] * t * t).sum()))
    assert journal is not None
    found = decisions(journal)
    assert found["cost"][cost["refits"][-1][0]][1] == pytest.approx(B, rel=1e-6)
    seen = reports(journal)
    assert seen and all(set(v) == set(range(DP)) for v in seen.values())
    step = max(seen)
    assert seen[step][0]["seconds"] is not None and seen[step][0]["predicted"] > 0


def test_a_planner_restarted_from_its_journal_applies_the_recorded_refits(corpus, tmp_path):
    """The stream with restarts equals a run that follows the recorded decisions exactly."""
    plan = plan_of(corpus, tmp_path / "a", every=3, window=6, min_samples=4)
    # before refit steps: planning the step again decides (again) what holds from the next
    actions = {s: restart_planner for s in (5, 11, 17)}
    lines, stats, _, journal = run(plan, actions=actions)
    assert journal is not None
    found = decisions(journal)
    assert len(found["cost"]) >= 3 and set(found["cost"]) & {s + 1 for s in actions}
    assert stats["events"][-1]["replanned"] >= 1
    # the same plan, no reports at all, told the recorded decisions: the same stream
    again, _, _, _ = run(plan_of(corpus, tmp_path / "b"), report=False, follow=found)
    assert again == lines


def test_a_run_resumed_from_a_checkpoint_balances_with_the_coefficients_in_force(
    corpus, tmp_path
):
    """The state holds the model in force; with the recorded refits the stream is unchanged."""
    plan = plan_of(corpus, tmp_path, every=4, window=8, min_samples=4)
    half = 14  # between two refits (every 4): the state alone holds the model in force
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(DP)]
        lines, states = [], {}
        for _ in range(STEPS):
            batches = [next(c) for c in clients]
            lines += [dump_line(b) for b in batches]
            for c, b in zip(clients, batches):
                c.report(b.step, seconds_of(b))
            clients[0].flush()
            if batches[0].step == half - 1:
                states[half] = loader.state_dict()
        journal = Path(loader.journal or "")
        loader.journal = None
    ckpt = states[half]
    assert ckpt["feedback"]["cost"]["refits"]  # refits happened before the checkpoint
    later = {s: v for s, v in decisions(journal)["cost"].items() if s >= half}
    resumed, _, _, _ = run(plan, state=ckpt, report=False, follow={"cost": later})
    assert resumed == lines[half * DP :]


def test_a_report_for_a_step_not_kept_is_counted_and_dropped(corpus):
    plan = plan_of(corpus, every=4, window=8, min_samples=4)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(DP)]
        for c in clients:
            next(c)
        clients[0].report(500, 1.0)  # not planned
        clients[0].report(0, 1.0)
        clients[0].flush()
        fb = loader.stats()["feedback"]
    assert (fb["dropped"], fb["received"]) == (1, 1)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((3, -1.0, None), "seconds"),
        ((3, float("nan"), None), "seconds"),
        ((-1, 1.0, None), "step"),
        ((3, 1.0, {"nope": 1.0}), "'nope'"),
        ((3, 1.0, {"web": float("inf")}), "loss_by_source['web']"),
        ((3, 1.0, [1.0]), "mapping"),
    ],
)
def test_a_malformed_report_is_a_value_error_at_the_call(corpus, args, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        check_report(*args, ["web", "code"])
    with Loader(plan_of(corpus)) as loader:
        client = loader.client(0)
        assert isinstance(client, Client)
        with pytest.raises(ValueError):
            client.report(*args)


# ---- the rule ------------------------------------------------------------------------------


def sums(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank sums of random documents: some long, some short."""
    s1, s2 = np.zeros(n), np.zeros(n)
    for i in range(n):
        docs = rng.integers(1, 2048, size=rng.integers(1, 16)).astype(np.float64)
        s1[i], s2[i] = docs.sum(), (docs * docs).sum()
    return s1, s2


def test_the_refit_finds_the_true_ratio_within_the_bounds():
    rng = np.random.default_rng(0)
    s1, s2 = sums(rng, 32)
    plan = CostModel(6.0, 6.0 * 0.01)
    truth = 3e-9 * (s1 + 0.02 * s2)  # beta/alpha 2x the plan's, in seconds
    r = refit_cost(s1, s2, truth, plan, 4096)
    assert r is not None and not r.bounded
    assert r.alpha == 6.0 and r.beta / r.alpha == pytest.approx(0.02)
    assert r.scale * 6.0 == pytest.approx(3e-9) and r.error < 1e-9


@pytest.mark.parametrize("factor", [100.0, 1 / 100.0])
def test_the_refit_holds_beta_within_its_bounds_and_monotone(factor):
    rng = np.random.default_rng(1)
    s1, s2 = sums(rng, 32)
    plan = CostModel(1.0, 0.01)
    truth = s1 + 0.01 * factor * s2
    r = refit_cost(s1, s2, truth, plan, 4096)
    lo, hi = ratio_bounds(plan, 4096)
    assert r is not None and r.bounded
    assert r.beta / r.alpha == pytest.approx(hi if factor > 1 else lo)
    bound = 0.01 * REFIT_FACTOR if factor > 1 else 0.01 / REFIT_FACTOR
    assert (hi if factor > 1 else lo) == pytest.approx(bound)


def test_a_fit_that_would_give_a_negative_beta_stays_at_its_lower_bound():
    s1 = np.array([100.0, 100.0, 100.0])
    s2 = np.array([1000.0, 5000.0, 9000.0])
    t = np.array([3.0, 2.0, 1.0])  # faster as documents grow: noise, not attention
    r = refit_cost(s1, s2, t, CostModel(1.0, 0.001), 64)
    assert r is not None and r.bounded and r.beta >= 0
    assert r.beta == pytest.approx(0.001 / REFIT_FACTOR)


def test_a_plan_with_beta_0_may_learn_a_beta_up_to_its_bound():
    rng = np.random.default_rng(2)
    s1, s2 = sums(rng, 16)
    r = refit_cost(s1, s2, s1 + 0.001 * s2, CostModel(1.0, 0.0), 2048)
    assert r is not None and r.beta == pytest.approx(0.001)
    r = refit_cost(s1, s2, s1 + 1.0 * s2, CostModel(1.0, 0.0), 2048)
    assert r is not None and r.bounded and r.beta == pytest.approx(REFIT_FACTOR / 2048)


def test_ranks_that_cannot_tell_alpha_from_beta_give_no_refit():
    s1 = np.array([100.0, 200.0, 300.0])
    r = refit_cost(s1, 10 * s1, 2 * s1, CostModel(1.0, 0.01), 64)
    assert r is None


def test_reports_fill_the_rank_figures_the_model_error_and_the_refit_count(corpus):
    plan = plan_of(corpus, every=4, window=8, min_samples=4)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(DP)]
        m = loader.monitor()
        assert m["refits"] == 0 and np.isnan(m["cost_model_error"])
        for _ in range(10):
            batches = [next(c) for c in clients]
            for c, b in zip(clients, batches):
                c.report(b.step, seconds_of(b))
            clients[0].flush()
        m = loader.monitor()
        assert m["refits"] >= 1
        assert m["cost_model_error"] < 0.01  # refit on the exact synthetic trainer
        for b in batches:  # the last reported step's prediction and measure, per rank
            assert m["rank_step_s"][b.rank] == pytest.approx(seconds_of(b))
            assert m["rank_cost"][b.rank] == pytest.approx(b.cost)
        seen = loader.planner.call(OpsRole.feedback, batches[0].step).result()
        k = seen[0]["predicted_seconds"] / seen[0]["predicted"]  # the refit's seconds per cost
        for b in batches:
            assert seen[b.rank]["seconds"] == pytest.approx(seconds_of(b))
            assert seen[b.rank]["predicted"] == pytest.approx(b.cost)
            assert seen[b.rank]["predicted_seconds"] == pytest.approx(seconds_of(b), rel=0.01)
        assert k == pytest.approx(A, rel=0.01)


def test_the_pytorch_dataset_reports_through_its_stream(corpus):
    pytest.importorskip("torch")
    from overlord.torch import OverlordIterableDataset

    plan = plan_of(corpus, every=4, window=8, min_samples=2).with_dp(1)
    with OverlordIterableDataset.from_plan(plan, stop_step=9) as ds:
        for step, batch in enumerate(ds):
            t = batch["input_ids"].shape[-1]
            ds.report(step, seconds=1e-3 * t, loss_by_source={"web": 2.0})
        with pytest.raises(ValueError, match="'nope'"):
            ds.report(8, seconds=1.0, loss_by_source={"nope": 1.0})
        stream = ds._stream
        stream._open().flush()  # type: ignore[attr-defined]
        fb = stream._loader.stats()["feedback"]  # type: ignore[attr-defined]
    assert (fb["received"], fb["dropped"]) == (9, 0)


@pytest.mark.ray
@pytest.mark.integration
def test_connected_trainers_report_to_a_job_on_ray_which_refits(ray_session, corpus):
    from overlord import connect

    plan = plan_of(corpus, every=4, window=8, min_samples=4)
    with Loader(plan, runtime="ray", job="t-feedback") as loader:
        clients = [connect("t-feedback", rank=r, stop_step=10) for r in range(DP)]
        for _ in range(10):
            batches = [next(c) for c in clients]
            for c, b in zip(clients, batches):
                c.report(b.step, seconds_of(b))
            for c in clients:
                c.flush()
        with pytest.raises(ValueError, match="'nope'"):
            clients[0].report(9, 1.0, {"nope": 1.0})  # the job's source names, at the call
        fb = loader.stats()["feedback"]
    assert fb["received"] == DP * 10 and fb["refits"] >= 1
    assert fb["beta"] == pytest.approx(B, rel=1e-6)


def test_resumed_without_refit_the_plans_model_balances_again(corpus):
    _, _, state, _ = run(plan_of(corpus, every=4, window=8, min_samples=4), steps=10)
    assert state["feedback"]["cost"]["refits"]
    plain = plan_of(corpus)
    resumed = run(plain, steps=16, report=False, state=state)
    stripped = {k: v for k, v in state.items() if k != "feedback"}
    assert resumed[0] == run(plain, steps=16, report=False, state=stripped)[0]
    assert "feedback" not in resumed[2]


def test_a_step_with_a_refit_replays_from_the_state_before_it(corpus):
    """The state before a refit step holds the refit: a replay from it plans the step as run."""
    from overlord.replays import Point, build

    plan = plan_of(corpus, every=4, window=8, min_samples=4)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(DP)]
        lines, states = [], {}
        for _ in range(14):
            batches = [next(c) for c in clients]
            lines += [dump_line(b) for b in batches]
            for c, b in zip(clients, batches):
                c.report(b.step, seconds_of(b))
            clients[0].flush()
            states[batches[0].step + 1] = loader.state_dict()
    refit = [s for s, *_ in states[13]["feedback"]["cost"]["refits"]][-1]  # a step, e.g. 12
    state = states[refit]
    assert state["feedback"]["cost"]["refits"][-1][0] == refit  # in force from that step
    replayed = build(Point(plan, state, refit, "test"))
    assert [dump_line(b) for b in replayed] == lines[refit * DP : (refit + 1) * DP]
