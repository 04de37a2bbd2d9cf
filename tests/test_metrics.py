"""Monitoring: the endpoint's counters equal what the trainers received; status; report."""

from __future__ import annotations

import json
import math
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import two_sources
from overlord import Loader, load_plan
from overlord.monitor.figures import COUNT_STEPS, Figures, Histogram
from overlord.monitor.prometheus import METRICS
from overlord.plan.spec import validate_plan

prom = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture
def plan(tmp_path: Path):
    path = two_sources(tmp_path)
    return with_port(load_plan(path), 0)


def with_port(plan, port):
    data = plan.model_dump(mode="json")
    data["monitoring"] = {"port": port}
    return validate_plan(data, base_dir=plan.base_dir)


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Every sample of the endpoint: name -> {sorted labels: value}."""
    assert url.startswith("http://127.0.0.1:")
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def run_and_scrape(loader: Loader, steps: int):
    """Consume ``steps`` steps on every rank, then scrape (the run goes on: more is read ahead)."""
    clients = [loader.client(r) for r in range(loader.plan.world.dp)]
    got = [next(c) for _ in range(steps) for c in clients]
    loader.state_dict()  # the consumption notices reached the planner
    return got, scrape(loader.metrics_url), clients


def check_counters(batches, m, dp: int, steps: int) -> None:
    tokens, samples = Counter(), Counter()
    for b in batches:
        for s in b.samples:
            tokens[s.source] += s.tokens
            samples[s.source] += 1
    assert m["overlord_steps_total"][()] == steps
    for source in ("web", "code"):
        key = (("source", source),)
        assert m["overlord_tokens_total"][key] == tokens[source]
        assert m["overlord_samples_total"][key] == samples[source]
        assert m["overlord_share"][key] == pytest.approx(tokens[source] / sum(tokens.values()))
    assert sum(m["overlord_target_share"].values()) == pytest.approx(1.0)
    assert m["overlord_loaders"][(("source", "web"),)] == 2
    assert m["overlord_loaders"][(("source", "code"),)] == 1
    assert m["overlord_loader_threads"][(("source", "web"),)] == 2
    # every rank's wait was observed once per step it received
    for r in range(dp):
        assert m["overlord_rank_wait_seconds_count"][(("rank", str(r)),)] == steps
        assert m["overlord_rank_wait_seconds_bucket"][(("le", "+Inf"), ("rank", str(r)))] == steps
    assert m["overlord_plan_seconds_count"][()] >= steps
    assert m["overlord_failovers_total"][(("role", "loader"),)] == 0
    assert m["overlord_read_retries_total"][(("source", "web"),)] == 0
    # the last consumed step's predicted cost of each rank is what its batch said
    last = {b.rank: b.cost for b in batches[-dp:]}
    for r in range(dp):
        assert m["overlord_rank_cost_predicted"][(("rank", str(r)),)] == pytest.approx(last[r])
        assert m["overlord_rank_step_seconds"][(("rank", str(r)),)] >= 0
    assert m["overlord_seconds_per_cost"][()] >= 0


def test_a_scrape_during_a_run_gives_the_counters_the_trainers_received(plan):
    with Loader(plan) as loader:
        batches, m, clients = run_and_scrape(loader, 7)
        check_counters(batches, m, plan.world.dp, 7)
        # every metric of the contract is there
        names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in m}
        assert set(METRICS) <= names, set(METRICS) - names
        # and it goes on counting
        assert all(next(c).step == 7 for c in clients)
        loader.state_dict()
        assert scrape(loader.metrics_url)["overlord_steps_total"][()] == 8


def test_no_endpoint_without_a_port_and_a_taken_port_is_a_clear_error(plan):
    no_port = with_port(plan, None)
    with Loader(no_port) as loader:
        assert loader.metrics_url is None
        assert loader.monitor()["steps"] == 0  # the figures are kept all the same
    with Loader(plan) as first:
        port = int(first.metrics_url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(Exception, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            Loader(with_port(plan, port))


def test_figures_pair_step_times_with_the_previous_steps_cost():
    f = Figures(["a", "b"], dp=2)
    f.planned(0, 0.001, [2.0, 4.0])
    f.planned(1, 0.001, [1.0, 1.0])
    f.trainer(0, 0, None, 0.5)
    f.trainer(0, 1, train_s=1.0, wait_s=0.0)  # 1 s on step 0, whose cost was 2
    f.trainer(1, 1, train_s=2.0, wait_s=0.0)  # 2 s on a cost of 4
    assert f.seconds_per_cost() == pytest.approx(0.5)
    d = f.as_dict()
    assert d["rank_cost"] == [1.0, 1.0] and d["rank_step_s"] == [1.0, 2.0]
    assert d["wait"][0]["count"] == 2 and d["wait"][1]["count"] == 1
    h = Histogram((0.1, 1.0))
    for x in (0.05, 0.1, 0.5, 7.0):
        h.observe(x)
    assert h.as_dict()["buckets"] == [[0.1, 2], [1.0, 3], [math.inf, 4]]


def test_figures_count_every_consumed_steps_tokens_and_samples_when_read():
    rng = np.random.default_rng(3)
    f = Figures(["a", "b", "c"], dp=1)
    source, tokens = [], []
    for step in range(2 * COUNT_STEPS + 7):  # counted in bulk, and the rest when read
        n = int(rng.integers(0, 9))
        source.append(rng.integers(0, 3, n))
        tokens.append(rng.integers(1, 500, n))
        f.consumed(source[-1], tokens[-1])
        if step in (3, COUNT_STEPS - 1, COUNT_STEPS, 2 * COUNT_STEPS + 6):
            src, tok = np.concatenate(source), np.concatenate(tokens)
            want_tokens = np.bincount(src, weights=tok, minlength=3).astype(np.int64)
            d = f.as_dict()  # read first: it counts what was not counted yet
            assert d["steps"] == step + 1
            assert list(d["tokens"].values()) == want_tokens.tolist()
            assert d["share"]["a"] == want_tokens[0] / want_tokens.sum()
            assert f.tokens.tolist() == want_tokens.tolist()
            assert f.samples.tolist() == np.bincount(src, minlength=3).tolist()


def test_run_report_writes_markdown_and_four_plots(plan, tmp_path):
    from overlord.ops.run import run_plan

    summary = run_plan(with_port(plan, None), 12, progress=False, report=str(tmp_path / "rep"))
    md = Path(summary["report"]).read_text()
    for png in ("mixture.png", "balance.png", "ranks.png", "loaders.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 1000
        assert f"]({png})" in md
    assert "| 3 |" in md  # a row per rank


@pytest.mark.ray
def test_on_ray_the_planner_serves_every_roles_figures_and_status_shows_them(
    ray_session, plan, capsys
):
    from overlord.ops.status import status

    with Loader(plan, runtime="ray", job="metrics-ray") as loader:
        batches, m, _ = run_and_scrape(loader, 6)
        check_counters(batches, m, plan.world.dp, 6)
        # loaders' figures come from their own processes
        assert m["overlord_buffered_tokens"][(("source", "web"),)] > 0
        pids = {s["pid"] for s in loader.stats()["loaders"]}
        assert len(pids) >= 3
        assert status("metrics-ray", once=True) == 0
    out = capsys.readouterr().out
    assert "metrics-ray" in out and "web" in out and "code" in out
    assert "6 steps consumed" in out


def test_metric_names_are_the_contract():
    want = [
        "overlord_steps_total", "overlord_tokens_total", "overlord_samples_total",
        "overlord_skipped_records_total", "overlord_epoch", "overlord_share",
        "overlord_target_share", "overlord_rank_wait_seconds", "overlord_plan_seconds",
        "overlord_loaders", "overlord_loader_threads", "overlord_buffered_tokens",
        "overlord_reads_in_flight", "overlord_failovers_total", "overlord_rank_cost_predicted",
        "overlord_rank_step_seconds", "overlord_read_retries_total",
    ]  # fmt: skip
    assert set(want) <= set(METRICS)
    assert json.dumps(sorted(METRICS))  # plain names
