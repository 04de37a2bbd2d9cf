"""The seam between roles and what runs them, and the runtimes behind it.

The seam is :mod:`overlord.runtime.base`; it imports nothing from the plan or
the roles, so a runtime never knows what it runs. Roles take what they need of
this package from here: the seam's types, the object store's Protocol, calls
grouped per hosting process (:func:`call_each`, :func:`spread`), and the daemon
threads they do their work ahead on. The runtimes themselves, ``inline``
(:mod:`overlord.runtime.inline`) and ``ray`` (:mod:`overlord.runtime.ray_runtime`),
are chosen by the wiring (``overlord.Loader``), never imported by a role.
"""

from __future__ import annotations

from overlord.runtime.base import Done, Gone, Handle, OneWay, Ref, RoleOptions, Runtime
from overlord.runtime.hosting import call_each, spread
from overlord.runtime.objects import ObjectStore
from overlord.runtime.threads import Builder, Workers, in_daemon_thread

RUNTIMES = ("inline", "ray")

__all__ = [
    "RUNTIMES",
    "Builder",
    "Done",
    "Gone",
    "Handle",
    "ObjectStore",
    "OneWay",
    "Ref",
    "RoleOptions",
    "Runtime",
    "Workers",
    "call_each",
    "in_daemon_thread",
    "spread",
]
