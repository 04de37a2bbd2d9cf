"""Daemon threads whose work lands in Futures: they never hold up the process's exit.

A read that never returns (a hung network mount) or a build still waiting for
data when a job closes must not keep the trainer's process alive after it is
told to stop, as an executor's threads would (they are joined at exit).
"""

from __future__ import annotations

import ctypes
import queue
import sys
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


M_ARENA_MAX = -8  # glibc's mallopt parameter: how many malloc arenas the process may have
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: blocks from this size are mapped apart
LOADER_ARENAS = 2
LOADER_MMAP_BYTES = 128 << 10  # glibc's default, held there (glibc raises it as blocks are freed)


def in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (Ray imported, and this worker holds an actor)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().get_actor_id() is not None


def lean_allocators(arenas: int = LOADER_ARENAS, host: bool = False) -> bool:
    """In a process hosting loaders: few glibc arenas, Arrow on the system allocator.

    A loader runs two threads per source and tokenizes each piece on a thread of its
    own. glibc gives threads arenas of their own (up to 8 per core) and Arrow's default
    pool (mimalloc) heaps of their own, each keeping what was freed in it: a process
    serving 32 sources at small windows grew by 519 MiB with both, 445 MiB with the
    arenas capped and 92 MiB with Arrow on the system allocator as well (2 cores;
    ``benchmarks/memory.py``, README *Loader memory*). Blocks of 128 KiB and more (a
    window's pieces) are mapped apart and handed back when freed: glibc would otherwise
    raise that threshold to the size of each mapped block freed, up to 32 MiB, and keep
    freed pieces in its heap. Returns whether it changed them: in a Ray actor's
    process, or where ``host`` says this process hosts a node's loaders (node mode's
    rank 0, ``overlord.dist.node``: the node's only loader process); not in a plain
    embedded Loader (the user's process, whose allocators are the user's business).
    The arena cap only with glibc.
    """
    if not (host or in_ray_actor()):
        return False
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, arenas)
        libc.mallopt(M_MMAP_THRESHOLD, LOADER_MMAP_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): no per-thread arenas to cap
    return True
