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
    samples: list[Sample]
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
        return int(sum(s.tokens for s in self.samples))

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
