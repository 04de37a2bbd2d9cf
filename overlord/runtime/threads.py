"""Daemon threads whose work lands in Futures: they never hold up the process's exit.

A read that never returns (a hung network mount) or a build still waiting for
data when a job closes must not keep the trainer's process alive after it is
told to stop, as an executor's threads would (they are joined at exit).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


def _settle(job: _Job) -> None:
    """Run a job into its Future, unless it was cancelled first."""
    fut, fn, args = job
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as e:
        fut.set_exception(e)


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``fn(*args)`` on a daemon thread of its own; its Future."""
    fut: Future[Any] = Future()
    threading.Thread(
        target=_settle, args=((fut, fn, args),), name="overlord-read", daemon=True
    ).start()
    return fut


class Workers:
    """Daemon threads, started as needed and kept, that run each job at once into a Future.

    A job never waits behind another: with no idle thread a new one starts,
    so there are as many threads as jobs ever ran at once (a loader tokenizes
    at most its ``threads`` pieces at once), and a job after the first few
    finds a thread waiting on the queue instead of paying for a new one.
    """

    def __init__(self, name: str):
        self.name = name
        self._todo: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads done with their job and not handed another one yet
        self._count = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on an idle thread, or on a new one; its Future."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self._count += 1
                threading.Thread(target=self._run, name=self.name, daemon=True).start()
        self._todo.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (job := self._todo.get()) is not None:
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                result, error = None, None
            else:
                try:
                    result, error = fn(*args), None
                except BaseException as e:
                    result, error = None, e
            with self._lock:  # idle before the Future is done: a job its caller submits next
                self._idle += 1  # finds this thread, not a new one
            if fut.cancelled():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    def shutdown(self) -> None:
        """End every thread once the jobs submitted before are done."""
        with self._lock:
            count, self._count, self._idle = self._count, 0, 0
        for _ in range(count):
            self._todo.put(None)


class Builder:
    """One daemon thread that runs submitted jobs in order, each into a Future."""

    def __init__(self, name: str):
        self._todo: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` after the jobs before it; its Future."""
        fut: Future[Any] = Future()
        self._todo.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (job := self._todo.get()) is not None:
            _settle(job)

    def shutdown(self) -> None:
        """Run nothing more: queued jobs are cancelled; the one under way ends on its own."""
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._todo.put(None)
