"""The runtime seam's contract, the same on every runtime.

One small role runs on ``inline`` and on ``ray``: a call's Ref resolves
itself, a role's error is raised where the result is asked for with the role
and the method named, a gone role answers as a dead one does, a one-way
call's error reaches its sender, and roles asked to share a host share its
process behind handles that take the same calls.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

from overlord.batch import Batch
from overlord.errors import ActorDiedError, LoaderError
from overlord.roles.client import Client
from overlord.runtime.base import Gone, OneWay, RoleOptions
from overlord.runtime.hosting import HostRole, call_each, spread
from overlord.runtime.inline import InlineRuntime


def echo_role() -> type:
    """A role class made inside a function, so that Ray sends it by value to its worker."""

    class Echo:
        def __init__(self, base: int):
            self.base = base

        def add(self, x: int, times: int = 1) -> int:
            return self.base + x * times

        def fail(self, why: str) -> None:
            raise ValueError(why)

        def pid(self) -> int:
            return os.getpid()

    return Echo


def trainer_side_roles() -> tuple[type, type]:
    """A constructor that hands out empty batches, and a planner stub of the wrong arity."""

    class Constructor:
        def batch(self, step: int, rank: int) -> Batch:
            z = np.zeros(0, dtype=np.int32)
            return Batch(step, rank, z, z, z, z, z, [], 0.0)

    class OldPlanner:  # the client passes (rank, step, train_s, wait_s, since): a TypeError
        def mark_consumed(self, rank: int, step: int) -> None:
            pass

    return Constructor, OldPlanner


@pytest.fixture(params=["inline", pytest.param("ray", marks=pytest.mark.ray)])
def runtime(request) -> Any:
    if request.param == "inline":
        rt: Any = InlineRuntime()
    else:
        request.getfixturevalue("ray_session")
        from overlord.runtime.ray_runtime import RayRuntime

        rt = RayRuntime(f"contract-{uuid.uuid4().hex[:6]}")
    yield rt
    rt.shutdown()


def test_a_call_returns_a_ref_that_resolves_itself(runtime):
    Echo = echo_role()
    h = runtime.spawn(Echo, 40, name="echo")
    refs = [h.call(Echo.add, 2), h.call(Echo.add, 1, times=3)]  # in flight together
    assert [r.result(timeout=30) for r in refs] == [42, 43]
    assert all(r.done() for r in refs)


def test_a_roles_error_is_raised_where_its_result_is_asked_for(runtime):
    Echo = echo_role()
    h = runtime.spawn(Echo, 0, name="echo")
    ref = h.call(Echo.fail, "the shard is gone")
    with pytest.raises(Exception, match="the shard is gone") as err:
        ref.result(timeout=30)
    if runtime.name == "ray":  # crossed a process: the role and the method are named
        assert isinstance(err.value, LoaderError) and "echo.fail" in str(err.value)


def test_lookup_finds_a_live_role_and_stands_in_for_a_gone_one(runtime):
    Echo = echo_role()
    h = runtime.spawn(Echo, 1, name="echo")
    assert runtime.lookup("echo").call(Echo.add, 1).result(timeout=30) == 2
    gone = runtime.lookup("no-such-role")
    assert isinstance(gone, Gone)
    with pytest.raises(ActorDiedError, match="no-such-role"):
        gone.call(Echo.add, 1).result()
    runtime.kill(h)
    # Ray kills an actor asynchronously: once its name is free, it is gone (a hang guard)
    deadline = time.monotonic() + 30
    while not isinstance(runtime.lookup("echo"), Gone):
        assert time.monotonic() < deadline, "a killed role is still found by its name"
        time.sleep(0.05)
    with pytest.raises(ActorDiedError):
        h.call(Echo.add, 1).result(timeout=30)


def test_a_one_way_calls_error_reaches_its_sender_naming_the_call(runtime):
    Echo = echo_role()
    h = runtime.spawn(Echo, 0, name="echo")
    told = OneWay("the test")
    told.send(h, Echo.add, 1)  # fine
    with pytest.raises(LoaderError, match=r"the test: the one-way call echo\.fail failed.*lost"):
        told.send(h, Echo.fail, "lost release")  # inline: raised here, the call has run
        told.flush(timeout=30)  # ray: raised once it has run
    told.send(h, Echo.add, 1)
    told.flush(timeout=30)  # nothing left over


def test_background_one_way_calls_run_in_order_and_name_the_one_that_failed():
    """Calls queued behind a busy background thread join one job: all run, in order."""
    made: list[int] = []
    gate = threading.Event()

    class Log:
        def add(self, x: int) -> None:
            if x == 0:
                gate.wait(30)  # the thread is busy: later sends queue up
            made.append(x)

        def fail(self, why: str) -> None:
            made.append(-1)
            raise ValueError(why)

    # two calls at once: a role that queues no calls, so a thread of the OneWay's makes them
    h = InlineRuntime().spawn(Log, name="log", options=RoleOptions(max_concurrency=2))
    told = OneWay("the test", background=True)
    told.send(h, Log.add, 0)
    for x in range(1, 40):
        told.send(h, Log.add, x)
    told.send(h, Log.fail, "lost notice")
    told.send(h, Log.add, 40)  # after the failure, in the same job: made all the same
    gate.set()
    with pytest.raises(LoaderError, match=r"the test: the one-way call log\.fail failed.*lost"):
        told.flush(timeout=30)
    assert made == [*range(40), -1, 40]
    told.send(h, Log.add, 41)
    told.close()
    assert made[-1] == 41


def test_a_serial_roles_one_way_calls_run_in_order_before_its_next_call_on_that_thread():
    """The sender only queues; the role's next call runs them first, on its caller's thread."""
    made: list[tuple[int, str]] = []

    class Log:
        handle: Any = None

        def add(self, x: int) -> int:
            made.append((x, threading.current_thread().name))
            return x

        def fail(self, why: str) -> None:
            raise ValueError(why)

        def nested(self, told: OneWay) -> None:
            told.send(self.handle, Log.add, 7)  # queued during a call of the role's own:
            self.handle.call(Log.add, 8).result()  # not run by its call to itself

    h = InlineRuntime().spawn(Log, name="log")  # one call at a time: a serial role
    h.obj.handle = h
    told = OneWay("the queue", background=True)
    told.send(h, Log.add, 1)
    told.send(h, Log.add, 2)
    assert made == [] and told.pending()
    assert not [t for t in threading.enumerate() if t.name == "overlord-oneway-the queue"]
    builder = threading.Thread(target=lambda: h.call(Log.add, 3).result(), name="builder")
    builder.start()
    builder.join()
    assert made == [(1, "builder"), (2, "builder"), (3, "builder")]
    told.check()
    assert not told.pending()
    told.send(h, Log.fail, "lost notice")
    h.call(Log.add, 4)
    with pytest.raises(LoaderError, match=r"the queue: the one-way call log\.fail failed.*lost"):
        told.check()
    h.call(Log.nested, told)
    assert [x for x, _ in made[-2:]] == [4, 8]
    told.send(h, Log.add, 5)  # nobody calls the role: waiting for them runs them here
    told.flush(timeout=30)
    assert [x for x, _ in made[-2:]] == [7, 5] and made[-1][1] == "MainThread"


def test_waiting_for_a_queued_call_behind_a_long_call_of_the_role_times_out():
    gate, holding = threading.Event(), threading.Event()

    class Slow:
        def hold(self) -> None:
            holding.set()
            gate.wait(30)

        def add(self, x: int) -> int:
            return x

    h = InlineRuntime().spawn(Slow, name="slow")
    busy = threading.Thread(target=lambda: h.call(Slow.hold))
    busy.start()
    assert holding.wait(30)  # the long call holds the role
    told = OneWay("the test", background=True)
    told.send(h, Slow.add, 1)
    with pytest.raises(LoaderError, match="did not run within 0.2 s"):
        told.flush(timeout=0.2)
    gate.set()
    busy.join()


def test_errors_of_a_dead_role_can_be_expected(runtime):
    Echo = echo_role()
    h = runtime.spawn(Echo, 0, name="echo")
    runtime.kill(h)
    told = OneWay("the planner", ignore=(ActorDiedError,))
    told.send(h, Echo.add, 1)  # a release to a loader that died holds nothing: not an error
    told.flush(timeout=30)


def test_a_consumption_notice_that_fails_reaches_the_trainer(runtime):
    """The client does not wait for ``mark_consumed``, yet its error is raised in the trainer."""
    Constructor, OldPlanner = trainer_side_roles()
    client = Client(0, runtime.spawn(Constructor, name="c"), runtime.spawn(OldPlanner, name="p"), 0)
    with pytest.raises(LoaderError, match=r"p\.mark_consumed failed.*TypeError"):
        for _ in range(50):
            next(client)
        client.close()  # waits for the notices still in flight


def test_lookup_or_spawn_finds_the_live_role_else_starts_one(runtime):
    Echo = echo_role()
    first = runtime.lookup_or_spawn(Echo, 1, name="echo")
    again = runtime.lookup_or_spawn(Echo, 100, name="echo")  # found: not built again
    assert again.call(Echo.add, 1).result(timeout=30) == 2
    assert first.call(Echo.add, 1).result(timeout=30) == 2


def test_roles_of_one_host_share_its_process_and_take_the_same_calls(runtime):
    Echo = echo_role()
    hosted = RoleOptions(host="host")
    a = runtime.spawn(Echo, 1, name="a", options=hosted)
    b = runtime.spawn(Echo, 10, name="b", options=hosted)
    alone = runtime.spawn(Echo, 100, name="alone")
    assert (a.name, b.name) == ("host/a", "host/b")  # what a journal records, and finds again
    assert a.call(Echo.add, 2).result(timeout=30) == 3
    assert a.call(Echo.pid).result(timeout=30) == b.call(Echo.pid).result(timeout=30)
    if runtime.name == "ray":
        assert a.call(Echo.pid).result(timeout=30) != alone.call(Echo.pid).result(timeout=30)
    # one call per process: the host answers for both of its roles at once
    refs = call_each(Echo.add, [(a, 1), (alone, 1), (b, 1), (a, 5)])
    assert [r.result(timeout=30) for r in refs] == [2, 101, 11, 6]
    found = runtime.lookup("host/b")
    assert found.name == "host/b" and found.call(Echo.add, 0).result(timeout=30) == 10
    assert isinstance(runtime.lookup("no-such-host/b"), Gone)
    with pytest.raises(Exception, match="boom"):
        b.call(Echo.fail, "boom").result(timeout=30)
    runtime.kill(a)  # the host keeps its other role
    with pytest.raises(ActorDiedError):
        a.call(Echo.add, 1).result(timeout=30)
    assert b.call(Echo.add, 1).result(timeout=30) == 11
    host = runtime.lookup("host")
    runtime.kill(b)  # its last role: the host goes too
    deadline = time.monotonic() + 30  # Ray's kill returns before the actor is gone
    with pytest.raises(ActorDiedError):
        while time.monotonic() < deadline:
            host.call(HostRole.pid).result(timeout=30)
            time.sleep(0.05)


def test_a_hosted_roles_construction_error_is_raised_by_its_calls(runtime):
    Echo = echo_role()
    broken = runtime.spawn(Echo, name="broken", options=RoleOptions(host="host"))  # no base
    with pytest.raises(Exception, match="base"):
        broken.call(Echo.add, 1).result(timeout=30)


def test_members_spread_over_hosts_round_robin():
    assert spread(list(range(5)), 2) == [[0, 2, 4], [1, 3]]
    assert spread([1], 3) == [[1]]
