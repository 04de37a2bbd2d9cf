"""A Loader's default runtime: the roles in a data process, and what the trainer can ask of them.

A trainer that leaves ``runtime`` unset takes its batches from a data process
(``overlord.dist.data_process``): no loader thread runs in its process. Every
check compares with the inline runtime in the same test: the same batches, the
same plans, the same figures, and a report sent before a question is in its answer.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import make_corpus
from overlord import Loader, LoaderError, load_plan
from overlord.dist.data_process import ProcessStream
from overlord.dist.data_server import steps_ahead
from overlord.ops.run import dump_line
from overlord.streams import resolved_runtime

pytestmark = pytest.mark.integration

STEPS = 6


@pytest.fixture
def users_default(monkeypatch) -> None:
    monkeypatch.delenv("OVERLORD_RUNTIME", raising=False)  # the tests' own choice, not a user's


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    return make_corpus(
        tmp_path_factory.mktemp("default"),
        {
            "web": {"files": {f"data/web/p{i}.jsonl": 30 for i in range(3)}, "loaders": 2},
            "code": {"files": {"data/code/p0.parquet": 40}, "text_field": "content"},
        },
        batch={"tokens_per_step": 1024, "max_seq_len": 64, "prefetch_steps": 1},
        world={"dp": 2},
    )


def _lines(loader: Loader, report: bool = False) -> list[str]:
    clients = [loader.client(r) for r in range(loader.plan.world.dp)]
    lines = []
    for _ in range(STEPS):
        for c in clients:
            b = next(c)
            arrays = {k: v.tobytes().hex() for k, v in b.arrays().items()}
            lines.append(dump_line(b) + json.dumps(arrays, sort_keys=True))
            if report:  # a stand-in trainer: its seconds grow with the rank's tokens
                c.report(b.step, seconds=1e-4 * b.num_tokens + 0.01 * b.rank)
    return lines


def _overlord_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("overlord")}


@pytest.mark.usefixtures("users_default")
def test_the_default_serves_the_inline_batches_from_a_data_process_with_no_thread_here(
    plan_path,
):
    with Loader(plan_path, runtime="inline") as inline:
        want = _lines(inline)
    before = _overlord_threads()
    with Loader(plan_path) as loader:
        got = _lines(loader)
        assert all(isinstance(s, ProcessStream) for s in loader._streams.values())  # noqa: SLF001
        assert not _overlord_threads() - before  # no reader, scheduler or builder thread here
    assert got == want


@pytest.mark.usefixtures("users_default")
def test_the_trainer_asks_the_data_process_what_it_asks_the_inline_runtime(plan_path):
    answers: dict[str, dict[str, Any]] = {}
    for runtime in ("inline", None):
        with Loader(plan_path, runtime=runtime) as loader:
            _lines(loader, report=True)  # and asked at once: no flush, no sleep
            stats, monitor = loader.stats(), loader.monitor()
            added = loader.quarantine(ids=["data/web/p0.jsonl:3"])
            answers[str(runtime)] = {
                "history": [  # the steps trained: each runtime may have planned more
                    (h["step"], h["tokens"], h["samples"])
                    for h in stats["history"]
                    if h["step"] < STEPS
                ],
                "served": monitor["steps"],
                "feedback": loader.feedback(STEPS - 1),
                "quarantine": json.loads(json.dumps(added)),
                "url": loader.metrics_url,
            }
    inline, default = answers["inline"], answers["None"]
    assert default["history"] == inline["history"]
    assert [h[0] for h in default["history"]] == list(range(STEPS))
    # the data process counts a step when its server takes it, ahead of the trainers
    ahead = steps_ahead(load_plan(plan_path).batch.prefetch_steps)
    assert inline["served"] == STEPS and STEPS <= default["served"] <= STEPS + ahead
    # the last step's reports, sent just before the question, are in its answer
    fed = default["feedback"]
    assert fed is not None and sorted(fed) == [0, 1]
    for r, want in inline["feedback"].items():  # the fitted scale: last digits of a sum apart
        assert fed[r]["seconds"] == want["seconds"] is not None
        assert fed[r]["predicted"] == want["predicted"]
        assert fed[r]["predicted_seconds"] == pytest.approx(want["predicted_seconds"], rel=1e-9)
    # in force from the first step not planned yet: the data process plans further ahead
    got, want = dict(default["quarantine"]), dict(inline["quarantine"])
    assert want["from_step"] <= got.pop("from_step") <= want.pop("from_step") + ahead
    assert got == want and got["added"] == 1
    assert default["url"] is None  # the plan serves no metrics


@pytest.mark.usefixtures("users_default")
def test_what_only_the_roles_own_process_can_give_is_refused_with_the_way_to_it(plan_path):
    with Loader(plan_path) as loader:
        with pytest.raises(LoaderError, match="runtime='inline'"):
            loader.slots()
        with pytest.raises(LoaderError, match="build_batches=False"):
            loader.dry_run(2)
        assert next(loader.client(0)).step == 0  # the stream still serves after a refusal
    with Loader(plan_path, build_batches=False) as planning:  # nothing to serve: inline
        assert len(planning.dry_run(2)) == 2


def test_the_default_can_be_named_for_every_loader_of_a_process(monkeypatch, plan_path):
    monkeypatch.setenv("OVERLORD_RUNTIME", "inline")
    assert resolved_runtime(None) == "inline"
    monkeypatch.delenv("OVERLORD_RUNTIME")
    assert resolved_runtime(None) == "process"
    assert resolved_runtime(None, build_batches=False) == "inline"  # nothing to serve
    monkeypatch.setenv("OVERLORD_RUNTIME", "processes")
    with pytest.raises(ValueError, match="OVERLORD_RUNTIME='processes' is not a runtime"):
        Loader(plan_path)


@pytest.mark.usefixtures("users_default")
def test_a_plan_round_trips_to_the_data_process_with_its_defaults(tmp_path):
    """A chat source's messages field is chosen by default: the data process chooses it too."""
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(40)
    ]
    pytest.importorskip("jinja2")
    (tmp_path / "turns.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}</s>{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    plan = load_plan(
        make_corpus(
            tmp_path,
            {"chat": {"files": {"data/chat/c.jsonl": rows}, "format": "chat"}},
            tokenizer={"kind": "bytes", "chat_template": "turns.jinja"},
            batch={"tokens_per_step": 256, "max_seq_len": 64},
            world={"dp": 1},
        )
    )
    with Loader(plan, runtime="inline") as inline:
        want = next(inline.client(0))
    with Loader(plan) as loader:
        got = next(loader.client(0))
    assert np.array_equal(got.labels, want.labels) and (got.labels != -100).any()
