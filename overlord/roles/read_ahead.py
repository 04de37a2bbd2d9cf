"""A SourceLoader's read-ahead: the window thread, the piece scheduler, and the rule they obey.

Two daemon threads per loader (a :class:`Reader`):

- the *window thread* reads the loader's shards a window at a time
  (:func:`overlord.sources.shard.shard_windows`) and hands each to the
  scheduler, holding at most one window read ahead;
- the *piece scheduler* cuts the window it was handed into pieces, starts
  each piece's tokenizing when the rule lets it, and publishes what is done
  to the loader in order: a window's counts, its pieces' items, a shard's
  end. With ``loading.threads: 1`` (the default) it tokenizes each piece
  itself; with more, on the loader's worker threads (kept and reused:
  :class:`~overlord.runtime.threads.Workers`).

When a piece may start and when the next window may be read is decided by
:class:`ReadAhead`, a pure policy over plain numbers (what is held, what is
in flight, what the planner took, who waits), in the manner of Ray Data's
backpressure policies (``can_add_input(op) -> bool``): it can be tested
without a thread, and the threads only ask it.

Everything here is guarded by the loader's lock (a ``threading.Condition``,
shared with the :class:`~overlord.roles.source_loader.SourceLoader`); the
loader's side is reached through an :class:`Outlet` of three callables.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, NamedTuple

import pyarrow as pa

from overlord.plan.spec import Plan, SourceSpec
from overlord.roles.held import Position
from overlord.runtime import Workers
from overlord.sources.catalog import SourceFiles
from overlord.sources.record_parts import Part, cut_part, part_tokens, record_parts
from overlord.sources.shard import ShardIO, ShardItems, cut_items, shard_file, shard_windows
from overlord.sources.tokenizers import Tokenizer
from overlord.sources.window import Window

RAMP = 32  # a new loader reads 1/RAMP of its budget ahead before the planner asks for more
CLOSE_WAIT_S = 10.0  # longest wait for reads in flight when a loader closes
LEAD_SHARE = 0.5  # a primary reads its next window once this share of the one being cut is left
# the longest a thread of the reader sleeps without a wake-up (it looks again, e.g. at close)
POLL_S = 0.5

Tokenized = tuple[ShardItems, float]  # a tokenized piece's items, and the CPU seconds it took


def _release(window: Window, lo: int, hi: int) -> None:
    """Let go of a piece's text; once all of a window's is gone, Arrow hands its pages back."""
    window.release(lo, hi)
    if window.released:
        pa.default_memory_pool().release_unused()


# ---- the rule ------------------------------------------------------------------------------


class LoaderSide(NamedTuple):
    """What the rule reads of the loader's side, as plain numbers (taken under the lock)."""

    held: int  # tokens of the items published and not released
    served: int  # tokens of the metadata the planner took: the ramp grows with it
    asked: int  # callers waiting for an item not published yet: they lift the budget
    primary: bool  # it serves metadata (a standby, a shadow not promoted, does not)
    tokens_per_byte: float  # measured on the pieces cut so far: a piece's estimate


