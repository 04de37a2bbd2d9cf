"""Runtimes that execute overlord's roles: ``inline`` (embedded) and ``ray``.

The seam is :mod:`overlord.runtime.base`; it imports nothing from the plan or
the roles, so a runtime never knows what it runs.
"""

from __future__ import annotations

from overlord.runtime.base import Done, Gone, Handle, OneWay, Ref, RoleOptions, Runtime
from overlord.runtime.inline import InlineRuntime

RUNTIMES = ("inline", "ray")

__all__ = [
    "RUNTIMES",
    "Done",
    "Gone",
    "Handle",
    "InlineRuntime",
    "OneWay",
    "Ref",
    "RoleOptions",
    "Runtime",
]
