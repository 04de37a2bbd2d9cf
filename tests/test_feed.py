"""benchmarks/feed.py runs end to end at tiny sizes and prints its table and its verdicts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def test_feed_quick_prints_the_table_and_every_verdict():
    # no torchrun (its rendezvous needs sockets) and a given step time: six short child runs
    cmd = [sys.executable, "-m", "benchmarks.feed", "--quick", "--no-node", "--step-ms", "5"]
    cmd += ["--steps", "3", "--warm", "1", "--files", "10", "--shards", "2"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "| overlord inline (dp 1) | sleep | 5.0 |" in out
    assert "| overlord process (dp 1) | busy | 5.0 |" in out
    assert "| torch DataLoader W=2 | busy | 5.0 |" in out
    verdicts = [line for line in out.splitlines() if line.startswith("- Target ")]
    assert len(verdicts) == 3
    assert all(("**PASS**" in v) != ("**MISS**" in v) for v in verdicts)
