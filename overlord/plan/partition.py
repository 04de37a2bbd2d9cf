"""Who reads which shard of a source: its partitions among loader slots, as plain values.

A source is read by loader *slots*. A *partition* of its order is ``n``
loaders reading from a shard boundary on: the shard at place ``p`` of an
epoch's order belongs to loader ``p % n`` of it (:func:`owner`, the one place
that says so). Re-partitioning (the autoscaler choosing another ``n``) ends
the current partition at a boundary and starts one of new slots there, so a
source's slots hold a list of :class:`Partition`, each slot one loader of one
partition, and :func:`partitions` gives the partitions themselves.

Pure: numbers in, numbers out; the loader pool keeps them, the planner's
cursors and the loaders ask :func:`owner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

Position = tuple[int, int]  # (epoch, shard_pos): a shard's place in the source's order
Span = tuple[Position, int, int]  # a partition: (first shard, first slot, loaders)


class Partition(NamedTuple):
    """What a loader slot reads: loader ``loader`` of ``loaders``, shards ``start`` to ``limit``.

    >>> Partition.of(Partition(1, 2, (0, 4), None).record())
    Partition(loader=1, loaders=2, start=(0, 4), limit=None)
    """

    loader: int
    loaders: int
    start: Position
    limit: Position | None  # None: the source's current partition, without an end

    def record(self) -> list[Any]:
        """As JSON: ``[loader, loaders, start, limit]``."""
        limit = None if self.limit is None else list(self.limit)
        return [self.loader, self.loaders, list(self.start), limit]

    @classmethod
    def of(cls, record: list[Any]) -> Partition:
        """From :meth:`record`."""
        loader, loaders, (e, p), limit = record
        return cls(loader, loaders, (e, p), None if limit is None else (limit[0], limit[1]))


def partitions(parts: Sequence[Partition]) -> list[Span]:
    """A source's partitions, ``(first shard, first slot, loaders)``, from its slots' parts.

    >>> old = [Partition(k, 2, (0, 0), (0, 4)) for k in range(2)]
    >>> partitions([*old, Partition(0, 1, (0, 4), None)])
    [((0, 0), 0, 2), ((0, 4), 2, 1)]
    """
    return [(p.start, k, p.loaders) for k, p in enumerate(parts) if p.loader == 0]


def owner(at: Position, spans: Sequence[Span]) -> int:
    """The slot that reads shard ``at``: loader ``shard_pos % n`` of the partition it falls in.

    ``spans`` are a source's partitions by first shard (:func:`partitions`);
    the first starts at or before ``at``. A lone loader asks with its own
    partition alone, numbered from slot 0.

    >>> spans = [((0, 0), 0, 2), ((0, 4), 2, 3)]
    >>> [owner((0, p), spans) for p in range(7)]
    [0, 1, 0, 1, 3, 4, 2]
    >>> owner((1, 0), spans)  # the last partition reads every later epoch
    2
    """
    for start, first, loaders in reversed(spans):
        if at >= start:
            return first + at[1] % loaders
    raise ValueError(
        f"shard {at} lies before the source's first partition, which starts at "
        f"{spans[0][0] if spans else 'no shard (no partition)'}"
    )


# up to this many items, by_slot groups them in plain Python
FEW_ITEMS = 16


def by_slot(source: np.ndarray, loader: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """Item indexes per ``(source, loader)`` slot, in slot order.

    >>> [(s, k, i.tolist()) for s, k, i in by_slot(np.array([1, 0, 1]), np.array([0, 0, 0]))]
    [(0, 0, [1]), (1, 0, [0, 2])]
    """
    if len(source) <= FEW_ITEMS:  # plain Python costs less than numpy's calls here
        groups: dict[tuple[int, int], list[int]] = {}
        for i, slot in enumerate(zip(source.tolist(), loader.tolist())):
            groups.setdefault(slot, []).append(i)
        return [(s, k, np.array(i, dtype=np.int64)) for (s, k), i in sorted(groups.items())]
    if (source == source[0]).all() and (loader == loader[0]).all():  # one slot: most steps
        return [(int(source[0]), int(loader[0]), np.arange(len(source), dtype=np.int64))]
    key = source.astype(np.int64) * (int(loader.max()) + 1) + loader
    order = np.argsort(key, kind="stable")
    firsts = np.flatnonzero(np.diff(key[order], prepend=-1))  # each slot's first, in order
    ends = [*firsts[1:].tolist(), len(order)]
    slots = zip(source[order[firsts]].tolist(), loader[order[firsts]].tolist())
    return [(int(s), int(k), order[a:b]) for (s, k), a, b in zip(slots, firsts.tolist(), ends)]


def group_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``x[rows]`` for ``rows``, one group of :func:`by_slot` (or of ``by_shard``) over ``x``.

    A group of every row holds them in order, so it is ``x`` itself: no copy (most steps'
    items of a loader are one slot, and lie in one shard).

    >>> x = np.arange(6).reshape(3, 2)
    >>> group_rows(x, np.arange(3)) is x, group_rows(x, np.array([0, 2])).tolist()
    (True, [[0, 1], [4, 5]])
    """
    return x if len(rows) == len(x) else x[rows]
