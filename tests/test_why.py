"""``overlord why``: a step's ranks, predicted and measured, and what made the slowest slow.

A synthetic trainer reports ``A * S1 + B * S2`` seconds per rank, and on one
step one rank reports far more (a straggler the model cannot foresee): from a
checkpoint folder's kept journal, from a run folder of it, and from a live job
on Ray, ``why`` must name that rank by its measured time, list every rank's
prediction and report, and put the rank's longest documents first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord import Loader, load_plan
from overlord.ops.cli import main
from overlord.ops.run import dump_line

DP, STEPS, SLOW_STEP, SLOW_RANK = 2, 8, 5, 1
A, B = 1.0, 0.01


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("why")
    return make_corpus(
        root,
        {"web": {"files": {"data/web/a.jsonl": 60}}, "code": {"files": {"data/code/a.jsonl": 60}}},
        batch={"tokens_per_step": 512, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": DP},
        balance={"cost": {"alpha": A, "beta": B}},
    )


def seconds_of(batch: Any) -> float:
    t = [s.tokens for s in batch.samples]
    slow = 3.0 if (batch.step, batch.rank) == (SLOW_STEP, SLOW_RANK) else 1.0
    return slow * (A * sum(t) + B * sum(x * x for x in t))


@pytest.fixture(scope="module")
def ran(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A run that keeps its journal in a checkpoint folder, every rank reporting."""
    folder = tmp_path_factory.mktemp("ckpt")
    lines = []
    with Loader(load_plan(corpus), journal_dir=folder / "journal") as loader:
        clients = [loader.client(r) for r in range(DP)]
        for _ in range(STEPS):
            batches = [next(c) for c in clients]
            lines += [json.loads(dump_line(b)) for b in batches]
            for c, b in zip(clients, batches):
                c.report(b.step, seconds_of(b))
            clients[0].flush()
    return folder, lines


def why(*args: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["why", *args]) == 0
    return capsys.readouterr().out


def test_why_names_the_straggler_by_its_measured_time(ran, capsys, tmp_path) -> None:
    folder, lines = ran
    out = why(str(SLOW_STEP), str(folder), "--json", str(tmp_path / "w.json"), capsys=capsys)
    assert f"step {SLOW_STEP}: {DP} ranks" in out
    assert f"slowest: rank {SLOW_RANK}, measured" in out
    got = json.loads((tmp_path / "w.json").read_text())
    assert got["by"] == "measured" and got["slowest"] == SLOW_RANK
    step = {d["rank"]: d for d in lines if d["step"] == SLOW_STEP}
    for r in got["ranks"]:  # every rank: the cost it was balanced with, its report
        assert r["predicted"] == pytest.approx(step[r["rank"]]["cost"])
        tokens = [s["tokens"] for s in step[r["rank"]]["samples"]]
        want = (3.0 if r["rank"] == SLOW_RANK else 1.0) * (
            A * sum(tokens) + B * sum(x * x for x in tokens)
        )
        assert r["seconds"] == pytest.approx(want)
        assert r["documents"] == len(tokens)
    # the rank's documents, costliest first: the longest, with their share of its cost
    samples = step[SLOW_RANK]["samples"]
    longest = max(s["tokens"] for s in samples)
    first = got["culprits"][0]
    assert first["tokens"] == longest
    assert first["id"] in {s["id"] for s in samples if s["tokens"] == longest}
    total = sum(A * s["tokens"] + B * s["tokens"] ** 2 for s in samples)
    assert first["share"] == pytest.approx((A * longest + B * longest**2) / total)
    assert sum(got["sources"].values()) == pytest.approx(1.0)
    assert re.search(rf"^\s+{SLOW_RANK}\s.*<- slowest$", out, re.M)


def test_why_reads_the_step_the_other_way_round_and_from_a_run_folder(ran, capsys) -> None:
    folder, _ = ran
    run = next((folder / "journal").glob("run-*"))
    assert f"slowest: rank {SLOW_RANK}, measured" in why(str(folder), str(SLOW_STEP),
                                                         capsys=capsys)  # fmt: skip
    assert f"slowest: rank {SLOW_RANK}, measured" in why(str(SLOW_STEP), str(run), capsys=capsys)


