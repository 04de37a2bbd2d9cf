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


@dataclass(frozen=True)
class SampleColumns:
    """A step's sample records as columns: an array per field, names by index.

    Item ``i`` is a document (or a chunk of one) of source ``sources[source[i]]``,
    read from file ``files[file[i]]`` at 0-based row ``at[i]`` (or named by key,
    ``keys[i]``, where its source names samples so: a tar's), chunk ``chunk[i]``
    (-1: the whole document), with ``tokens[i]`` tokens, in row ``row[i]`` of its
    batch. A step's items come from a few files: ``files`` is short. Records are
    made from the columns only when read; processes hand the columns on as they
    are (:meth:`to_wire`, or a pickle), never the records.

    >>> c = SampleColumns(("web",), ("a.jsonl",), np.array([0, 0]), np.array([0, 0]),
    ...                   np.array([7, 9]), np.array([-1, 2]), np.array([5, 3]), np.array([0, 1]))
    >>> [tuple(s) for s in c.records(0, 2)]
    [('web', 'a.jsonl:7', 5, 0), ('web', 'a.jsonl:9#2', 3, 1)]
    >>> SampleColumns.from_wire(*c.to_wire()).records(1, 2) == c.records(1, 2)
    True
    """

    sources: Sequence[str]
    files: Sequence[str]
    source: np.ndarray
    file: np.ndarray
    at: np.ndarray
    chunk: np.ndarray
    tokens: np.ndarray
    row: np.ndarray
    keys: Sequence[str | None] | None = None

    def records(self, lo: int, hi: int) -> list[Sample]:
        """Records ``lo:hi``, made now."""
        names, files = self.sources, self.files
        keys = [None] * (hi - lo) if self.keys is None else self.keys[lo:hi]
        out = []
        for s, f, a, c, t, r, key in zip(
            self.source[lo:hi].tolist(), self.file[lo:hi].tolist(), self.at[lo:hi].tolist(),
            self.chunk[lo:hi].tolist(), self.tokens[lo:hi].tolist(), self.row[lo:hi].tolist(),
            keys,
        ):  # fmt: skip
            at = a if key is None else key
            out.append(Sample(names[s], f"{files[f]}:{at}" + ("" if c < 0 else f"#{c}"), t, r))
        return out

    def to_wire(self) -> tuple[dict[str, Any], np.ndarray]:
        """The columns for another process: the names (JSON-able) and one ``(6, n)`` int64 array.

        The array goes as arrays go (a batch's shared memory): a number in JSON
        costs more to read back than the record it stands for.
        """
        names = {
            "sources": list(self.sources),
            "files": list(self.files),
            "keys": None if self.keys is None else list(self.keys),
        }
        columns = (self.source, self.file, self.at, self.chunk, self.tokens, self.row)
        return names, np.stack(columns).astype(np.int64, copy=False)

    @classmethod
    def from_wire(cls, names: dict[str, Any], array: np.ndarray) -> SampleColumns:
        """The columns :meth:`to_wire` gave (views of ``array``)."""
        source, file, at, chunk, tokens, row = array
        keys = names["keys"]
        return cls(names["sources"], names["files"], source, file, at, chunk, tokens, row, keys)

    def part(self, lo: int, hi: int) -> SampleColumns:
        """Items ``lo:hi`` (the names as they are)."""
        return SampleColumns(
            self.sources, self.files, self.source[lo:hi], self.file[lo:hi], self.at[lo:hi],
            self.chunk[lo:hi], self.tokens[lo:hi], self.row[lo:hi],
            None if self.keys is None else self.keys[lo:hi],
        )  # fmt: skip


class Samples(Sequence[Sample]):
    """A batch's sample records, to be made when first read.

    A step has a record per document, and most training loops never read
    them: the constructor hands over a function that makes the step's
    :class:`SampleColumns` (once, when first asked), with each item's token
    count, and :attr:`Batch.samples` makes this batch's records (a list) on its
    first read; ``num_tokens`` needs neither. A pickle of it (a batch sent to
    another process) holds the columns.

    >>> c = SampleColumns(("a",), ("f",), *np.zeros((2, 3), np.int64), np.arange(3),
    ...                   np.full(3, -1), np.full(3, 2), np.zeros(3, np.int64))
    >>> s = Samples(lambda: c, c.tokens)
    >>> len(s), s.tokens, s.part(1, 3).records()[0].id
    (3, 6, 'f:1')
    """

    __slots__ = ("_columns", "_lengths", "_lo", "_hi")

    def __init__(
        self,
        columns: Callable[[], SampleColumns],
        lengths: np.ndarray,
        lo: int = 0,
        hi: int | None = None,
    ):
        self._columns, self._lengths = columns, lengths
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
        return Samples(self._columns, self._lengths, self._lo + lo, self._lo + hi)

    def columns(self) -> SampleColumns:
        """These records' columns: only they, not the step's."""
        return self._columns().part(self._lo, self._hi)

    def records(self) -> list[Sample]:
        """The records, made now."""
        return self._columns().records(self._lo, self._hi)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_from_columns, (self.columns(),))


def _from_columns(columns: SampleColumns) -> Samples:
    return Samples(lambda: columns, columns.tokens)


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


def samples_wire(batch: Batch) -> tuple[dict[str, Any], np.ndarray | None]:
    """A batch's records for another process, without making them (:meth:`SampleColumns.to_wire`).

    Where the batch holds them made (a list), they go as they are: ``({"records":
    [[source, id, tokens, row], ...]}, None)``.
    """
    samples = batch.__dict__["_samples"]
    if isinstance(samples, Samples):
        return samples.columns().to_wire()
    return {"records": [list(s) for s in samples]}, None


def samples_of_wire(names: dict[str, Any], array: np.ndarray | None) -> Sequence[Sample]:
    """The records :func:`samples_wire` gave: :class:`Samples`, made when first read, or a list."""
    if array is None:
        return [Sample(*r) for r in names["records"]]
    return _from_columns(SampleColumns.from_wire(names, array))
