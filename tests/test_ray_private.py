"""Without an address, overlord's Ray is its own: never a cluster another process started.

Joining one is bounded (``--connect-timeout``) and stopped by Ctrl-C or SIGTERM, as a job is
while it serves; a dead head ends its processes with overlord's words.

Ray's ``ray.init()`` with no address joins the cluster that ``ray start`` last recorded on
the machine (another user's, or a stale one it then waits for). overlord's local instance is
always new. The other cluster here is a real ``ray start`` under a temporary folder of its own
(``RAY_TMPDIR``), stopped by its processes, so that nothing else on the machine is touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._lib.procfs import alive, below, cmdline, parents
from conftest import two_sources
from overlord.runtime.ray_connect import HEAD_GONE_EXIT

pytestmark = [pytest.mark.ray, pytest.mark.integration]

_OURS = """
import ray
from overlord.runtime.ray_runtime import init_ray
assert init_ray(None)  # this call started the instance
print(ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


def _processes_of(folder: Path) -> list[int]:
    """The processes whose command line names ``folder`` (a Ray cluster's, by its temp dir)."""
    return [pid for pid in parents() if str(folder) in cmdline(pid)]


def test_a_local_instance_is_never_a_cluster_ray_start_recorded():
    # short: Ray's socket paths under it must fit a Unix socket's 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="ovr-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(folder)}
    ray = Path(sys.executable).with_name("ray")
    started = subprocess.run(
        # --port=0: beside a cluster of someone else's on Ray's default port, too
        [str(ray), "start", "--head", "--port=0", "--num-cpus=1", "--include-dashboard=false",
         "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        said = started.stdout + started.stderr
        found = re.search(r"ray start --address='([^']+)'", said)
        assert found, said[-2000:]
        theirs = found.group(1)  # what `ray start` recorded for the machine
        ours = subprocess.run(
            [sys.executable, "-c", _OURS],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.strip()
        assert ours and ours != theirs
    finally:
        for pid in _processes_of(folder):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


# ---- connecting: bounded, and stopped by Ctrl-C or SIGTERM ----------------------------------


class Silent:
    """A TCP server that accepts every connection and never answers (not Ray's GCS)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.held.append(conn)
                self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = Silent()
    yield server
    server.close()


def overlord_command() -> str:
    return str(Path(sys.executable).with_name("overlord"))


def test_a_connect_that_gets_no_answer_gives_up_naming_the_address(silent: Silent) -> None:
    done = subprocess.run(
        [overlord_command(), "status", "job", "--address", silent.address, "--once",
         "--connect-timeout", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"no answer from the Ray cluster at '{silent.address}' within 3 s" in done.stderr
    assert "--connect-timeout" in done.stderr and "Traceback" not in done.stderr
    assert silent.accepted >= 2  # overlord's probe, then Ray's own connection: it got that far


def test_the_connect_timeout_comes_from_the_environment_too(silent: Silent) -> None:
    env = {**os.environ, "OVERLORD_CONNECT_TIMEOUT": "2"}
    code = f"import overlord\noverlord.connect('job', rank=0, address={silent.address!r})\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 1
    assert f"no answer from the Ray cluster at '{silent.address}' within 2 s" in done.stderr


_TWICE = """
import sys
from overlord.errors import LoaderError
from overlord.runtime.ray_runtime import init_ray
for attempt in (1, 2):
    try:
        init_ray(sys.argv[1], timeout=2)
    except LoaderError as e:
        print(attempt, e, flush=True)
import ray
print("initialized:", ray.is_initialized(), flush=True)
"""


def test_a_timed_out_connect_leaves_ray_uninitialized_and_refuses_a_second(
    silent: Silent,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _TWICE, silent.address], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout + done.stderr[-3000:]
    assert lines[0].startswith(f"1 no answer from the Ray cluster at '{silent.address}'")
    assert lines[1].startswith(f"2 an earlier connect of this process to the Ray cluster at "
                               f"'{silent.address}' ran out of time")  # fmt: skip
    assert lines[2] == "initialized: False"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_a_command_that_is_connecting(
    silent: Silent, sig: signal.Signals, tmp_path: Path
) -> None:
    plan = two_sources(tmp_path)
    proc = subprocess.Popen(
        [overlord_command(), "serve", str(plan), "--name", "j", "--address", silent.address],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for _ in range(600):  # inside ray.init once Ray's own connection came after the probe's
            if silent.accepted >= 2 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None and silent.accepted >= 2, proc.communicate()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, err
    assert f"overlord: stopped by {sig.name}" in err and "Traceback" not in err, err


# ---- serving: SIGTERM stops the job, and everything it started ------------------------------


def _ready(proc: subprocess.Popen[str]) -> str:
    """Read ``serve``'s output up to its ready line; that line."""
    assert proc.stdout is not None
    for _ in range(10_000):
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "serve exited before it was ready"
        if "is ready" in line:
            return line
    raise AssertionError("serve never said it was ready")


def test_sigterm_stops_a_serving_job_with_status_143(tmp_path: Path) -> None:
    plan = two_sources(tmp_path)
    cmd = [overlord_command(), "serve", str(plan), "--name", f"t-term-{os.getpid()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _ready(proc)
        started = below(proc.pid)
        assert started, "serve started no process of its own (no local Ray instance?)"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in out and "Traceback" not in err, out + err
    for _ in range(300):
        if not alive(started):
            break
        time.sleep(0.1)
    assert not alive(started), "processes started by `overlord serve` outlived it"


def test_ctrl_c_stops_a_run_on_ray_while_it_runs(tmp_path: Path) -> None:
    plan = two_sources(tmp_path)
    cmd = [overlord_command(), "run", str(plan), "--runtime", "ray", "--steps", "1000000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # running once the planner's actor is up
            started = below(proc.pid)
            if any("ray::Planner" in cmdline(p) for p in started) or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        time.sleep(2)  # steps are being served
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "overlord: stopped by SIGINT" in err and "Traceback" not in err, err
    for _ in range(300):
        if not alive(started):
            break
        time.sleep(0.1)
    assert not alive(started), "processes started by `overlord run` outlived it"


# ---- Ray's address file: a stale one is not followed ----------------------------------------


# what plain ray.init() would join: Ray's own lookup, without an address
_RAYS_CHOICE = """
from ray._private.services import canonicalize_bootstrap_address
print(canonicalize_bootstrap_address(None))
"""


def test_a_ray_command_starts_its_own_instance_beside_a_stale_address_file(tmp_path: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ovr-", dir="/tmp"))  # short: Ray's socket paths
    try:
        with socket.create_server(("127.0.0.1", 0)) as s:
            dead = f"127.0.0.1:{s.getsockname()[1]}"  # closed below: nothing listens there
        record = folder / "ray" / "ray_current_cluster"  # where Ray looks: RAY_TMPDIR/ray
        record.parent.mkdir()
        record.write_text(dead)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=str(folder), TMPDIR=str(folder))
        followed = subprocess.run(
            [sys.executable, "-c", _RAYS_CHOICE], capture_output=True, text=True, timeout=120,
            env=env, check=True,
        ).stdout.strip()  # fmt: skip
        assert followed.endswith(dead.rpartition(":")[2])  # plain ray.init() would go there
        plan = two_sources(tmp_path)
        done = subprocess.run(
            [overlord_command(), "run", str(plan), "--runtime", "ray", "--steps", "2"],
            capture_output=True, text=True, timeout=180, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("steps 0..1: "), done.stdout
        assert record.read_text() == dead  # not followed, not touched
    finally:
        for pid in _processes_of(folder):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


# ---- a dead Ray head: an overlord error, not Ray's abort a minute later ---------------------

_WATCHED = """
import sys, time
import ray
from overlord.runtime.ray_runtime import init_ray
init_ray(None)
print(ray.get_runtime_context().gcs_address, flush=True)
time.sleep(600)
"""


def test_a_process_whose_ray_head_died_ends_with_an_overlord_error() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WATCHED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, proc.communicate()
        gcs = [p for p in below(proc.pid) if "gcs_server" in cmdline(p)]
        assert len(gcs) == 1, "no GCS process under the instance's driver"
        os.kill(gcs[0], signal.SIGKILL)
        # Ray alone would abort it from C++ after 60 s, with no word from overlord
        _, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == HEAD_GONE_EXIT, err[-3000:]
    assert f"overlord: the Ray head at {address} is gone" in err, err[-3000:]


# ---- loopback: what Ray is told while a local instance starts --------------------------------


def test_a_local_node_is_put_on_loopback_only_while_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside tools/loopback every address is loopback, so the switch itself is checked here;
    docs/guides/security.md has what a local serve listens on outside it."""
    pytest.importorskip("ray")
    from ray._private import ray_constants, services

    from overlord.runtime import ray_connect

    monkeypatch.delenv(ray_connect._LOOPBACK_SWITCH, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_connect._loopback_node():
        assert os.environ[ray_connect._LOOPBACK_SWITCH] == "0"  # for the processes it starts
        assert ray_constants.ENABLE_RAY_CLUSTER is False  # for this one, which imported Ray
        assert services.get_node_ip_address() == "127.0.0.1"
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert ray_connect._LOOPBACK_SWITCH not in os.environ
    assert before is ray_constants.ENABLE_RAY_CLUSTER
