"""What a SourceLoader measures while it reads: counts, and the costs the autoscaler uses.

``records`` (every record of the files it read: good, empty and bad), ``empty``
(blank texts, or texts that give no token: not samples), ``skipped`` (bad
records, under ``on_error: skip``) and ``dropped`` (too long, ``long_docs:
drop``) count each part of a file once, the first time the loader reads it,
whatever the epochs. ``read_retries`` counts the transient read errors
retried (:mod:`overlord.sources.remote`). Not thread-safe: the loader's lock guards every call.
"""

from __future__ import annotations

import os
from typing import Any

from overlord.sources.remote import Retries
from overlord.sources.shard import ShardItems
from overlord.sources.window import Window

COST_EMA = 0.2  # weight of the newest piece in the moving averages of its costs
EXAMPLES = 20  # bad records kept as examples


class ReadStats:
    """Counts and moving averages of one loader's reading."""

    def __init__(self, retries: Retries | None = None) -> None:
        self.retries = retries or Retries()  # counts the reads retried (read_retries)
        self.counts: dict[str, Any] = {
            "shards": 0,
            "items": 0,
            "tokens": 0,
            "read_s": 0.0,
            "records": 0,
            "empty": 0,
            "skipped": 0,
            "dropped": 0,
        }
        self._cost: dict[str, float] = {}
        self._examples: list[str] = []
        self._counted: set[tuple[str, int, int]] = set()  # (file, window, piece) counted

    @property
    def tokens_per_byte(self) -> float:
        """Tokens per byte of text (a guess of 1, the bytes tokenizer's, before a piece)."""
        return self._cost.get("tokens_per_byte", 1.0)

    def window(self, name: str, window: Window) -> None:
        """A window of file ``name`` was read."""
        if (name, window.number, -1) in self._counted:
            return
        self._counted.add((name, window.number, -1))
        c = self.counts
        c["records"] += window.records
        c["empty"] += window.empty
        c["skipped"] += len(window.skipped)
        self._examples += [str(e) for e in window.skipped[: max(0, EXAMPLES - len(self._examples))]]

    def piece(
        self, name: str, window: int, lo: int, items: ShardItems, kept: int, tokens: int, cpu: float
    ) -> None:
        """A piece (records ``lo ..`` of a window) was tokenized: ``kept`` items not consumed."""
        c = self.counts
        c["items"] += kept
        c["tokens"] += tokens
        c["read_s"] += cpu
        # moving averages of what a token and a sample cost to read, decode and tokenize
        # (the autoscaler's measure), and of tokens per byte of text (the budget's estimate)
        for key, value in (
            ("s_per_token", cpu / max(1, int(items.length.sum()))),
            ("s_per_sample", cpu / max(1, len(items))),
            ("tokens_per_byte", len(items.tokens) / max(1, items.text_bytes)),
        ):
            old = self._cost.get(key)
            self._cost[key] = value if old is None else old + COST_EMA * (value - old)
        if (name, window, lo) not in self._counted:
            self._counted.add((name, window, lo))
            c["empty"] += items.empty
            c["dropped"] += items.dropped
            c["skipped"] += len(items.skipped)  # images that cannot be decoded or fit no row
            room = max(0, EXAMPLES - len(self._examples))
            self._examples += [str(e) for e in items.skipped[:room]]

    def as_dict(self) -> dict[str, Any]:
        """The counts, the costs per token and per sample, and examples of bad records."""
        return {
            **self.counts,
            "read_retries": self.retries.count,
            "cpu_s_per_token": self._cost.get("s_per_token", float("nan")),
            "cpu_s_per_sample": self._cost.get("s_per_sample", float("nan")),
            "tokens_per_byte": self.tokens_per_byte,
            "skipped_examples": list(self._examples),
        }


def rss() -> int:
    """Resident memory of this process (the loader's, when it has a process of its own)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
