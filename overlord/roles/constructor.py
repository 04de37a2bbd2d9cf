"""DataConstructor: pulls its ranks' payloads from the loaders and packs their batches.

One constructor serves one DP rank, or several (the ranks of a node, or,
embedded, every rank), which it builds a step at a time in one pass: one plan,
one take per loader and one pack for all of them. With ``prefetch`` it plans
(through the planner) and builds its ranks' batches on a thread of its own,
ahead of the trainer, so that the trainer's request is answered from memory;
a step's batch, cut for the rank's CP ranks once, is kept until every peer of
the rank that asks has asked for a later step, so that its CP/TP/PP peers
(overlord.roles.consumption) share one fetch and TP peers receive the very
same batch. A build ahead that the planner refuses because other ranks lag
(in one process that consumes every rank) is not an error: the step is built
when the trainer asks for it.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.batch import Batch, SampleColumns, Samples
from overlord.batch.cp import cp_slices
from overlord.batch.cp_dynamic import dynamic_slices
from overlord.batch.gather import gather
from overlord.batch.images import BatchImages
from overlord.batch.rows import pack
from overlord.batch.stages import stage_of, stage_view
from overlord.errors import LoaderError, RanksApart
from overlord.plan.cost import CostModel
from overlord.plan.mesh import resolved_layout
from overlord.plan.partition import by_slot
from overlord.plan.spec import Plan
from overlord.roles.api import ConstructorRole, LoaderRole, PlannerRole, PoolRole
from overlord.roles.pool_view import PoolView
from overlord.runtime import Builder
from overlord.runtime.base import Handle, calls_made
from overlord.runtime.objects import ObjectStore
from overlord.sources.catalog import SourceFiles
from overlord.sources.images import image_token_id
from overlord.sources.tokenizers import make_tokenizer
from overlord.world import CPLayout


class DataConstructor:
    """Builds the batches of some DP ranks from their parts of each step plan.

    ``planner`` answers the step plans; ``pool`` is the same planner seen as
    the owner of the loaders, asked when a loader died or a partition was added.
    ``objects``: the object store of the runtime it runs on, where it has one
    (:meth:`rank_batch_ref` puts views in it).
    """

    def __init__(
        self,
        plan: Plan,
        files: dict[str, SourceFiles],
        planner: Handle[PlannerRole],
        pool: Handle[PoolRole],
        loaders: dict[str, list[Handle[LoaderRole] | None]],
        ranks: list[int],
        prefetch: int = 0,
        pad_id: int = 0,
        objects: ObjectStore | None = None,
    ):
        self.plan, self.files, self.pad_id = plan, files, pad_id
        self.objects = objects
        self.planner, self.ranks = planner, list(ranks)
        self.prefetch = prefetch
        self._lock = threading.Lock()
        # rank -> step -> its build: a rank's calls look at its own builds only
        self._built: dict[int, dict[int, Future[list[Batch] | None]]] = {r: {} for r in ranks}
        # consecutive ranks (no images) are built together, a step at a time:
        # step -> (the generation built in, the batches of the ranks that did not take theirs)
        self._together_on = (
            len(self.ranks) > 1
            and self.ranks == list(range(self.ranks[0], self.ranks[0] + len(self.ranks)))
            and plan.vision is None
        )
        self._together: dict[int, tuple[int, dict[int, Batch]]] = {}
        self._views: dict[tuple[int, int, int, str], Batch] = {}  # (step, dp, cp, stage)
        # the same views put in the object store, once each: see rank_batch_ref
        self._stored: dict[tuple[int, int, int, str], Any] = {}
        self._asked: dict[int, int] = {}  # global rank -> the last step it asked for
        self._gen = 0  # bumped when a rank asks for an earlier step (trainers rewound the job)
        self._packed = {"builds": 0, "bytes": 0}  # batches packed, and their arrays' bytes
        self._packed_span: dict[int, tuple[int, int]] = {}  # rank -> first and last step packed
        layout = resolved_layout(plan.world.cp, plan.batch.cp_layout)
        self.layout = layout if layout is not None else CPLayout.PER_DOCUMENT
        self._pool = Builder("overlord-constructor") if prefetch else None
        self.names = self.plan.source_names
        self.loaders = PoolView(self.names, loaders, pool)
        self.image_id = -1  # the image token's id, for the labels (vision plans)
        if plan.vision is not None:
            tokenizer = make_tokenizer(plan.tokenizer, str(plan.base_dir))
            self.image_id = image_token_id(plan.vision, tokenizer)

    def batch(self, step: int, rank: int) -> Batch:
        """The packed batch of DP rank ``rank`` for ``step`` (built ahead when prefetching)."""
        return self._slices(step, rank, rank)[0]

    def rank_batch(self, step: int, global_rank: int) -> Batch:
        """What mesh rank ``global_rank`` receives of its DP rank's batch for ``step``.

        Its CP slice, with the fields of its pipeline stage; every TP peer of a
        ``(dp, cp, pp)`` coordinate receives the same object (overlord.roles.consumption).
        """
        return self._view(step, global_rank)[1]

    def rank_batch_ref(self, step: int, global_rank: int) -> list[Any]:
        """:meth:`rank_batch` as one object of the object store it was given: ``[ref]``.

        The view of a ``(step, dp, cp, stage)`` is put once, and every peer
        that asks gets a reference to that one object, which the store (Ray's)
        maps without a copy (read-only) on this node; the list keeps Ray from
        copying the object into the reply. The constructor drops its
        reference with the view, once every peer that asks moved past the
        step (or the job rewound); the object goes when the trainers drop
        theirs. Views under Ray's inlining threshold (100 KiB) are small
        objects Ray copies anyway.
        """
        if self.objects is None:
            raise LoaderError(
                "rank_batch_ref: this DataConstructor was given no object store (its runtime "
                "has none): ask for rank_batch"
            )
        key, view = self._view(step, global_rank)
        with self._lock:
            ref = self._stored.get(key)
        if ref is None:
            made = self.objects.put(view)  # outside the lock: the other ranks' calls go on
            with self._lock:
                ref = self._stored.setdefault(key, made)
        return [ref]

    def _view(self, step: int, global_rank: int) -> tuple[tuple[int, int, int, str], Batch]:
        """The ``(step, dp, cp, stage)`` key of a mesh rank's view, and the view (made once)."""
        at = self.plan.world.coords(global_rank)
        stage = stage_of(at.pp, self.plan.world.pp)
        sliced = self._slices(step, at.dp, global_rank)[at.cp]
        with self._lock:
            key = (step, at.dp, at.cp, stage)
            view = self._views.get(key)
            if view is None:
                view = self._views[key] = stage_view(sliced, stage)
        return key, view

    def _slices(self, step: int, rank: int, asker: int) -> list[Batch]:
        """Every CP rank's batch of DP rank ``rank`` for ``step``, asked for by ``asker``."""
        if rank not in self.ranks:
            raise LoaderError(f"this DataConstructor serves ranks {self.ranks}, not rank {rank}")
        mine = False  # a build of this step that this thread makes (nothing builds ahead)
        with self._lock:
            if step < self._asked.get(asker, step):  # rewound: what was built ahead is stale
                self._gen += 1
                self._asked[asker] = step
                self._together.clear()
                self._built[rank].clear()
                self._drop_views(rank, None)
            built = self._built[rank]
            fut = built.get(step)
            if fut is None or (fut.done() and (fut.exception() or fut.result() is None)):
                # none yet; refused when built ahead; or failed (a retry builds it again)
                if self._pool is None:  # built here, once: the rank's peers wait for it
                    fut = built[step] = Future()
                    mine = True
                else:
                    fut = built[step] = self._pool.submit(self._build_slices, step, rank)
            for ahead in range(step + 1, step + 1 + self.prefetch):
                if ahead not in built and self._pool is not None:
                    built[ahead] = self._pool.submit(self._ahead, ahead, rank, self._gen)
            # keep a step until every peer of the rank that asks has moved past it
            self._asked[asker] = max(step, self._asked.get(asker, step))
            peers = self.plan.world.ranks_of(rank) if self.plan.world.peers > 1 else [asker]
            low = min(self._asked[g] for g in peers if g in self._asked)
            for old in [s for s in built if s < low]:
                del built[old]
            self._drop_views(rank, low)
        if mine:
            try:
                fut.set_result(self._build_slices(step, rank))
            except BaseException as e:
                fut.set_exception(e)
                raise
        got = fut.result()
        if got is None:  # refused when it was built ahead: build it now, still off this thread
            assert self._pool is not None
            return self._pool.submit(self._build_slices, step, rank).result()
        return got

    def _drop_views(self, rank: int, below: int | None) -> None:
        """Forget DP rank ``rank``'s views (and stored objects) of steps below ``below`` (all).

        Called under the lock.
        """
        for held in (self._views, self._stored):
            for key in [k for k in held if k[1] == rank and (below is None or k[0] < below)]:
                del held[key]

    def _ahead(self, step: int, rank: int, gen: int) -> list[Batch] | None:
        """Build ``step`` ahead of the trainer; None if the planner cannot plan it yet."""
        try:
            return self._build_slices(step, rank, gen)
        except RanksApart:
            return None

    def _build_slices(self, step: int, rank: int, gen: int | None = None) -> list[Batch]:
        """The DP rank's batch, cut for its CP ranks (one batch without CP)."""
        batch = self._build(step, rank, gen)
        with self._lock:
            self._packed["builds"] += 1
            self._packed["bytes"] += sum(a.nbytes for a in batch.arrays().values())
            first, last = self._packed_span.get(rank, (step, step))
            self._packed_span[rank] = (min(first, step), max(last, step))
        world = self.plan.world
        if world.tokens_per_cp_rank is not None:  # cp: dynamic, placed here (a pure function)
            model = CostModel.from_spec(self.plan.balance.cost)
            return dynamic_slices(batch, world.cp, world.tokens_per_cp_rank, model, self.pad_id)
        return cp_slices(batch, world.cp, self.layout, self.pad_id)

    def _rank_plan(
        self, step: int, rank: int, gen: int | None = None, together: bool = False
    ) -> dict[str, Any]:
        """The planner answers None while other ranks are too far behind: wait for them.

        A build ahead of generation ``gen`` stops waiting once the job rewound.
        ``together``: the plans of every rank of this constructor, asked by ``rank``.
        """
        deadline = time.monotonic() + self.plan.loading.timeout_s
        pause = 0.001
        while True:
            if together:
                first, count = self.ranks[0], len(self.ranks)
                ask = self.planner.call(PlannerRole.ranks_plan, step, rank, first, count)
            else:
                ask = self.planner.call(PlannerRole.rank_plan, step, rank)
            rp = ask.result()
            if rp is not None:
                return dict(rp)
            if gen is not None and gen != self._gen:
                raise RanksApart(f"step {step} was built ahead of a rewind")
            if time.monotonic() > deadline:
                raise LoaderError(
                    f"rank {rank} waited {self.plan.loading.timeout_s:.0f} s (loading.timeout_s) "
                    f"for step {step}: other DP ranks stopped consuming"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _build(self, step: int, rank: int, gen: int | None = None) -> Batch:
        if self._together_on:
            return self._build_together(step, rank, gen)
        rp = self._rank_plan(step, rank, gen)
        lengths = np.asarray(rp["tokens"], dtype=np.int64)
        images = BatchImages(len(lengths)) if self.plan.vision is not None else None
        tokens, mask = self._gather(rp, lengths, images)
        arrays = pack(
            tokens, lengths, rp["row"], rp["rows"], self.plan.batch.max_seq_len, self.pad_id, mask
        )
        samples = self._samples(rp, lengths, images.keys if images is not None else None)
        a = arrays
        batch = Batch(step, rank, a["input_ids"], a["labels"], a["position_ids"],
                      a["segment_ids"], a["cu_seqlens"], samples, rp["cost"])  # fmt: skip
        if images is not None:
            assert self.plan.vision is not None
            images.finish(batch, self.plan.vision, rp, self.image_id)
        return batch

    def _build_together(self, step: int, rank: int, gen: int | None) -> Batch:
        """Rank ``rank``'s batch of ``step``, built in one pass with every rank of this constructor.

        One plan, one take from each loader and one pack over every rank's
        rows, instead of one each per rank. The other ranks' batches are kept
        until their builds ask for them; a step more than ``prefetch + 2``
        steps before the newest built is forgotten (ranks are never that far
        apart, so only a rank that never asks had one kept), and a rewind
        forgets them all.
        """
        with self._lock:
            kept = self._together.get(step)
            if kept is not None and kept[0] == self._gen and rank in kept[1]:
                return kept[1].pop(rank)
            at = self._gen
        batches = self._pack_ranks(step, self._rank_plan(step, rank, gen, together=True))
        mine = batches.pop(rank)
        with self._lock:
            if at == self._gen:
                self._together[step] = (at, batches)
                for old in [s for s in self._together if s < step - self.prefetch - 2]:
                    del self._together[old]
        return mine

    def _pack_ranks(self, step: int, rp: dict[str, Any]) -> dict[int, Batch]:
        """Every rank's batch from their plans together (:meth:`PlannerRole.ranks_plan`).

        The ranks' rows are packed as the rows of one batch, then each rank's
        batch is its rows (views) and its part of ``cu_seqlens``: a rank's rows
        start and end at segment boundaries.
        """
        lengths = np.asarray(rp["tokens"], dtype=np.int64)
        tokens, mask = self._gather(rp, lengths, None)
        bounds = np.asarray(rp["bounds"], dtype=np.int64)
        count, rows, seq_len = len(bounds) - 1, rp["rows"], self.plan.batch.max_seq_len
        row_of = np.repeat(np.arange(count, dtype=np.int64) * rows, np.diff(bounds)) + rp["row"]
        a = pack(tokens, lengths, row_of, rows * count, seq_len, self.pad_id, mask)
        samples = self._samples(rp, lengths, None)
        span = rows * seq_len
        cu = a["cu_seqlens"]
        cuts = np.searchsorted(cu, np.arange(count + 1, dtype=np.int64) * span).tolist()
        cost = np.asarray(rp["cost"], dtype=np.float64).tolist()
        out = {}
        for k, (b0, b1) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            r = slice(k * rows, (k + 1) * rows)
            out[rp["first"] + k] = Batch(
                step, rp["first"] + k, a["input_ids"][r], a["labels"][r], a["position_ids"][r],
                a["segment_ids"][r], cu[cuts[k] : cuts[k + 1] + 1] - k * span,
                samples.part(b0, b1), cost[k],
            )  # fmt: skip
        return out

    def _gather(
        self, rp: dict[str, Any], lengths: np.ndarray, images: BatchImages | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The planned items' tokens back to back, in the plan's order, taken from the loaders.

        And their loss mask, where a loader sent one (a chat source's):
        :func:`overlord.batch.gather.gather`.
        """
        answers = self.loaders.take(by_slot(rp["source"], rp["loader"]), rp["key"])
        tokens, mask, answered = gather(answers, lengths)
        if images is not None:
            for mine, got in answered:
                images.add(mine, got)
        return tokens, mask

    def _samples(
        self, rp: dict[str, Any], lengths: np.ndarray, names: list[str | None] | None
    ) -> Samples:
        """Each planned item's record (its source, where it was read, its tokens and row).

        Made when first asked for (:class:`~overlord.batch.Samples`): a loop that
        never reads them pays nothing for them, and a process that hands them on
        sends their columns, never the records.
        """
        src, epoch, file_index = rp["source"], rp["key"][:, 0], rp["file_index"]
        sources, catalogs = self.names, self.files
        made: list[SampleColumns] = []  # once (a cache's wrapper costs more per step)

        def columns() -> SampleColumns:
            if not made:
                file, firsts = _groups(src, epoch, file_index)  # a step's items: a few files
                at = zip(src[firsts].tolist(), epoch[firsts].tolist(), file_index[firsts].tolist())
                files = [catalogs[sources[s]].at(e)[f].name for s, e, f in at]
                row, rec_row, chunk = rp["row"], rp["rec_row"], rp["chunk"]
                made.append(
                    SampleColumns(sources, files, src, file, rec_row, chunk, lengths, row, names)
                )
            return made[0]

        return Samples(columns, lengths)

    def stats(self) -> dict[str, Any]:
        """Batches packed (``builds``), the ``(step, rank)`` they span, and their bytes.

        ``builds`` equals ``distinct`` (the steps from each rank's first to
        its last packed) when every batch is fetched and packed once for all
        its peers; a build repeated after a failure or a rewind counts twice.
        ``calls``: the calls its process sent to other processes, by method
        (``pid``: that process).
        """
        with self._lock:
            spans = self._packed_span.values()
            built = {**self._packed, "distinct": sum(b - a + 1 for a, b in spans)}
        return {**built, "calls": calls_made(), "pid": os.getpid()}

    def pid(self) -> int:
        """The process this constructor runs in (chaos tests kill it)."""
        return os.getpid()

    def close(self) -> None:
        """Stop building ahead."""
        if self._pool is not None:
            self._pool.shutdown()


def _groups(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each item's group of equal ``columns`` values, and an item of each group.

    >>> _groups(np.array([1, 0, 1, 1]), np.array([5, 5, 5, 6]))
    (array([1, 0, 1, 2]), array([1, 0, 3]))
    """
    n = len(columns[0])
    if n and all((c == c[0]).all() for c in columns):  # one group: most steps read one file
        return np.zeros(n, dtype=np.int64), np.zeros(1, dtype=np.int64)
    order = np.lexsort(columns[::-1])
    first = np.ones(len(order), dtype=bool)  # where a new group starts, in sorted order
    if len(order):
        first[1:] = np.logical_or.reduce([c[order][1:] != c[order][:-1] for c in columns])
    group = np.empty(len(order), dtype=np.int64)
    group[order] = np.cumsum(first) - 1
    return group, order[first]


if TYPE_CHECKING:  # the class answers every call of its role
    _role: type[ConstructorRole] = DataConstructor