@dataclass(frozen=True)
class ReadAhead:
    """When a loader may start tokenizing a piece, and when it may read the next window.

    ``budget`` is the loader's share of its source's read-ahead in tokens
    (:func:`overlord.plan.budget.token_budget`), ``threads`` how many pieces
    it tokenizes at once. The rules:

    - **Threads.** At most ``threads`` pieces are tokenized at once.
    - **Budget.** The tokens held, those in flight and the piece's estimate
      stay within the :meth:`allowance`: the budget, or less while the loader
      is new. A new loader reads ahead 1/32 of its budget, or twice the
      tokens the planner took from it if more, so that at start-up the
      pieces the first steps need are not slowed by every loader filling
      its whole read-ahead at once.
    - **Lifts.** A caller waiting for an item not published yet (the planner
      in ``metadata``, a constructor in ``take``) lets one piece at a time
      past the budget, so the planner never waits on a loader full of items
      it planned but has not released. A loader that holds nothing and has
      nothing in flight always starts one piece: a piece larger than the
      whole budget must still be read.
    - **Windows.** Besides the budget a loader holds what is left of the
      window being cut (a piece's text goes once it is cut) and at most one
      window ahead, read once the window being cut started on its last half
      (a standby's: once all of it started, its windows held compressed):
      a loader holds about one window of text, a standby half of one.

    >>> rule = ReadAhead(budget=3200, threads=2)
    >>> rule.allowance(served=0), rule.allowance(served=400), rule.allowance(served=10_000)
    (100, 800, 3200)
    >>> rule.may_start(held=0, in_flight=0, estimate=5000, served=0, asked=0, pieces=0)
    True
    >>> rule.holds_back(held=90, in_flight=0, estimate=20, served=0, asked=0, pieces=0)
    'budget'
    >>> rule.may_read_window(waiting=0, left_bytes=40, window_bytes=100, primary=True)
    True
    """

    budget: int
    threads: int

    def allowance(self, served: int) -> int:
        """Tokens it may hold and have in flight, having served ``served`` to the planner."""
        return min(self.budget, max(self.budget // RAMP, 2 * served))

    def holds_back(
        self, *, held: int, in_flight: int, estimate: int, served: int, asked: int, pieces: int
    ) -> Literal["threads", "budget"] | None:
        """What keeps a piece of ``estimate`` tokens from starting now; None: nothing.

        ``held`` and ``in_flight`` are tokens (published and held; estimated of
        the ``pieces`` being tokenized), ``served`` the tokens the planner took,
        ``asked`` the callers waiting for an item not published yet.
        """
        if pieces >= self.threads:
            return "threads"
        if held + in_flight + estimate > self.allowance(served) and not (
            (asked and not pieces) or (not held and not in_flight)
        ):
            return "budget"
        return None

    def may_start(
        self, *, held: int, in_flight: int, estimate: int, served: int, asked: int, pieces: int
    ) -> bool:
        """Whether a piece of ``estimate`` tokens may start now (see :meth:`holds_back`)."""
        reason = self.holds_back(
            held=held,
            in_flight=in_flight,
            estimate=estimate,
            served=served,
            asked=asked,
            pieces=pieces,
        )
        return reason is None

    def may_read_window(
        self, *, waiting: int, left_bytes: int, window_bytes: int, primary: bool
    ) -> bool:
        """Whether the window thread may read the next window now.

        ``waiting`` windows were read and wait to be cut; of the window being
        cut (``window_bytes``; 0 for none), ``left_bytes`` are in pieces not
        started yet.
        """
        if waiting:
            return False
        return left_bytes <= (LEAD_SHARE if primary else 0.0) * window_bytes


# ---- the threads ---------------------------------------------------------------------------


@dataclass
class Task:
    """What the reader publishes next, in order: a window's counts, a piece, or a shard's end."""

    at: Position
    file_index: int
    window: Window | None = None  # counts (no piece) or a piece of it
    lo: int = 0
    hi: int = 0
    piece: Future[Tokenized] | None = None
    estimate: int = 0  # tokens the piece is expected to hold while it is tokenized
    end: bool = False
    chunks: tuple[int, int] | None = None  # a part of a long record: its chunks (record_parts)
    whole: tuple[int, int] | None = None  # a piece's last part: the piece, let go once published
    # a piece the scheduler cuts itself, once it let go of the lock (one piece at a time)
    here: tuple[Window, int, int, tuple[int, int] | None] | None = None

    def ready(self) -> bool:
        """Whether it can be published: a piece's tokenizing is done (or there is none)."""
        return self.piece is None or self.piece.done()


@dataclass
class Cutting:
    """The window the scheduler cuts now, and its pieces not started yet (in order)."""

    window: Window
    left: list[tuple[int, int]]  # consumed as pieces start
    parts: list[Part] | None = None  # left[0]'s parts not started (None: not looked at yet)

    def left_bytes(self) -> int:
        """Bytes of the records in the pieces not started yet."""
        if not self.left:
            return 0
        return self.window.text_bytes(self.left[0][0], len(self.window))


@dataclass(frozen=True)
class Outlet:
    """The loader's side of a :class:`Reader`; each is called with the lock held."""

    state: Callable[[], LoaderSide]  # what the rule reads of the loader
    backlogged: Callable[[], bool]  # its metadata queue is full: publish nothing yet
    publish: Callable[[Task, Tokenized | None], None]  # make a task's items visible


@dataclass
class ReadView:
    """What a reader holds and does at one moment (:meth:`Reader.view`)."""

    cutting: Window | None  # the window being cut
    left: list[tuple[int, int]]  # its pieces not started
    ahead: list[Window]  # windows read, waiting to be cut
    reads_in_flight: int  # pieces being tokenized
    waits_on: str | None  # what holds the scheduler back: "budget" or "queue"
    window_thread_waits: bool  # the window thread waits (for room, a shard, or a boundary)

    @property
    def windows(self) -> list[Window]:
        """Every window it holds: the one being cut, then those ahead."""
        return ([self.cutting] if self.cutting is not None else []) + self.ahead

    @property
    def settled(self) -> bool:
        """Held back by its budget alone: nothing moves until an item is released or asked for."""
        return self.waits_on == "budget" and not self.reads_in_flight and self.window_thread_waits


class Reader:
    """A loader's two threads: its shards read a window at a time, tokenized a piece at a time.

    ``shards`` are the loader's shards in order, from shard ``start`` on;
    ``policy`` is its :class:`ReadAhead` rule; ``lock`` is the loader's. The
    threads run from :meth:`start` until :meth:`stop`. A read that fails is
    published in order, after what was read before it, and kept in
    :attr:`error`.
    """

    def __init__(
        self,
        plan: Plan,
        spec: SourceSpec,
        files: SourceFiles,
        tokenizer: Tokenizer,
        start: Position,
        shards: Iterator[Position],
        lock: threading.Condition,
        policy: ReadAhead,
        outlet: Outlet,
        name: str,
    ):
        self.plan = plan
        self.spec = spec
        self.files = files
        self.tokenizer = tokenizer
        self.lock = lock
        # the window thread waits on a condition of its own (on the same lock), woken only by
        # what lets it read on: not by every release, take and publication of the loader
        self.window_turn = threading.Condition(lock)  # type: ignore[arg-type]  # a lock too
        self.policy = policy
        self.outlet = outlet
        self.cache = ShardIO(plan.loading.retries)  # line indexes (every epoch), retries
        self.windows: deque[Window | Task | BaseException] = deque()  # read, not cut yet
        self.cutting: Cutting | None = None  # the window being cut
        self.pending: deque[Task] = deque()  # in publishing order
        self.in_flight = 0  # estimated tokens of the pieces being tokenized
        # partitions: this loader's shards end before ``limit`` (a re-partition set it);
        # ``next`` is the first shard it has not started to read (None: it owns no more)
        self.next: Position | None = start
        self.limit: Position | None = None
        self.frozen = False
        self.closed = False
        self.error: BaseException | None = None  # handed to the planner by metadata()
        self.reading = ""  # the shard the window thread is on, for error messages
        self.waits_on: str | None = None  # what holds the scheduler back: "budget" or "queue"
        self._held_back = 0  # the estimate of the piece the budget held back last
        # while the window thread waits: what it waits on (it waits while this is true)
        self._window_waits_on: Callable[[], bool] | None = None
        self._shards = shards
        self._workers = Workers(f"overlord-piece-{name}")  # pieces are tokenized on these
        self._threads = [
            threading.Thread(target=fn, name=f"overlord-{what}-{name}", daemon=True)
            for fn, what in ((self._read_windows, "window"), (self._run, "loader"))
        ]

    def start(self) -> None:
        """Start both threads (once the loader's side can answer the :class:`Outlet`)."""
        for t in self._threads:
            t.start()

    # ---- the window thread -----------------------------------------------------------------

    def _read_windows(self) -> None:
        """The window thread: this loader's shards, a window at a time, one window ahead."""
        nxt = next(self._shards, None)
        try:
            while True:
                with self.lock:
                    # frozen (a re-partition is choosing its boundary), or every shard it
                    # owns is read: wait for until() or stop()
                    self._wait(partial(self._held_off, nxt))
                    if self.closed:
                        return
                    assert nxt is not None
                    at, nxt = nxt, next(self._shards, None)
                    self.next = nxt
                files = self.files.at(at[0])
                file = shard_file(self.plan, self.spec, files, *at)
                self.reading = file.name
                file_index = files.index(file)
                windows = shard_windows(self.plan, self.spec, files, *at, self.cache)
                while self._room() and (window := next(windows, None)) is not None:
                    if not self._primary():  # a standby's window waits compressed
                        window.pack()
                    self._put(window)
                if self.closed or not self._put(Task(at, file_index, end=True)):
                    return
        except BaseException as e:  # published in order, after what was read before it
            self._put(e)

    def _primary(self) -> bool:
        with self.lock:
            return self.outlet.state().primary

    def _held_off(self, at: Position | None) -> bool:
        """Whether the window thread waits before shard ``at`` (lock held)."""
        return not self.closed and not self._may_read(at)

    def _may_read(self, at: Position | None) -> bool:
        """Whether the window thread may start on shard ``at`` now (lock held)."""
        if at is None:
            return False  # this loader owns no shard from here on
        return not (self.closed or self.frozen) and (self.limit is None or at < self.limit)

    def _room(self) -> bool:
        """Wait until the next window may be read; False once closed.

        None waits to be cut, and the window being cut started on its last half
        (a standby's: all of it, held compressed): with each piece let go once
        cut, a loader holds about one window of text, a standby half of one
        (:meth:`ReadAhead.may_read_window`).
        """
        with self.lock:
            self._wait(lambda: not self.closed and not self._may_read_window())
            return not self.closed

    def _may_read_window(self) -> bool:
        cutting = self.cutting
        return self.policy.may_read_window(
            waiting=len(self.windows),
            left_bytes=0 if cutting is None else cutting.left_bytes(),
            window_bytes=0 if cutting is None else int(cutting.window.offsets[-1]),
            primary=self.outlet.state().primary,
        )

    def _put(self, what: Window | Task | BaseException) -> bool:
        """Hand a window to the scheduler, waiting while one waits already; False once closed."""
        with self.lock:
            if not isinstance(what, BaseException):
                self._wait(lambda: bool(self.windows) and not self.closed)
            self.windows.append(what)
            self.lock.notify_all()
            return not self.closed

    def _wake_window(self) -> None:
        """Wake the window thread if what it waits on is over (lock held); else let it sleep."""
        waiting = self._window_waits_on
        if waiting is not None and not waiting():
            self.window_turn.notify_all()

    def _wait(self, waiting: Callable[[], bool]) -> None:
        """The window thread waits (lock held) while ``waiting()``, on :attr:`window_turn`."""
        self._window_waits_on = waiting
        try:
            while waiting():
                self.window_turn.wait(POLL_S)
        finally:
            self._window_waits_on = None

    # ---- the piece scheduler ---------------------------------------------------------------

    def _run(self) -> None:
        """The scheduler: starts pieces as the rule allows, publishes what is done, in order."""
        pending = self.pending
        try:
            while True:
                with self.lock:
                    task = None
                    while not self.closed:
                        if pending and pending[0].ready():
                            break
                        task = self._next_task()
                        if task is not None:
                            break
                        self.lock.wait(POLL_S)
                    if self.closed:
                        return
                if task is None:
                    self._publish(pending.popleft())
                elif task.here is not None:
                    self._cut_here(task)
        except BaseException as e:  # handed to the planner by metadata()
            with self.lock:
                self.error = e
                self.lock.notify_all()

    def _cut_here(self, task: Task) -> None:
        """Tokenize a piece on this thread (lock not held).

        Only at ``threads`` 1: no other piece is in flight, and none may start meanwhile.
        """
        assert task.piece is not None and task.here is not None
        args, task.here = task.here, None
        try:
            task.piece.set_result(self._tokenize(*args))
        except BaseException as e:  # raised where it is published, in order
            task.piece.set_exception(e)

    def _next_task(self) -> Task | None:
        """Start the next task if the rule allows it (lock held).

        A window read ahead is taken (letting the window thread read the next
        one) only when its first piece may start.
        """
        if self.cutting is not None and not self.cutting.left:
            self.cutting = None
        if self.cutting is None:
            if not self.windows:
                return None
            got = self.windows[0]
            if isinstance(got, BaseException):
                if self.pending:
                    return None  # publish what came before it first
                raise got
            if isinstance(got, Task):  # a shard's end
                self.windows.popleft()
                self._wake_window()
                self.pending.append(got)
                return got
            left = list(got.cut)
            parts = record_parts(self.plan, self.tokenizer, got, *left[0]) if left else []
            if left and not self._admit(got, *(parts[0] if parts else (*left[0], None))):
                return None
            self.windows.popleft()
            self._wake_window()
            self.cutting = Cutting(got, left)
            task = Task((got.epoch, got.shard_pos), got.file_index, got)  # its counts
            self.pending.append(task)
            return task
        cutting = self.cutting
        window, left = cutting.window, cutting.left
        lo, hi = left[0]
        if cutting.parts is None:  # a long record's chunks are made a part at a time
            cutting.parts = record_parts(self.plan, self.tokenizer, window, lo, hi)
        parted = bool(cutting.parts)
        plo, phi, chunks = cutting.parts[0] if cutting.parts else (lo, hi, None)
        estimate = self._admit(window, plo, phi, chunks)
        if not estimate:
            return None
        if parted:
            cutting.parts.pop(0)
        if not cutting.parts:  # the piece's last part started
            left.pop(0)
            cutting.parts = None
        # the window thread may read the next window now (it waits on what is left of this one)
        self._wake_window()
        here = None
        if self.policy.threads == 1:  # no hand-off to a worker and back for each piece
            piece: Future[Tokenized] = Future()
            here = (window, plo, phi, chunks)
        else:
            piece = self._workers.submit(self._tokenize, window, plo, phi, chunks)
            piece.add_done_callback(self._wake)
        task = Task((window.epoch, window.shard_pos), window.file_index, window, plo, phi, piece)
        task.estimate, task.chunks, task.here = estimate, chunks, here
        if parted and cutting.parts is None:
            task.whole = (lo, hi)
        self.in_flight += estimate
        self.pending.append(task)
        return task

    def _admit(
        self, window: Window, lo: int, hi: int, chunks: tuple[int, int] | None = None
    ) -> int:
        """The estimated tokens of records ``[lo, hi)`` if they may start now, else 0 (lock held).

        A piece's tokens are estimated from its bytes before it is tokenized
        (the source's measured tokens per byte); a part of a long record's are its chunks'.
        """
        state = self.outlet.state()
        if chunks is not None:
            estimate = part_tokens(self.plan, chunks)
        else:
            estimate = max(1, int(window.text_bytes(lo, hi) * state.tokens_per_byte))
        reason = self._holds_back(estimate, state)
        if reason == "threads":
            return 0
        self.waits_on = reason
        self._held_back = estimate
        return 0 if reason else estimate

    def released_enough(self) -> bool:
        """Whether the scheduler, held back by the budget, may start its piece now (lock held).

        A release (or the planner's taking metadata, which grows a new loader's
        allowance) wakes the scheduler only then: its next piece is not admitted
        a token at a time, with a wake-up per step that finds the budget still short.
        """
        if self.waits_on != "budget":
            return False  # not held by the budget: a release does not let it go on
        return self._holds_back(self._held_back, self.outlet.state()) != "budget"

    def _holds_back(self, estimate: int, state: LoaderSide) -> str | None:
        """What holds back a piece of ``estimate`` tokens, the loader's side being ``state``."""
        return self.policy.holds_back(
            held=state.held,
            in_flight=self.in_flight,
            estimate=estimate,
            served=state.served,
            asked=state.asked,
            pieces=self.reads_in_flight(),
        )

    def _wake(self, _: Future[Any]) -> None:
        with self.lock:
            self.lock.notify_all()

    def _tokenize(
        self, window: Window, lo: int, hi: int, chunks: tuple[int, int] | None
    ) -> Tokenized:
        """One piece's items (or a part's), and the CPU seconds (this thread's) it took."""
        c0 = time.thread_time()
        if chunks is not None:  # its text goes once its last part is published (in order)
            items = cut_part(self.plan, self.tokenizer, window, lo, chunks)
            return items, time.thread_time() - c0
        items = cut_items(self.plan, self.tokenizer, window, lo, hi)
        _release(window, lo, hi)  # a piece's text goes once cut: a window is held as it is left
        return items, time.thread_time() - c0

    def _publish(self, task: Task) -> None:
        """Hand a finished task to the loader, in order, once its metadata queue has room."""
        got = task.piece.result() if task.piece is not None else None
        with self.lock:
            while not self.closed and self.outlet.backlogged():
                self.waits_on = "queue"
                self.lock.wait(POLL_S)
            self.waits_on = None
            if self.closed:
                return
            if got is not None:
                self.in_flight -= task.estimate
            self.outlet.publish(task, got)
            if task.whole is not None and task.window is not None:
                _release(task.window, *task.whole)
            self.lock.notify_all()

    # ---- calls (each takes the lock) -------------------------------------------------------

    def reads_in_flight(self) -> int:
        """Pieces being tokenized (lock held)."""
        return sum(t.piece is not None for t in self.pending)

    def done_reading(self) -> bool:
        """Whether every shard it owns (up to its limit) was started (lock held)."""
        return self.next is None or (self.limit is not None and self.next >= self.limit)

    def freeze(self) -> Position | None:
        """Start no new shard; the first shard not started (None: it owns no more)."""
        with self.lock:
            self.frozen = True
            return self.next

    def until(self, limit: Position) -> Position | None:
        """Read on, but only the shards before ``limit``.

        Returns the shard it started already past ``limit``, if any: then it
        stays frozen (the boundary is wrong).
        """
        with self.lock:
            self.limit = limit
            if self.next is not None and self.next > limit:
                return self.next
            self.frozen = False
            self.window_turn.notify_all()
            return None

    def primary_changed(self) -> None:
        """The loader was promoted (lock held): a primary reads further ahead than a standby."""
        self._wake_window()

    def set_threads(self, threads: int) -> None:
        """Tokenize ``threads`` pieces at once from now on."""
        with self.lock:
            self.policy = replace(self.policy, threads=threads)
            self.lock.notify_all()

    def view(self) -> ReadView:
        """What it holds and does now (for stats, tests and benchmarks)."""
        with self.lock:
            waits = self._window_waits_on
            return ReadView(
                cutting=None if self.cutting is None else self.cutting.window,
                left=[] if self.cutting is None else list(self.cutting.left),
                ahead=[w for w in self.windows if isinstance(w, Window)],
                reads_in_flight=self.reads_in_flight(),
                waits_on=self.waits_on,
                # it waits, and goes on waiting (not merely woken, about to read on)
                window_thread_waits=waits is not None and waits(),
            )

    def stop(self) -> None:
        """Read nothing more: both threads end at their next wait."""
        with self.lock:
            self.closed = True
            self.lock.notify_all()
            self.window_turn.notify_all()
        self._workers.shutdown()  # once the pieces in flight are tokenized

    def join(self, timeout: float) -> None:
        """Wait (up to ``timeout``, at most ``CLOSE_WAIT_S``) for the reads in flight to end.

        A process must not exit in the middle of Arrow's C++; a read that
        hangs is a daemon thread and is left behind. Then let go of every
        window held.
        """
        timeout = min(CLOSE_WAIT_S, timeout)
        for thread in self._threads:  # a window being built ends within seconds
            thread.join(timeout=timeout)
        wait([t.piece for t in list(self.pending) if t.piece is not None], timeout=timeout)
        with self.lock:  # its windows' text goes now, not when a collection finds the loader
            self.windows.clear()
            self.cutting = None
            self.pending.clear()
