"""Monitoring: what the planner counts, and the Prometheus endpoint that shows it.

The planner keeps a :class:`Figures` (counters of consumed steps, histograms
of trainer waits and of planning time, each rank's predicted cost and
measured step time). :func:`planner_figures` adds, when asked, what it reads
from the pool and the loaders (loaders, threads, buffered tokens, reads in
flight, retries, failovers) and turns all of it into one plain dictionary:
what ``overlord status`` prints and what :class:`MetricsServer` exposes under
the metric names of :data:`METRICS` (the contract; see the README).

The figures are kept whether or not an endpoint is served; ``prometheus_client``
is imported only by :class:`MetricsServer` (``pip install 'overlord[metrics]'``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from overlord.errors import LoaderError
from overlord.roles.api import LoaderRole

if TYPE_CHECKING:
    from overlord.roles.planner import Planner

# upper bounds of the histograms' buckets, in seconds (+Inf is added)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0)  # fmt: skip
PLAN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 5.0)  # fmt: skip
COST_STEPS_KEPT = 1024  # steps whose per-rank predicted cost is kept to pair with step times

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
}


class Histogram:
    """Counts of observations under fixed bucket bounds, with their sum.

    Not thread-safe: :class:`Figures` updates and reads it under its lock.
    """

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in its bucket."""
        self.counts[int(np.searchsorted(self.bounds, value, side="left"))] += 1
        self.sum += value

    def as_dict(self) -> dict[str, Any]:
        """Cumulative buckets ``[[bound, count], ...]`` (the last bound ``inf``), count, sum."""
        cum = np.cumsum(self.counts).tolist()
        return {
            "buckets": [[b, c] for b, c in zip([*self.bounds, math.inf], cum)],
            "count": cum[-1],
            "sum": self.sum,
        }


class Figures:
    """What the planner counts for monitoring, updated on its thread, read on any."""

    def __init__(self, names: list[str], dp: int):
        self.names, self.dp = names, dp
        self._lock = threading.Lock()
        self.steps = 0
        self.tokens = np.zeros(len(names), dtype=np.int64)
        self.samples = np.zeros(len(names), dtype=np.int64)
        self.wait = [Histogram(WAIT_BUCKETS) for _ in range(dp)]
        self.plan = Histogram(PLAN_BUCKETS)
        self.cost = [math.nan] * dp  # predicted cost of each rank's last consumed step
        self.step_s = [math.nan] * dp  # each rank's last measured step time
        self._costs: dict[int, list[float]] = {}  # step -> per-rank cost, while it may be paired
        self._fit = [0.0, 0.0]  # sum of cost * seconds, sum of cost**2

    def planned(self, step: int, seconds: float, rank_costs: np.ndarray) -> None:
        """Step ``step`` was planned in ``seconds``; ``rank_costs`` is each rank's cost."""
        with self._lock:
            self.plan.observe(seconds)
            self._costs[step] = [float(c) for c in rank_costs]
            while len(self._costs) > COST_STEPS_KEPT:
                del self._costs[min(self._costs)]

    def consumed(self, source: np.ndarray, tokens: np.ndarray) -> None:
        """Every rank consumed a step whose items come from ``source`` with ``tokens`` each."""
        n = len(self.names)
        with self._lock:
            self.steps += 1
            self.tokens += np.bincount(source, weights=tokens, minlength=n).astype(np.int64)
            self.samples += np.bincount(source, minlength=n)

    def trainer(self, rank: int, step: int, train_s: float | None, wait_s: float | None) -> None:
        """DP rank ``rank`` received ``step`` after waiting ``wait_s`` for it.

        ``train_s`` is its time on the step before (waits excluded), paired with
        that step's predicted cost for the fit; the client's measures, None where
        it has none.
        """
        with self._lock:
            if wait_s is not None and wait_s >= 0:
                self.wait[rank].observe(wait_s)
            costs = self._costs.get(step)
            if costs is not None:
                self.cost[rank] = costs[rank]
            before = self._costs.get(step - 1)
            if train_s is not None and train_s >= 0 and before is not None:
                self.step_s[rank] = train_s
                c = before[rank]
                self._fit[0] += c * train_s
                self._fit[1] += c * c

    def seconds_per_cost(self) -> float:
        """The least-squares slope through 0 of step time against predicted cost."""
        with self._lock:
            return self._fit[0] / self._fit[1] if self._fit[1] > 0 else math.nan

    def as_dict(self) -> dict[str, Any]:
        """The counters and histograms, as plain data."""
        k = self.seconds_per_cost()
        with self._lock:
            total = max(int(self.tokens.sum()), 1)
            return {
                "steps": self.steps,
                "tokens": dict(zip(self.names, self.tokens.tolist())),
                "samples": dict(zip(self.names, self.samples.tolist())),
                "share": {n: int(t) / total for n, t in zip(self.names, self.tokens.tolist())},
                "wait": [h.as_dict() for h in self.wait],
                "plan": self.plan.as_dict(),
                "rank_cost": list(self.cost),
                "rank_step_s": list(self.step_s),
                "rank_step_s_predicted": [c * k for c in self.cost],
                "seconds_per_cost": k,
            }


def planner_figures(planner: Planner) -> dict[str, Any]:
    """Everything monitoring shows, from the planner's figures, its pool and its loaders.

    Loader counters are asked of the current primaries; a loader that cannot
    answer (dying, being replaced) is left out of this reading.
    """
    out = planner.figures.as_dict()
    names = planner.names
    pool = planner.pool
    stats: list[dict[str, Any]] = []
    for n in names:
        for k, h in enumerate(list(pool.primaries(n))):
            if h is None:
                continue
            try:
                s = h.call(LoaderRole.stats).result(timeout=10)
            except Exception:  # noqa: BLE001 - a dying loader: left out of this reading
                continue
            stats.append({**s, "slot": k})
    weights = np.asarray(planner.schedule.weights(planner.done + 1), dtype=np.float64)
    weights = weights / max(float(weights.sum()), 1e-300)
    sources: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(names):
        current = set(pool.current(n))
        mine = [s for s in stats if s["source"] == n]
        sources[n] = {
            "tokens": out["tokens"][n],
            "samples": out["samples"][n],
            "share": out["share"][n],
            "target_share": float(weights[i]),
            "epoch": int(planner.epoch_of(n)),
            "loaders": len(current),
            "threads": sum(int(s["threads"]) for s in mine if s["slot"] in current),
            "buffered_tokens": sum(int(s.get("held_tokens", 0)) for s in mine),
            "reads_in_flight": sum(int(s.get("reads_in_flight", 0)) for s in mine),
            "skipped": sum(int(s.get("skipped", 0)) for s in mine),
            "retries": sum(int(s.get("read_retries", 0)) for s in mine),
        }
    events = list(pool.events)
    out["sources"] = sources
    out["failovers"] = {
        "loader": sum(e.get("event") == "failover" for e in events),
        "planner": sum(e.get("event") == "planner-recovered" for e in events),
    }
    out["consumed"] = list(planner.consumed)
    out["next_step"] = planner.next_step
    return out


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
                "pip install 'overlord[metrics]' (or set monitoring.port: null)"
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
