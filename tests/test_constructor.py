"""DataConstructor: batches built ahead, off the trainer's thread, without changing the stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from overlord import Loader, LoaderError, load_plan
from overlord.ops.run import dump_line

pytestmark = pytest.mark.integration


def recording(calls: set[str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.add(threading.current_thread().name)
        return fn(*args, **kwargs)

    return wrapped


def test_the_embedded_runtime_plans_and_packs_off_the_trainers_thread(job_plan, monkeypatch):
    import overlord.plan.step as step_module
    import overlord.roles.constructor as constructor_module

    planned: set[str] = set()
    packed: set[str] = set()
    monkeypatch.setattr(step_module, "select_items", recording(planned, step_module.select_items))
    monkeypatch.setattr(constructor_module, "pack", recording(packed, constructor_module.pack))
    plan = load_plan(job_plan).with_dp(2)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(2)]
        got = [dump_line(next(c)) for _ in range(8) for c in clients]
    trainer = threading.current_thread().name
    assert len(got) == 16 and planned and packed  # it did plan and pack every step
    assert trainer not in planned and trainer not in packed


def test_a_rank_far_ahead_is_still_an_error_not_a_hang_when_building_ahead(job_plan):
    plan = load_plan(job_plan).with_dp(2)
    with Loader(plan) as loader:
        ahead = loader.client(0)
        with pytest.raises(LoaderError, match="ranks may run at most"):
            for _ in range(plan.batch.prefetch_steps + 3):
                next(ahead)
