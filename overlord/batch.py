"""What a trainer rank receives each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Sample(NamedTuple):
    """One document (or chunk) in a batch: where it came from and where it sits."""

    source: str
    id: str  # file relative to the plan's folder, ':', 0-based row, '#k' for the k-th chunk
    tokens: int
    row: int  # row of the batch that holds it


@dataclass
class Batch:
    """One DP rank's share of one step: ``rows`` packed rows of ``max_seq_len`` tokens.

    ``input_ids``, ``labels``, ``position_ids`` and ``segment_ids`` are int32
    arrays of shape ``(rows, max_seq_len)``; ``cu_seqlens`` (int32) holds the
    document boundaries over the flattened rows (see :mod:`overlord.plan.packing`).
    """

    step: int
    rank: int
    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    cu_seqlens: np.ndarray
    samples: list[Sample]
    cost: float  # the rank's cost under the plan's cost model

    @property
    def num_tokens(self) -> int:
        """Tokens of real documents (padding excluded)."""
        return int(sum(s.tokens for s in self.samples))

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors, by name."""
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": self.position_ids,
            "segment_ids": self.segment_ids,
            "cu_seqlens": self.cu_seqlens,
        }
