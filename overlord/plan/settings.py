"""How a plan runs: reading, recovery, autoscaling, monitoring, placement.

None of these settings changes which samples form a step (they are left out
of the plan's stream fingerprint); :mod:`overlord.plan.spec` holds the rest of
the plan and re-exports these.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class LoadingSpec(_Model):
    """How source loaders read ahead."""

    threads: int = Field(1, ge=1, description="reader threads per SourceLoader")
    timeout_s: float = Field(300.0, gt=0, description="longest wait for a source before failing")
    retries: int = Field(
        5,
        ge=0,
        description="retries of a transient read error of a URL (throttling, 5xx, a reset "
        "connection), with exponential backoff, before the error names the URL",
    )
    max_record_bytes: int = Field(
        64 << 20,
        ge=1024,
        description="the largest record read, in bytes (a JSONL line, plain or compressed; a "
        "Parquet cell, judged by its page; a tar member): a larger one is a bad record named "
        "by file and row (on_error decides), never held; protects a machine from one huge "
        "record",
    )


class RecoverySpec(_Model):
    """How the planner journals its state, so that a restarted planner resumes exactly."""

    journal_dir: str | None = Field(
        None,
        description="folder of the planner's journal (default: a temporary folder, removed "
        "when the job closes); on a cluster, storage the planner's next node can read",
    )
    snapshot_every: int = Field(
        100, ge=1, description="steps between full snapshots; one small delta per step between"
    )
    rewind_steps: int = Field(
        0,
        ge=0,
        description="consumed steps whose items stay held after the newest checkpoint handed "
        "out, so that trainers restarting from it (overlord.connect(..., state=)) are served "
        "from memory; a speed and memory knob: a rewind to any state of the job works without "
        "it (the loaders read again what they released); each loader's read-ahead budget "
        "grows by as much",
    )
    fsync: bool = Field(
        False,
        description="fsync every journal record (survives a machine crash, not only a "
        "killed process)",
    )


class AutoscaleSpec(_Model):
    """Sizing every source's loaders to its cost and share (on when ``cpus`` is given)."""

    cpus: float | None = Field(
        None,
        gt=0,
        description="CPU cores all SourceLoaders' readers may burn together at the schedule's "
        "peak demand (an idle loader burns none; loaders cost memory)",
    )
    memory_gb: float | None = Field(None, gt=0, description="memory all SourceLoaders may use")
    every: int = Field(10, ge=1, description="steps between decisions")
    max_threads_per_loader: int = Field(4, ge=1, description="most reader threads of one loader")
    min_loaders: int = Field(1, ge=1, description="fewest SourceLoaders of a source")
    thread_efficiency: float = Field(
        1.0,
        ge=0,
        le=1,
        description="what a loader's second thread adds, as a share of its first (near 0 "
        "where decoding holds Python's GIL)",
    )
    headroom: float = Field(1.25, ge=1, description="capacity kept above demand")
    cooldown_steps: int = Field(
        20, ge=0, description="how long demand must stay low before a source shrinks"
    )
    horizon_steps: int = Field(50, ge=0, description="steps of the schedule looked ahead")


class MonitoringSpec(_Model):
    """The Prometheus endpoint (``pip install 'overlord-data[metrics]'``)."""

    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve metrics on 127.0.0.1:port (0: a free port; null: no endpoint)",
    )


class TransformsSpec(_Model):
    """Whether the plan may name code: transforms other than overlord's own.

    A source's ``transform: module:function`` imports ``module`` and calls the function on
    every record, in the loader's process. overlord's own transforms
    (:data:`overlord.plan.rules.BUILTIN_TRANSFORMS`) are always allowed; any other one only
    with ``allow_imports: true``, so that a plan from elsewhere runs no code its user did not
    consent to.
    """

    allow_imports: bool = Field(
        False,
        description="let sources name transforms outside overlord's own (module:function): "
        "the plan then imports and runs that code on every record; off, such a plan is refused",
    )


class LoaderPlacement(str, Enum):
    """Where Ray puts SourceLoaders: Ray's default packing, or spread over nodes."""

    DEFAULT = "default"
    SPREAD = "spread"


class ConstructorSite(str, Enum):
    """Where a DataConstructor runs: its own actor, or inside the trainer process it feeds."""

    ACTOR = "actor"
    TRAINER = "trainer"


class PlacementSpec(_Model):
    """Where roles run and what they reserve (Ray runtime)."""

    loader_cpus: float = Field(0.0, ge=0, description="CPUs reserved per SourceLoader actor")
    planner_cpus: float = Field(0.0, ge=0, description="CPUs reserved for the Planner actor")
    constructor_cpus: float = Field(
        0.0, ge=0, description="CPUs reserved per DataConstructor actor"
    )
    loader_strategy: LoaderPlacement = Field(
        LoaderPlacement.DEFAULT,
        description="default: Ray's packing; spread: SourceLoaders over nodes",
    )
    loader_nodes: dict[str, str] = Field(
        default_factory=dict, description="source name -> Ray node id its loaders must run on"
    )
    ranks_per_constructor: int | None = Field(
        None,
        ge=1,
        description="DP ranks one DataConstructor serves (e.g. the GPUs of a node), which it "
        "builds a step at a time in one pass (plans without images); default: one on Ray, "
        "every rank embedded",
    )
    loader_processes: int | None = Field(
        None,
        ge=1,
        description="processes that hold the job's SourceLoaders (default: one per loader); "
        "fewer saves a process's fixed memory per loader",
    )
    assigners: int | None = Field(
        None,
        ge=0,
        description="actors that balance a step's groups of ranks in parallel (default: one "
        "per group, at most 16, on Ray; none embedded); 0: the planner balances them itself",
    )
    constructors: ConstructorSite = Field(
        ConstructorSite.ACTOR,
        description="actor: DataConstructors are actors; trainer: each trainer builds its own "
        "batches from the loaders (one hop and one process fewer per batch)",
    )