def test_without_reports_why_falls_back_to_the_predicted_cost(corpus, tmp_path, capsys) -> None:
    folder = tmp_path / "ckpt"
    with Loader(load_plan(corpus), journal_dir=folder / "journal") as loader:
        clients = [loader.client(r) for r in range(DP)]
        batches = [[next(c) for c in clients] for _ in range(4)]
    out = why("2", str(folder), capsys=capsys)
    costs = {b.rank: b.cost for b in batches[2]}
    assert f"slowest: rank {max(costs, key=costs.__getitem__)} by predicted cost" in out
    assert "no step times reported" in out


def test_a_step_outside_the_run_is_an_error_naming_what_it_holds(ran, capsys) -> None:
    folder, _ = ran
    assert main(["why", "999", str(folder)]) == 1
    assert f"step 999 is not in {folder}'s range" in capsys.readouterr().err
    assert main(["why", "five", str(folder)]) == 1
    assert "step 'five': not a number" in capsys.readouterr().err


@pytest.mark.ray
def test_why_on_a_live_job_reads_its_planners_reports(ray_session, corpus, capsys) -> None:
    from overlord import connect

    with Loader(load_plan(corpus), runtime="ray", job="t-why"):
        clients = [connect("t-why", rank=r, stop_step=STEPS) for r in range(DP)]
        for _ in range(STEPS):
            batches = [next(c) for c in clients]
            for c, b in zip(clients, batches):
                c.report(b.step, seconds_of(b))
            for c in clients:
                c.flush()
        address = ray_session.get_runtime_context().gcs_address
        out = why(str(SLOW_STEP), "t-why", "--address", address, capsys=capsys)
    assert f"slowest: rank {SLOW_RANK}, measured" in out


def test_the_run_report_plots_predicted_against_measured_when_ranks_report(
    corpus: Path, tmp_path: Path
) -> None:
    from overlord.ops.run import run_plan

    plan = load_plan(corpus)
    summary = run_plan(plan, 6, progress=False, report=str(tmp_path / "r"), train=seconds_of)
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## Predicted against measured step time" in text
    assert "6 steps reported by every rank" in text
    assert (tmp_path / "r" / "measured.png").stat().st_size > 0
    assert "report_error" not in summary
    run_plan(plan, 6, progress=False, report=str(tmp_path / "plain"))  # nobody reports
    assert "Predicted against" not in (tmp_path / "plain" / "report.md").read_text()
    assert not (tmp_path / "plain" / "measured.png").exists()


def test_why_gives_the_images_and_the_encoders_share_of_an_image_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from overlord import validate_plan
    from overlord.ops.vision_data import image_text_tar, random_images

    image_text_tar(tmp_path / "a.tar", random_images(12, seed=8, sizes=(20, 300)))
    plan = validate_plan(
        {
            "seed": 5,
            "sources": [{"name": "w", "path": "a.tar", "format": "webdataset",
                         "text_field": "txt"}],  # fmt: skip
            "batch": {"tokens_per_step": 2048, "max_seq_len": 1024},
            "world": {"dp": 2},
            "vision": {},
            "balance": {"cost": {"alpha": 1.0, "beta": 0.001, "patch_alpha": 2.0,
                                 "patch_beta": 0.01}},  # fmt: skip
        },
        base_dir=tmp_path,
    )
    folder = tmp_path / "ckpt"
    with Loader(plan, journal_dir=folder / "journal") as loader:
        clients = [loader.client(r) for r in range(2)]
        batches = [[next(c) for c in clients] for _ in range(2)]
    out = why("1", str(folder), "--json", str(tmp_path / "w.json"), capsys=capsys)
    got = json.loads((tmp_path / "w.json").read_text())
    slow = next(b for b in batches[1] if b.rank == got["slowest"])
    grid = np.asarray(slow.image_grid)
    assert got["images"] == len(grid) > 0
    assert got["patches"] == int((grid[:, 0] * grid[:, 1]).sum())
    assert got["encoder_share"] == pytest.approx(slow.cost_encoder / slow.cost)
    assert f"its images: {got['images']} of {got['patches']} patches" in out
