"""The object store: a capability a runtime may offer, injected into the roles that use it.

A DataConstructor on Ray puts the view that a mesh rank receives once in its
node's object store, and every TP peer of the rank gets a reference to that one
object, mapped without a copy on that node. A runtime that has no such store
(``inline``: every role in the caller's process, where a view is shared by
reference anyway) offers none, and its roles hand batches over directly.

Roles never import a runtime to reach the store: the wiring passes the
runtime's :attr:`overlord.runtime.base.Runtime.objects` (or None) to the roles
that take one, the constructor that puts and the client that gets.
"""

from __future__ import annotations

from typing import Any, Protocol


class ObjectStore(Protocol):
    """Put a payload once in this node's store; get it back by reference, anywhere."""

    def put(self, value: Any) -> Any:
        """Store ``value`` (numpy arrays without a copy); a reference to it, sent in a reply."""
        ...

    def get(self, ref: Any, what: str) -> Any:
        """The value ``ref`` refers to; None if it was lost (its owner died).

        ``what`` names the value in an error. On the node that holds it, numpy
        arrays in it are mapped from the store without a copy, read-only.
        """
        ...
