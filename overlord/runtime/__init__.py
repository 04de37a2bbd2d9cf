"""Runtimes that execute overlord's roles: ``inline`` (embedded) and ``ray``.

The seam is :mod:`overlord.runtime.base`; it imports nothing from the plan or
the roles, so a runtime never knows what it runs. Roles take what they need of
this package from here: the seam's types, the object store's Protocol, and
the daemon threads they do their work ahead on.
"""

from __future__ import annotations

from overlord.runtime.base import Done, Gone, Handle, OneWay, Ref, RoleOptions, Runtime
from overlord.runtime.inline import InlineRuntime
from overlord.runtime.objects import ObjectStore
from overlord.runtime.threads import Builder, in_daemon_thread

RUNTIMES = ("inline", "ray")

__all__ = [
    "RUNTIMES",
    "Builder",
    "Done",
    "Gone",
    "Handle",
    "InlineRuntime",
    "ObjectStore",
    "OneWay",
    "Ref",
    "RoleOptions",
    "Runtime",
    "in_daemon_thread",
]
