"""The embedded runtime: every role is an object in this process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overlord.errors import ActorDiedError
from overlord.runtime.base import Handle


@dataclass
class InlineRef:
    """A call that already ran: its value or its exception."""

    value: Any = None
    error: BaseException | None = None


class InlineHandle:
    """A role object; calls run synchronously in the caller's thread."""

    def __init__(self, obj: Any, name: str):
        self.obj = obj
        self.name = name
        self.dead = False  # killed: calls fail as calls to a dead actor do

    def call(self, method: str, *args: Any) -> InlineRef:
        """Run the method now and keep what it returned or raised."""
        if self.dead:
            return InlineRef(error=ActorDiedError(f"{self.name}: the role was killed"))
        try:
            return InlineRef(getattr(self.obj, method)(*args))
        except Exception as e:  # handed to the caller by InlineRuntime.get
            return InlineRef(error=e)


class DeadHandle:
    """A role known to be gone (a restarted planner finds no actor by its name).

    Calls fail as calls to a dead actor do, so the caller's failover takes over.
    """

    def __init__(self, name: str):
        self.name = name

    def call(self, method: str, *args: Any) -> InlineRef:
        """Fail with :class:`ActorDiedError`."""
        return InlineRef(error=ActorDiedError(f"{self.name}: no such live role"))


class InlineRuntime:
    """Roles as plain objects. Loaders still read ahead on their own threads."""

    name = "inline"

    def __init__(self) -> None:
        self._handles: list[InlineHandle] = []

    def spawn(self, cls: type, *args: Any, name: str) -> InlineHandle:
        """Construct the role here."""
        h = InlineHandle(cls(*args), name)
        self._handles.append(h)
        return h

    def handle(self, name: str) -> InlineHandle:
        """The live role called ``name``."""
        for h in self._handles:
            if h.name == name and not h.dead:
                return h
        raise KeyError(f"no live role named '{name}'")

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """Return the value or raise the error of a finished call."""
        assert isinstance(ref, InlineRef)
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, handle: Handle) -> None:
        """Close the role (stops its threads); later calls to it fail with ActorDiedError."""
        assert isinstance(handle, InlineHandle)
        handle.dead = True
        close = getattr(handle.obj, "close", None)
        if close is not None:
            close()
        if handle in self._handles:
            self._handles.remove(handle)

    def shutdown(self) -> None:
        """Close every role, newest first."""
        for h in reversed(list(self._handles)):
            self.kill(h)
