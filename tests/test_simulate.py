"""``overlord simulate`` against a real run of the same plan, and its figures' rules.

The real run (:func:`overlord.ops.run.run_plan`) builds and delivers every
rank's batches; its dump is read back here, and each rank's cost recomputed
from the samples it received with the plan's cost model, so the balance the
simulation reports is checked against what the ranks were given, not against
the planner's own account.
"""

from __future__ import annotations

import io
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord.ops.cli import main
from overlord.ops.run import run_plan
from overlord.ops.simulate import simulate
from overlord.plan.budget import token_budget
from overlord.plan.cost import CostModel
from overlord.plans import load_plan
from overlord.sources.window import PIECE_BYTES

STEPS = 24
DP = 4


def _docs(tag: str, n: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": f"{tag} {i} " + "x" * rng.randint(lo, hi)} for i in range(n)]


def three_sources(root: Path, **overrides: Any) -> Path:
    """Short web pages, code, and books longer than a row (split), with a schedule change."""
    plan: dict[str, Any] = {
        "batch": {"tokens_per_step": 2048, "max_seq_len": 256, "long_docs": "split"},
        "world": {"dp": DP},
        "balance": {"method": "kk", "cost": {"alpha": 1.0, "beta": 0.05}},
        "mixture": {
            "schedule": [
                {"step": 0, "weights": {"web": 0.6, "code": 0.3, "books": 0.1}},
                {"step": 10, "weights": {"web": 0.2, "code": 0.3, "books": 0.5}},
            ]
        },
        **overrides,
    }
    web = {f"data/web/part-{k}.jsonl": _docs("w", 60, 5, 200, k) for k in range(4)}
    books = {f"data/books/b-{k}.jsonl": _docs("b", 6, 300, 900, 20 + k) for k in range(2)}
    sources = {
        "web": {"files": web},
        "code": {"files": {"data/code/part-0.jsonl": _docs("c", 80, 20, 120, 9)}},
        "books": {"files": books},
    }
    return make_corpus(root, sources, **plan)


def run_dump(plan_path: Path, steps: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A real run's summary and its dump's lines (one per step and rank)."""
    dump = io.StringIO()
    summary = run_plan(load_plan(plan_path), steps, dump=dump, progress=False)
    return summary, [json.loads(line) for line in dump.getvalue().splitlines()]


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    path = three_sources(tmp_path_factory.mktemp("sim"))
    sim = simulate(load_plan(path), STEPS, step_seconds=0.5)
    summary, lines = run_dump(path, STEPS)
    return path, sim, summary, lines


def test_simulate_matches_a_real_run_to_the_sample(both: tuple[Any, ...]) -> None:
    _, sim, _, lines = both
    tokens: dict[str, int] = defaultdict(int)
    samples: dict[str, int] = defaultdict(int)
    for line in lines:
        for s in line["samples"]:
            tokens[s["source"]] += s["tokens"]
            samples[s["source"]] += 1
    assert {n: s["tokens"] for n, s in sim["sources"].items()} == dict(tokens)
    assert {n: s["samples"] for n, s in sim["sources"].items()} == dict(samples)
    total = sum(tokens.values())
    for n, s in sim["sources"].items():
        assert s["share"] == pytest.approx(tokens[n] / total)
    # the schedule changes at step 10: the report cuts the run there
    assert [seg["steps"] for seg in sim["segments"]] == [[0, 10], [10, STEPS]]
    late = sum(s["tokens"] for line in lines if line["step"] >= 10 for s in line["samples"])
    books = sum(
        s["tokens"]
        for line in lines
        if line["step"] >= 10
        for s in line["samples"]
        if s["source"] == "books"
    )
    assert sim["segments"][1]["share"]["books"] == pytest.approx(books / late)


def test_simulate_balance_matches_the_delivered_batches(both: tuple[Any, ...]) -> None:
    path, sim, summary, lines = both
    plan = load_plan(path)
    cost = CostModel.from_spec(plan.balance.cost)
    ranks: dict[int, list[float]] = defaultdict(lambda: [0.0] * DP)
    items: dict[int, list[float]] = defaultdict(list)
    for line in lines:
        c = cost.cost(np.array([s["tokens"] for s in line["samples"]], dtype=np.int64))
        ranks[line["step"]][line["rank"]] = float(c.sum())
        items[line["step"]] += c.tolist()
    ratio = []
    for step in range(STEPS):
        lb = max(sum(items[step]) / DP, max(items[step]))
        ratio.append(max(ranks[step]) / lb)
    b = sim["balance"]
    assert b["max_over_lb"]["mean"] == pytest.approx(float(np.mean(ratio)), rel=0.01)
    packing, docs = summary["baseline_balance_mean"], summary["equal_docs_balance_mean"]
    assert b["per_rank_packing"]["mean"] == pytest.approx(packing, rel=0.01)
    assert b["equal_docs"]["mean"] == pytest.approx(docs, rel=0.01)
    # a plan whose documents reach the row's length balances: the baselines cost more
    assert b["max_over_lb"]["mean"] < b["per_rank_packing"]["mean"] < b["equal_docs"]["mean"]
    assert b["speedup_vs_equal_docs"] > b["speedup_vs_per_rank_packing"] > 1.0


def test_epochs_follow_the_tokens_read(both: tuple[Any, ...]) -> None:
    path, sim, _, _ = both
    # the bytes tokenizer: a document is its UTF-8 bytes and one end-of-document token;
    # the simulation counts to half a shard (web has four, books two, code one)
    for name, shards in (("books", 2), ("code", 1), ("web", 4)):
        texts = [
            json.loads(line)["text"]
            for f in sorted((path.parent / "data" / name).iterdir())
            for line in f.read_text().splitlines()
        ]
        epoch_tokens = sum(len(t.encode()) + 1 for t in texts)
        s = sim["sources"][name]
        exact = s["tokens"] / epoch_tokens
        assert abs(s["epochs"] - exact) <= 0.5 / shards + 0.05, (name, s["epochs"], exact)
    assert sim["sources"]["books"]["epochs"] > 1.0


def test_cores_scale_with_the_step_time(both: tuple[Any, ...]) -> None:
    path, sim, _, _ = both
    for name, s in sim["sources"].items():
        assert s["cpu_s_per_token"] > 0, name
        expect = s["peak_tokens_per_step"] * s["cpu_s_per_token"] / 0.5
        assert s["cores"] == pytest.approx(expect)
    again = simulate(load_plan(path), 3)
    assert again["cores"] is None and again["step_seconds"] is None
    assert all(s["cores"] is None for s in again["sources"].values())


def test_memory_follows_the_read_ahead_budget(tmp_path: Path) -> None:
    one = simulate(load_plan(three_sources(tmp_path / "a")), 2)
    batch = {"tokens_per_step": 2048, "max_seq_len": 256, "long_docs": "split"}
    more = three_sources(tmp_path / "b", batch={**batch, "prefetch_steps": 6})
    plan = load_plan(more)
    ahead = simulate(plan, 2)
    for name in ("web", "code", "books"):
        a, b = one["sources"][name]["memory"], ahead["sources"][name]["memory"]
        assert b["held"] > a["held"], name  # four more steps planned ahead are held
        assert b["text"] == a["text"]
        assert b["held"] >= 4 * token_budget(plan, 1, name)  # 4 bytes a token, and more
        assert b["total"] == b["loaders"] * (b["per_loader"] + b["shadows"] * b["per_shadow"])
    assert ahead["memory_bytes"] == sum(s["memory"]["total"] for s in ahead["sources"].values())


def test_a_simulation_reads_ahead_within_the_budget(tmp_path: Path) -> None:
    # a source far larger than the steps need: its loader reads what the steps take, its
    # read-ahead budget and a few pieces past it (lifted while the planner waits), as a
    # run's loader does, not the source to its end
    big = {f"data/big/part-{k}.jsonl": _docs("g", 4000, 100, 200, k) for k in range(8)}
    path = make_corpus(
        tmp_path,
        {"big": {"files": big}},
        batch={"tokens_per_step": 2048, "max_seq_len": 256, "long_docs": "split"},
        world={"dp": DP},
    )
    plan = load_plan(path)
    sim = simulate(plan, 6)
    s = sim["sources"]["big"]
    source_tokens = sum(len(d["text"].encode()) + 1 for docs in big.values() for d in docs)
    bound = s["tokens"] + token_budget(plan, 1, "big") + 4 * PIECE_BYTES
    assert s["read_tokens"] <= bound < source_tokens / 2


def test_cli_prints_tables_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = three_sources(tmp_path)
    out = tmp_path / "sim.json"
    code = main(["simulate", str(path), "--steps", "4", "--step-seconds", "2", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["steps"] == 4 and data["dp"] == DP
    for name in ("web", "code", "books"):
        assert name in printed
    assert f"{data['balance']['max_over_lb']['mean']:.4f}" in printed
    assert set(data) >= {"sources", "segments", "balance", "planner", "memory_bytes", "cores"}


def test_cli_names_a_json_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = three_sources(tmp_path)
    bad = tmp_path / "missing" / "sim.json"
    assert main(["simulate", str(path), "--steps", "1", "--json", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().err


def test_a_simulation_of_no_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one step"):
        simulate(load_plan(three_sources(tmp_path)), 0)
