"""The peak memory of a training loop over a plan, measured in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PEAK = """
import sys
import overlord
plan = overlord.load_plan(sys.argv[1])
with overlord.Loader(plan, runtime="inline") as loader:
    client = loader.client(0)
    for _ in range(int(sys.argv[2])):
        next(client)
# VmHWM: this process's own peak (ru_maxrss would start at the forking parent's size)
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")))
"""


def peak_kib(plan: Path, steps: int, timeout: float = 300) -> int:
    """The peak resident memory (KiB) of a process that takes ``steps`` batches of rank 0."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(plan), str(steps)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return int(out.stdout.split()[-1])
