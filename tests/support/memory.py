"""The peak memory of a training loop over a plan, measured in a process of its own.

The benchmarks measure it the same way: one definition, in ``benchmarks/_lib/peak.py``.
"""

from __future__ import annotations

from benchmarks._lib.peak import peak_kib

__all__ = ["peak_kib"]
