"""The planner's view of one source: its loaders' blocks merged back into source order.

Items are identified by their position ``(epoch, shard_pos, index)``, which is
the source order itself: lexicographic order of positions is the order in
which the source yields them, whichever loader read them. The cursor keeps the
*pending* items (read, not yet placed in a step) in that order.

Its checkpoint is where the pending items start plus the runs of items after
that start which were already placed (a source may place a small item ahead of
a large one that did not fit, up to the plan's lookahead).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from overlord.errors import LoaderError, SourceError

Key = tuple[int, int, int]


class SourceCursor:
    """Pending items of one source, fetched from its loaders on demand.

    A loader sends a shard as blocks of consecutive items (its pieces), then a
    closing block (``last``) after which the next shard is due.

    ``fetch(k)`` returns the new metadata blocks of loader slot ``k`` (waiting
    for one); ``shards(epoch)`` is how many shards that epoch of the source
    has; ``partitions()`` are the partitions of its order, whose owner (the
    loader pool) adds one when it re-partitions the source.
    """

    def __init__(
        self,
        name: str,
        shards: Callable[[int], int],
        fetch: Callable[[int], list[dict[str, Any]]],
        partitions: Callable[[], list[tuple[tuple[int, int], int, int]]],
        start: dict[str, Any] | None = None,
    ):
        self.name, self.shards, self.fetch = name, shards, fetch
        # partitions of the source's order: (first shard, first slot, loaders), by shard;
        # slot ``first + shard_pos % loaders`` reads a shard (re-partitioning adds one)
        self.partitions = partitions
        self._blocks: dict[int, deque[dict[str, Any]]] = {}  # per slot
        start = start or {}
        self._expect = (int(start.get("epoch", 0)), int(start.get("shard_pos", 0)))
        # where the shard being received resumes: the end of its last piece received
        self._start_index = int(start.get("index", 0))
        self._full_epoch = self._expect[1] == 0 and int(start.get("index", 0)) == 0
        self._epoch_items = 0
        # pending items, in source order: key, tokens, slot, file index, record row, chunk,
        # image patches
        self.keys: list[Key] = []
        self.tokens: list[int] = []
        self.loader: list[int] = []
        self.file_index: list[int] = []
        self.row: list[int] = []
        self.chunk: list[int] = []
        self.patches: list[int] = []
        # placed items that lie after the first pending one (kept for the checkpoint)
        self._placed_ahead: list[Key] = [
            (e, p, i + j) for e, p, i, c in start.get("skip", []) for j in range(c)
        ]

    def peek(self, i: int) -> int:
        """Tokens of the ``i``-th pending item."""
        while i >= len(self.tokens):
            self._fetch()
        return self.tokens[i]

    def _fetch(self) -> None:
        epoch, pos = self._expect
        k = self.loader_of(epoch, pos)
        queue = self._blocks.setdefault(k, deque())
        if not queue:
            queue.extend(self.fetch(k))  # never empty: a loader waits for a block or raises
        block = queue.popleft()
        got = (int(block["epoch"]), int(block["shard_pos"]))
        if got != (epoch, pos):
            raise LoaderError(
                f"loader {k} of '{self.name}' sent shard {got} where shard {(epoch, pos)} was "
                "due: the loaders and the planner disagree on the source's order"
            )
        n = len(block["index"])
        self.keys += [(epoch, pos, int(i)) for i in block["index"].tolist()]
        self.tokens += block["tokens"].tolist()
        self.loader += [k] * n
        self.file_index += [int(block["file_index"])] * n
        self.row += block["row"].tolist()
        self.chunk += block["chunk"].tolist()
        self.patches += block["patches"].tolist()
        self._epoch_items += n
        if not block["last"]:  # a piece of the shard: more follow
            self._start_index = int(block["stop"])
            return
        pos += 1
        if pos == self.shards(epoch):
            if self._full_epoch and self._epoch_items == 0:
                raise SourceError(
                    self.name,
                    None,
                    None,
                    f"a whole epoch of its {pos} file(s) yielded no sample: every "
                    "record is bad (skipped), empty, or dropped as longer than max_seq_len",
                )
            epoch, pos = epoch + 1, 0
            self._full_epoch, self._epoch_items = True, 0
        self._expect = (epoch, pos)
        self._start_index = 0

    def loader_of(self, epoch: int, pos: int) -> int:
        """The loader that reads shard ``pos`` of epoch ``epoch``."""
        for at, first, count in reversed(self.partitions()):
            if (epoch, pos) >= at:
                return first + pos % count
        raise AssertionError("the first partition starts at the first shard")

    def take(self, indices: list[int]) -> dict[str, list[Any]]:
        """Remove pending items (by pending index) and return what the plan needs of them."""
        if not indices:
            return {
                k: [] for k in ("key", "tokens", "loader", "file_index", "row", "chunk", "patches")
            }
        taken = set(indices)
        first_left = next((i for i in range(len(self.keys)) if i not in taken), len(self.keys))
        out: dict[str, list[Any]] = {
            "key": [self.keys[i] for i in indices],
            "tokens": [self.tokens[i] for i in indices],
            "loader": [self.loader[i] for i in indices],
            "file_index": [self.file_index[i] for i in indices],
            "row": [self.row[i] for i in indices],
            "chunk": [self.chunk[i] for i in indices],
            "patches": [self.patches[i] for i in indices],
        }
        self._placed_ahead += [self.keys[i] for i in indices if i > first_left]
        keep = [j for j in range(len(self.keys)) if j not in taken]
        self.keys = [self.keys[j] for j in keep]
        self.tokens = [self.tokens[j] for j in keep]
        self.loader = [self.loader[j] for j in keep]
        self.file_index = [self.file_index[j] for j in keep]
        self.row = [self.row[j] for j in keep]
        self.chunk = [self.chunk[j] for j in keep]
        self.patches = [self.patches[j] for j in keep]
        start = self.keys[0] if self.keys else None
        self._placed_ahead = sorted(
            k for k in self._placed_ahead if start is not None and k > start
        )
        return out

    def state(self) -> dict[str, Any]:
        """Where to restart this source: the first pending item and the runs placed after it."""
        if self.keys:
            e, p, i = self.keys[0]
        else:
            (e, p), i = self._expect, self._start_index
        runs: list[list[int]] = []
        for ke, kp, ki in self._placed_ahead:
            if runs and runs[-1][:2] == [ke, kp] and runs[-1][2] + runs[-1][3] == ki:
                runs[-1][3] += 1
            else:
                runs.append([ke, kp, ki, 1])
        return {"epoch": e, "shard_pos": p, "index": i, "skip": runs}
