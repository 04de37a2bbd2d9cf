"""The state format, and one save/restore check applied to every stateful part.

The parts: a source cursor (over a real SourceLoader), the mixture, the
autoscaler, a client, the planner (through a whole job) and the PyTorch
dataset. Each is cut at every step boundary and rebuilt from its state; the
rest of its stream must be the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_corpus
from roundtrip import Part, check_save_restore
from windows import ArrayWindow

from overlord import Loader, load_plan
from overlord import state as statefmt
from overlord.plan.autoscale import Autoscaler, Budget, SourceProfile
from overlord.plan.select import MixState, select_step
from overlord.roles.cursor import SourceCursor
from overlord.roles.source_loader import SourceLoader
from overlord.run import dump_line
from overlord.sources.catalog import job_files

STEPS = 7


def test_apply_of_a_delta_gives_the_state_it_was_taken_from():
    def source(shard: int, placed: float, target: float) -> dict[str, Any]:
        cursor = {"epoch": 0, "shard_pos": shard, "index": 3, "skip": [[0, shard, 5, 1]]}
        return {"cursor": cursor, "placed": placed, "target": target, "files": [[0, []]]}

    before = {"step": 4, "sources": {"web": source(1, 100.0, 90.5), "code": source(0, 20.0, 30.5)}}
    after = {"step": 5, "sources": {"web": source(2, 164.0, 0.0), "code": source(0, 20.0, 0.0)}}
    weights = {"web": 0.75, "code": 0.25}
    # the targets grow by each weight times the step's tokens, as select_step adds them
    after["sources"]["web"]["target"] = 90.5 + 0.75 * 64
    after["sources"]["code"]["target"] = 30.5 + 0.25 * 64
    change = statefmt.delta(before, after)
    assert change == {"c": {"web": [0, 2, 3, [[0, 2, 5, 1]]]}, "p": {"web": 64}}
    assert statefmt.apply(before, change, lambda step: weights) == after
    assert before["sources"]["web"]["placed"] == 100.0  # apply copies


# ---- the parts --------------------------------------------------------------------------


@pytest.mark.integration
def test_a_source_cursor_resumes_from_its_state(tmp_path):
    plan = load_plan(
        make_corpus(
            tmp_path,
            {"web": {"files": {f"data/web/p{i}.jsonl": 5 + i for i in range(3)}}},
            batch={"tokens_per_step": 128, "max_seq_len": 64, "lookahead": 4},
        )
    )
    files = job_files([("web", ["data/web/*"])], str(plan.base_dir))["web"]

    def make(state: dict[str, Any] | None) -> tuple[SourceCursor, SourceLoader]:
        start = None if state is None else state["cursor"]
        loader = SourceLoader(plan, files, "web", 0, 1, start)
        cursor = SourceCursor(
            "web",
            lambda epoch: len(files.at(epoch)),
            lambda k: loader.metadata(5.0),
            lambda: [((0, 0), 0, 1)],
            start,
        )
        return cursor, loader

    def advance(part: tuple[SourceCursor, SourceLoader]) -> list[Any]:
        cursor, _ = part
        cursor.peek(2)
        got = cursor.take([0, 2])  # item 1 stays pending: the state holds a skip run
        return [[list(k) for k in got["key"]], got["tokens"]]

    outputs = check_save_restore(
        Part(make, advance, lambda p: {"cursor": p[0].state()}, lambda p: p[1].close()), 12
    )
    assert {k[0] for keys, _ in outputs for k in keys} == {0, 1}  # it crossed an epoch


def test_the_mixture_resumes_from_its_state():
    lengths = [np.random.default_rng(s).integers(1, 300, 500) for s in range(3)]

    def make(state: dict[str, Any] | None) -> dict[str, Any]:
        part = {"mix": MixState.zeros(3), "windows": [ArrayWindow(x) for x in lengths], "step": 0}
        if state is not None:
            part["mix"] = MixState(np.array(state["target"]), np.array(state["placed"]))
            for w, (read, pending) in zip(part["windows"], state["windows"]):
                w.read, w.pending = read, list(pending)
            part["step"] = state["step"]
        return part

    def advance(part: dict[str, Any]) -> list[Any]:
        f = part["step"] / 10
        weights = np.array([0.6 - 0.4 * f, 0.3, 0.1 + 0.4 * f])
        sel = select_step(part["windows"], weights, part["mix"], 4, 512, 8)
        for s, w in enumerate(part["windows"]):
            w.take([i for src, i in zip(sel.source, sel.pending_index) if src == s])
        part["step"] += 1
        return [sel.source, sel.tokens, sel.ref_row]

    def save(part: dict[str, Any]) -> dict[str, Any]:
        mix = part["mix"]
        return {
            "target": mix.target.tolist(),
            "placed": mix.placed.tolist(),
            "windows": [[w.read, w.pending] for w in part["windows"]],
            "step": part["step"],
        }

    check_save_restore(Part(make, advance, save), 10)


def test_the_autoscaler_resumes_from_its_state():
    """Its hysteresis timers carry across a restore: a scale-down waits out its cooldown."""
    sizes = {"web": (3, 2), "code": (2, 1)}

    def make(state: dict[str, Any] | None) -> dict[str, Any]:
        scaler = Autoscaler(Budget(cpus=8), cooldown_steps=4)
        if state is not None:
            scaler.load_state_dict(state["policy"])
        step = 0 if state is None else state["step"]
        return {"scaler": scaler, "step": step, "sizes": dict(state["sizes"] if state else sizes)}

    def advance(part: dict[str, Any]) -> list[Any]:
        step = part["step"]
        demand = np.array([[0.9 - 0.08 * step, 0.1 + 0.08 * step]])  # web cools, code heats
        profiles = [
            SourceProfile(n, 2e-6, 1e8, loaders=lo, threads=t)
            for n, (lo, t) in part["sizes"].items()
        ]
        d = part["scaler"].decide(step, profiles, demand, 1e6, 1.0)
        part["sizes"] = {s.name: (s.loaders, s.threads) for s in d.sources}
        part["step"] += 1
        return [[s.name, s.loaders, s.threads, s.reason] for s in d.sources]

    def save(part: dict[str, Any]) -> dict[str, Any]:
        policy = part["scaler"].state_dict()
        return {"policy": policy, "step": part["step"], "sizes": part["sizes"]}

    outputs = check_save_restore(Part(make, advance, save), 10)
    assert any("cooldown" in reason or "below" in reason for o in outputs for *_, reason in o)


@pytest.fixture(scope="module")
def job_plan(tmp_path_factory) -> Path:
    return make_corpus(
        tmp_path_factory.mktemp("state"),
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 9 for i in range(3)}, "loaders": 2},
            "code": {"files": {"data/code/p0.jsonl": 14}},
        },
        batch={"tokens_per_step": 256, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": 1},
    )


@pytest.mark.integration
def test_a_client_resumes_from_its_state(job_plan):
    def make(state: dict[str, Any] | None) -> tuple[Loader, Any]:
        loader = Loader(load_plan(job_plan), state=state)
        return loader, loader.client(0)

    check_save_restore(
        Part(
            make,
            lambda p: dump_line(next(p[1])),
            lambda p: p[1].state_dict(),
            lambda p: p[0].close(),
        ),
        STEPS,
    )


@pytest.mark.integration
def test_the_planner_resumes_from_its_state_on_any_dp_size(job_plan):
    plan = load_plan(job_plan).with_dp(2)

    def make(state: dict[str, Any] | None) -> tuple[Loader, list[Any]]:
        loader = Loader(plan, state=state)
        return loader, [loader.client(r) for r in range(2)]

    check_save_restore(
        Part(
            make,
            lambda p: [dump_line(next(c)) for c in p[1]],
            lambda p: p[0].state_dict(),
            lambda p: p[0].close(),
        ),
        STEPS,
    )


@pytest.mark.integration
def test_the_pytorch_dataset_resumes_from_its_state(job_plan):
    pytest.importorskip("torch")
    from overlord.torch import OverlordIterableDataset

    def make(state: dict[str, Any] | None) -> tuple[Any, Any]:
        ds = OverlordIterableDataset.from_plan(job_plan, state=state)
        return ds, iter(ds)

    check_save_restore(
        Part(
            make,
            lambda p: next(p[1])["input_ids"].tolist(),
            lambda p: p[0].state_dict(),
            lambda p: p[0].close(),
        ),
        STEPS,
    )
