"""Without an address, overlord's Ray is its own: never a cluster another process started.

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
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

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
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder) in (entry / "cmdline").read_bytes().decode(errors="ignore"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_local_instance_is_never_a_cluster_ray_start_recorded():
    # short: Ray's socket paths under it must fit a Unix socket's 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="ovr-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(folder)}
    ray = Path(sys.executable).with_name("ray")
    started = subprocess.run(
        [str(ray), "start", "--head", "--num-cpus=1", "--include-dashboard=false",
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
