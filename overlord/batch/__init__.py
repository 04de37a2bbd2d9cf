"""What a trainer rank receives each step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class Sample(NamedTuple):
    """One document (or chunk) in a batch: where it came from and where it sits."""

    source: str
    id: str  # file relative to the plan's folder, ':', 0-based row, '#k' for the k-th chunk
    tokens: int
    row: int  # row of the batch that holds it


class Samples(Sequence[Sample]):
    """A batch's sample records, to be made when first read.

    A step has a record per document, and most training loops never read
    them: the constructor hands over a function that makes records
    ``lo:hi`` of the step's, with their token counts, and :attr:`Batch.samples`
    makes them (a list) on its first read; ``num_tokens`` needs none. A pickle
    of it (a batch sent to another process) is the list.

    >>> s = Samples(lambda lo, hi: [Sample("a", f"f:{i}", 2, 0) for i in range(lo, hi)],
    ...             np.array([2, 2, 2]))
    >>> len(s), s.tokens, s.part(1, 3).records()[0].id
    (3, 6, 'f:1')
    """

    __slots__ = ("_make", "_lengths", "_lo", "_hi")

    def __init__(
        self,
        make: Callable[[int, int], list[Sample]],
        lengths: np.ndarray,
        lo: int = 0,
        hi: int | None = None,
    ):
        self._make, self._lengths = make, lengths
        self._lo, self._hi = lo, len(lengths) if hi is None else hi

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, i: Any) -> Any:  # a Sequence's; Batch.samples is the list to index
        return self.records()[i]

    @property
    def tokens(self) -> int:
        """Tokens of these samples, without making their records."""
        return int(self._lengths[self._lo : self._hi].sum())

    def part(self, lo: int, hi: int) -> Samples:
        """Records ``lo:hi`` of these (a rank's of a step's), not made either."""
        return Samples(self._make, self._lengths, self._lo + lo, self._lo + hi)

    def records(self) -> list[Sample]:
        """The records, made now."""
        return self._make(self._lo, self._hi)

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.records(),))


class _Records:
    """``Batch.samples``: always a list when read.

    A batch given :class:`Samples` keeps them (in the instance's ``_samples``)
    and makes the list on the first read.
    """

    def __get__(self, obj: Any, objtype: Any = None) -> list[Sample]:
        if obj is None:
            raise AttributeError("samples")  # for dataclasses: the field has no default
        value = obj.__dict__["_samples"]
        if isinstance(value, Samples):
            value = obj.__dict__["_samples"] = value.records()
        return value

    def __set__(self, obj: Any, value: Sequence[Sample]) -> None:
        obj.__dict__["_samples"] = value


@dataclass
class Batch:
    """One DP rank's share of one step: ``rows`` packed rows of ``max_seq_len`` tokens.

    ``input_ids``, ``labels``, ``position_ids`` and ``segment_ids`` are int32
    arrays of shape ``(rows, max_seq_len)``; ``cu_seqlens`` (int32) holds the
    document boundaries over the flattened rows (see :mod:`overlord.batch.rows`).

    A rank of a device mesh (``Loader.rank_client``) receives its part of its DP
    rank's batch: with CP, its slice (``cp_rank`` of ``cp_size``, cut by
    ``cp_layout``, with ``global_positions``: each local token's index in the
    flattened unsliced batch, -1 for padding added for CP; see
    :mod:`overlord.batch.cp`; under ``cp: dynamic``, ``cp_layout`` is
    ``"dynamic"`` and ``cp_groups`` gives each local segment's CP sub-group,
    see :mod:`overlord.batch.cp_dynamic`); with PP, ``input_ids`` only on the first
    stage and ``labels`` only on the last (``None`` elsewhere).

    A plan with image sources adds ``pixel_values`` and ``image_grid``: the
    images of the batch's samples, in sample order (a sample has at most one).
    """

    step: int
    rank: int
    input_ids: np.ndarray | None
    labels: np.ndarray | None
    position_ids: np.ndarray
    segment_ids: np.ndarray
    cu_seqlens: np.ndarray
    samples: Sequence[Sample]  # a list when read (given as Samples: made when first read)
    cost: float  # the rank's cost under the plan's cost model
    global_positions: np.ndarray | None = None
    cp_layout: str | None = None  # zigzag | per_document | dynamic, None without CP
    cp_rank: int = 0
    cp_size: int = 1
    cp_groups: np.ndarray | None = None  # cp: dynamic: int32 (segments, 2), first rank, degree
    # images (image-text sources, overlord.sources.images): every CP rank gets all of them
    pixel_values: np.ndarray | None = None  # float32 (total patches, 3*p*p), in sample order
    image_grid: np.ndarray | None = None  # int32 (images, 2): (h1/p, w1/p) per image
    cost_llm: float | None = None  # the rank's LLM and encoder terms of ``cost`` (vision plans)
    cost_encoder: float | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of real documents (padding excluded) in the DP rank's whole batch."""
        records = self.__dict__["_samples"]  # not made for this
        if isinstance(records, Samples):
            return records.tokens
        return int(sum(s.tokens for s in records))

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors this rank holds, by name (a field that is ``None`` is left out)."""
        named = {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": self.position_ids,
            "segment_ids": self.segment_ids,
            "cu_seqlens": self.cu_seqlens,
            "global_positions": self.global_positions,
            "cp_groups": self.cp_groups,
        }
        return {k: v for k, v in named.items() if v is not None}


# after the dataclass is made, so that its fields stay as declared: a given Samples is kept
# as it is, and made into a list when ``samples`` is first read (num_tokens needs none)
Batch.samples = _Records()  # type: ignore[assignment]
