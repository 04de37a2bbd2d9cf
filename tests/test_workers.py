"""``overlord.runtime.threads.Workers``: jobs at once, on threads that are kept."""

from __future__ import annotations

import threading

import pytest

from overlord.runtime import Workers

HANG_GUARD_S = 20.0  # only a hang takes this long


def test_jobs_run_at_once_and_threads_are_reused():
    workers = Workers("test-workers")
    go = threading.Event()
    started = threading.Barrier(4, timeout=HANG_GUARD_S)

    def job(k: int) -> tuple[int, str]:
        started.wait()  # every job is running before any ends: none waits behind another
        assert go.wait(HANG_GUARD_S)
        return k, threading.current_thread().name

    first = [workers.submit(job, k) for k in range(3)]
    started.wait()
    go.set()
    got = [f.result(HANG_GUARD_S) for f in first]
    assert [k for k, _ in got] == [0, 1, 2]
    before = {t for t in threading.enumerate() if t.name == "test-workers"}
    assert len(before) == 3
    # done jobs leave their threads idle: the next ones run on them, no thread is started
    again = [workers.submit(lambda k=k: (k, threading.current_thread()), k) for k in range(3)]
    ran_on = {t for _, t in (f.result(HANG_GUARD_S) for f in again)}
    assert ran_on <= before
    assert {t for t in threading.enumerate() if t.name == "test-workers"} == before
    workers.shutdown()
    for t in before:
        t.join(HANG_GUARD_S)
        assert not t.is_alive()


def test_a_job_that_fails_fails_its_future_only():
    workers = Workers("test-workers-fail")

    def boom() -> None:
        raise ValueError("bad piece")

    with pytest.raises(ValueError, match="bad piece"):
        workers.submit(boom).result(HANG_GUARD_S)
    assert workers.submit(lambda: 7).result(HANG_GUARD_S) == 7
    workers.shutdown()
