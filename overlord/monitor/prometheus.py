"""The Prometheus endpoint: the metric names (the contract), and a reading rendered as metrics.

:data:`METRICS` names every metric with its type and help; the docs' metric reference is made
from it. :class:`MetricsServer` serves, at each scrape, a reading of the planner's figures
(a plain dictionary: what ``overlord status`` prints too). ``prometheus_client`` is imported
only when a server starts (``pip install 'overlord-data[metrics]'``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from overlord.errors import LoaderError

# name -> (type, help); the names are the contract
METRICS: dict[str, tuple[str, str]] = {
    "overlord_steps_total": ("counter", "global steps consumed by every rank"),
    "overlord_tokens_total": ("counter", "tokens consumed by the trainers, per source"),
    "overlord_samples_total": ("counter", "samples (documents or chunks) consumed, per source"),
    "overlord_skipped_records_total": ("counter", "bad records skipped (on_error: skip)"),
    "overlord_epoch": ("gauge", "the epoch of the source the trainers consume (from 0)"),
    "overlord_share": ("gauge", "realized share of the tokens consumed so far"),
    "overlord_target_share": ("gauge", "the schedule's weight at the current step"),
    "overlord_rank_wait_seconds": ("histogram", "time a trainer waited in next()"),
    "overlord_plan_seconds": ("histogram", "time the planner took to plan a step"),
    "overlord_loaders": ("gauge", "SourceLoaders of the source's current partition"),
    "overlord_loader_threads": ("gauge", "reader threads of the source's loaders"),
    "overlord_buffered_tokens": ("gauge", "tokens read ahead and held by the source's loaders"),
    "overlord_reads_in_flight": ("gauge", "pieces being read and tokenized"),
    "overlord_failovers_total": ("counter", "roles replaced after they died"),
    "overlord_rank_cost_predicted": ("gauge", "cost-model cost of the rank's last consumed step"),
    "overlord_rank_step_seconds": ("gauge", "the rank's last measured step time (waits excluded)"),
    "overlord_rank_step_seconds_predicted": (
        "gauge",
        "the rank's last predicted cost times overlord_seconds_per_cost",
    ),
    "overlord_seconds_per_cost": (
        "gauge",
        "fitted seconds per unit of cost (least squares through 0 over every rank and step)",
    ),
    "overlord_read_retries_total": ("counter", "transient read errors retried, per source"),
    "overlord_cost_model_error": (
        "gauge",
        "relative error of the most loaded rank's predicted seconds on the last step every "
        "rank reported (client.report); NaN before",
    ),
    "overlord_refits_total": ("counter", "cost-model refits from the trainers' reports"),
    "overlord_quarantined_samples_total": (
        "counter",
        "quarantined samples skipped in the steps every rank consumed, per source",
    ),
}


def _families(f: dict[str, Any]) -> Iterator[Any]:
    """Prometheus metric families of one reading of the figures."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    def family(name: str, labels: list[str]) -> Any:
        kind, doc = METRICS[name]
        if kind == "counter":
            return CounterMetricFamily(name, doc, labels=labels)
        if kind == "gauge":
            return GaugeMetricFamily(name, doc, labels=labels)
        return HistogramMetricFamily(name, doc, labels=labels)

    steps = family("overlord_steps_total", [])
    steps.add_metric([], f["steps"])
    yield steps
    per_source = {
        "overlord_tokens_total": "tokens",
        "overlord_samples_total": "samples",
        "overlord_skipped_records_total": "skipped",
        "overlord_epoch": "epoch",
        "overlord_share": "share",
        "overlord_target_share": "target_share",
        "overlord_loaders": "loaders",
        "overlord_loader_threads": "threads",
        "overlord_buffered_tokens": "buffered_tokens",
        "overlord_reads_in_flight": "reads_in_flight",
        "overlord_read_retries_total": "retries",
        "overlord_quarantined_samples_total": "quarantined",
    }
    for name, key in per_source.items():
        fam = family(name, ["source"])
        for source, s in f["sources"].items():
            fam.add_metric([source], s[key])
        yield fam
    fails = family("overlord_failovers_total", ["role"])
    for role, count in f["failovers"].items():
        fails.add_metric([role], count)
    yield fails
    waits = family("overlord_rank_wait_seconds", ["rank"])
    for rank, h in enumerate(f["wait"]):
        buckets = [("+Inf" if math.isinf(b) else repr(float(b)), c) for b, c in h["buckets"]]
        waits.add_metric([str(rank)], buckets, h["sum"])
    yield waits
    plan = family("overlord_plan_seconds", [])
    h = f["plan"]
    buckets = [("+Inf" if math.isinf(b) else repr(float(b)), c) for b, c in h["buckets"]]
    plan.add_metric([], buckets, h["sum"])
    yield plan
    per_rank = {
        "overlord_rank_cost_predicted": "rank_cost",
        "overlord_rank_step_seconds": "rank_step_s",
        "overlord_rank_step_seconds_predicted": "rank_step_s_predicted",
    }
    for name, key in per_rank.items():
        fam = family(name, ["rank"])
        for rank, value in enumerate(f[key]):
            if not math.isnan(value):
                fam.add_metric([str(rank)], value)
        yield fam
    k = family("overlord_seconds_per_cost", [])
    if not math.isnan(f["seconds_per_cost"]):
        k.add_metric([], f["seconds_per_cost"])
    yield k
    error = family("overlord_cost_model_error", [])
    error.add_metric([], f.get("cost_model_error", math.nan))  # NaN until a step is reported
    yield error
    refits = family("overlord_refits_total", [])
    refits.add_metric([], f.get("refits", 0))
    yield refits


class _Collector:
    def __init__(self, read: Callable[[], dict[str, Any]]):
        self.read = read

    def collect(self) -> Iterator[Any]:
        yield from _families(self.read())


class MetricsServer:
    """A Prometheus endpoint on ``host:port`` (0: a free port) showing ``read()`` at each scrape.

    Its own registry (no process-wide state): two jobs in one process serve two endpoints.
    """

    def __init__(self, port: int, read: Callable[[], dict[str, Any]], host: str = "127.0.0.1"):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as e:
            raise LoaderError(
                "monitoring.port is set but prometheus_client is not installed: "
                "pip install 'overlord-data[metrics]' (or set monitoring.port: null)"
            ) from e
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(read))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise LoaderError(
                f"cannot serve metrics on {host}:{port}: {e}; choose another monitoring.port "
                "(0 picks a free one)"
            ) from e
        self.url = f"http://{host}:{self._server.server_port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
