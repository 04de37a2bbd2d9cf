"""Runtimes that execute overlord's roles."""

from overlord.runtime.base import Handle, Runtime
from overlord.runtime.inline import InlineRuntime


def make_runtime(name: str) -> Runtime:
    """A runtime by name: ``inline`` (default, embedded)."""
    if name == "inline":
        return InlineRuntime()
    raise ValueError(f"unknown runtime '{name}': expected 'inline'")


__all__ = ["Handle", "InlineRuntime", "Runtime", "make_runtime"]
