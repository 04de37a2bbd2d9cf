"""Timing set-up shared by benchmarks: one pinned CPU, and benchmark modules run as children."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root: run children from here


def pin_one_cpu() -> str:
    """Pin this process to one CPU; say which (or why not)."""
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    except (AttributeError, OSError) as e:
        return f"not pinned ({e})"


def module_command(name: str) -> list[str]:
    """The command that runs ``benchmarks.NAME`` as a module; start it with ``cwd=REPO``."""
    return [sys.executable, "-m", f"benchmarks.{name}"]
