"""The runtime seam: spawn a role, call its methods, wait for results.

Roles never know what runs them. ``inline`` runs every role as an object in
the calling process; a distributed runtime runs each as an actor. Calls return
a :class:`Ref` at once so that several calls can be in flight together;
``runtime.get`` waits for one.
"""

from __future__ import annotations

from typing import Any, Protocol


class Ref(Protocol):
    """The pending result of a call."""


class Handle(Protocol):
    """A spawned role."""

    name: str

    def call(self, method: str, *args: Any) -> Ref:
        """Start ``method(*args)`` on the role; returns at once."""
        ...


class Runtime(Protocol):
    """What runs the roles."""

    name: str

    def spawn(self, cls: type, *args: Any, name: str) -> Handle:
        """Create a role ``cls(*args)`` named ``name``."""
        ...

    def get(self, ref: Ref, timeout: float | None = None) -> Any:
        """The result of a call, or its exception raised here."""
        ...

    def kill(self, handle: Handle) -> None:
        """Stop a role and free what it holds."""
        ...

    def shutdown(self) -> None:
        """Stop every role this runtime spawned."""
        ...
