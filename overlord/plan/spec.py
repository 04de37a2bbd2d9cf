"""The declarative data plan: what a user writes, validated on load.

A plan is a YAML file or a Python object. Validation reports every problem at
once, each with its field path (``mixture.schedule[1].weights.wbe``): the
schema's, and the rules between fields (:mod:`overlord.plan.rules`). What only
the files can tell (a glob that matches nothing) is checked by
:func:`overlord.load_plan`, above this pure layer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)

from overlord.errors import PlanError
from overlord.plan.kinds import (
    BalanceMethod,
    Format,
    Interpolation,
    LongDocs,
    LossOn,
    OnError,
    TokenDtype,
    TokenizerKind,
)
from overlord.plan.plan_file import read_plan_file
from overlord.plan.quarantine import QuarantineSpec
from overlord.plan.rules import semantic_problems
from overlord.plan.settings import (
    AutoscaleSpec,
    LoadingSpec,
    MonitoringSpec,
    PlacementSpec,
    RecoverySpec,
    TransformsSpec,
    _Model,
)
from overlord.plan.vision import Modules, VisionSpec
from overlord.world import CPLayout, World


class SourceSpec(_Model):
    """One data source: a set of shards in one format."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="unique name")
    path: str | list[str] = Field(description="glob(s), relative to the plan's folder, or URLs")
    format: Format = Field(
        description="jsonl (also .jsonl.gz / .jsonl.zst) | parquet | webdataset (image-text) | "
        "tokens (flat token arrays: .npy, or raw .bin with dtype) | megatron (.idx + .bin) | "
        "chat (conversations: JSONL, or Parquet for .parquet files, rendered by the "
        "tokenizer's chat template; docs: guides/chat)"
    )
    text_field: str = Field(
        "text",
        description="the record's text: a JSON field, a Parquet column, or a webdataset "
        "member's extension (else that field of the sample's .json); chat: the field of "
        "the messages, 'messages' unless given",
    )
    loss_on: LossOn = Field(
        LossOn.ASSISTANT,
        description="chat: the tokens whose labels are kept: assistant (the assistant "
        "turns', as the chat template marks them; every other label is -100) | all",
    )
    image_field: str | None = Field(
        None,
        description="parquet: a binary column of encoded images; webdataset: the image "
        "members' extension(s), ';' between them (default jpg;jpeg;png;webp)",
    )
    dtype: TokenDtype | None = Field(
        None,
        description="tokens: the ids' integer type of raw .bin files (a .npy file's header "
        "says it; given, it must agree)",
    )
    eos_id: int | None = Field(
        None,
        ge=0,
        description="tokens: the id that ends a document (it belongs to the document it ends; "
        "a trailing run without it is the last document)",
    )
    loaders: int = Field(1, ge=1, description="SourceLoaders that share this source's shards")
    transform: str | None = Field(
        None,
        description="module:function applied to each record's text (str -> str) before "
        "tokenizing, on the SourceLoader (e.g. overlord.sources.transforms:zlib_json)",
    )
    shadows: int | None = Field(
        None,
        ge=0,
        description="hot standby replicas per SourceLoader, which take over when it dies "
        "(default: 0 on the inline runtime, 1 on Ray)",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec's options for the source's URLs (e.g. s3: endpoint_url, key, "
        "secret, anon); not part of any fingerprint: they say how to reach the data, not which",
    )


class TokenizerSpec(_Model):
    """The tokenizer every source goes through."""

    kind: TokenizerKind = Field(
        TokenizerKind.BYTES,
        description="bytes: UTF-8 bytes (ids 0-255), end of document 256, padding 257; "
        "hf: a tokenizers tokenizer.json",
    )
    path: str | None = Field(None, description="tokenizer.json, for kind hf")
    eos: str | None = Field(None, description="hf: token appended to every document")
    chat_template: str | None = Field(
        None,
        description="chat sources: a Jinja chat template file, relative to the plan's folder "
        "(default: the chat_template of the tokenizer_config.json beside path)",
    )


class SchedulePoint(_Model):
    """Mixture weights (shares of tokens) from ``step`` on."""

    step: int = Field(ge=0, description="the step these weights hold from")
    weights: dict[str, float] = Field(
        description="source name -> weight, a share of tokens (normalized over the sources)"
    )

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, w in v.items() if not w >= 0]
        if bad:
            raise ValueError(f"weights must be >= 0, found {', '.join(f'{k}={v[k]}' for k in bad)}")
        if v and sum(v.values()) <= 0:
            raise ValueError("weights must not all be zero")
        return v


class AdaptPolicy(str, Enum):
    """How reported losses move the mixture (:mod:`overlord.plan.refit`)."""

    # exponentiated gradient on each source's relative excess loss: DoReMi (Xie et al. 2023,
    # arXiv 2305.10429) and Online Data Mixing (Albalak et al. 2023, arXiv 2312.02406)
    EXP_GRADIENT = "exp_gradient"


class AdaptSpec(_Model):
    """Weights that move from the trainers' reported losses (the schedule is the prior)."""

    policy: AdaptPolicy = Field(
        AdaptPolicy.EXP_GRADIENT,
        description="exp_gradient: each source's log-weight grows by eta times its mean "
        "reported loss over the mixture's mean loss, minus one (DoReMi, Online Data Mixing)",
    )
    every: int = Field(ge=1, description="adapt every this many steps, from the reports since")
    eta: float = Field(
        1.0, gt=0, description="step size of the exponentiated-gradient rule (per adaptation)"
    )
    floor: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="no source's weight goes below this share (a source the schedule gives "
        "0 stays at 0)",
    )
    bounds: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="source name -> [min, max] share the adapted weight stays within",
    )
    smoothing: float = Field(
        0.0,
        ge=0,
        le=1,
        description="the adapted weights mixed with this share of the schedule's (DoReMi "
        "smooths toward uniform; here toward the prior)",
    )

    @field_validator("bounds")
    @classmethod
    def _bounds(cls, v: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        bad = [k for k, (lo, hi) in v.items() if not 0 <= lo <= hi <= 1]
        if bad:
            raise ValueError(
                "each bound must be [min, max] with 0 <= min <= max <= 1, found "
                + ", ".join(f"{k}={list(v[k])}" for k in bad)
            )
        return v


class MixtureSpec(_Model):
    """A curriculum: weights at schedule points, interpolated between them."""

    interpolation: Interpolation = Field(
        Interpolation.LINEAR,
        description="linear: weights move linearly between schedule points; step: each "
        "point's weights hold until the next",
    )
    schedule: list[SchedulePoint] = Field(
        min_length=1, description="the weights at schedule points, in step order"
    )
    adapt: AdaptSpec | None = Field(
        None,
        description="move the weights from the trainers' reported losses (off by default; "
        "see the feedback guide)",
    )


class BatchSpec(_Model):
    """Shape of one optimizer step."""

    tokens_per_step: int = Field(gt=0, description="global token budget of one step")
    max_seq_len: int = Field(gt=0, description="capacity of one packed row")
    long_docs: LongDocs = Field(
        LongDocs.SPLIT,
        description="a document longer than max_seq_len: split into chunks of max_seq_len, "
        "truncate (cut), or drop (skipped and counted)",
    )
    lookahead: int = Field(
        64, ge=1, description="items a source may skip over to fill a row; bounds the carry-over"
    )
    prefetch_steps: int = Field(2, ge=1, description="steps planned and built ahead")
    cp_layout: CPLayout | None = Field(
        None,
        description="how a DP rank's rows are cut among its CP ranks: zigzag | per_document "
        "(default per_document when world.cp > 1; unset with cp: dynamic, which cuts per "
        "document for its own degree; overlord.batch.cp, overlord.batch.cp_dynamic)",
    )


class ModelShape(_Model):
    """A dense transformer, for deriving the cost model."""

    params: float = Field(gt=0, description="parameters N (alpha = 6 N)")
    layers: int = Field(gt=0, description="layers l (beta = 6 l h for causal attention)")
    hidden: int = Field(gt=0, description="hidden size h")
    attention_factor: float = Field(
        1.0,
        gt=0,
        description="time per FLOP of attention over that of the matmuls (FlashAttention's "
        "varlen kernels measured 2.0 on an H200 in bf16: benchmarks/cost_fit.py)",
    )


class CostSpec(_Model):
    """Cost of a document of L tokens: ``alpha * L + beta * L**2`` (plus image terms)."""

    alpha: float | None = Field(None, ge=0, description="cost per token of a document")
    beta: float | None = Field(
        None, ge=0, description="cost per squared token count of a document (attention)"
    )
    model: ModelShape | None = Field(
        None, description="derive alpha and beta from a dense transformer's shape instead"
    )
    patch_alpha: float = Field(0.0, ge=0, description="encoder cost per image patch")
    patch_beta: float = Field(0.0, ge=0, description="encoder cost per squared patch count")
    encoder: ModelShape | None = Field(
        None, description="the vision encoder: patch_alpha = 6 params, patch_beta = 6 layers hidden"
    )


class RefitSpec(_Model):
    """Refit the cost model from the trainers' reported step times."""

    every: int = Field(ge=1, description="refit every this many steps")
    window: int = Field(
        64, ge=1, description="fit on the reports of the last this many reported steps"
    )
    min_samples: int = Field(
        8, ge=2, description="refit only with at least this many (step, rank) reports"
    )


class BalanceSpec(_Model):
    """How each step is balanced across DP ranks."""

    method: BalanceMethod = Field(
        BalanceMethod.KK,
        description="kk (Karmarkar-Karp) | lpt | none (each rank a block of packed rows, "
        "as a per-rank loader does)",
    )
    cost: CostSpec = Field(
        CostSpec(alpha=1.0, beta=0.0), description="the cost model the balancer balances"
    )
    group_ranks: int = Field(
        256,
        ge=1,
        description="DP ranks balanced together: past this many, a step's rows are split "
        "over groups of at most this many ranks, balanced in parallel (which samples form "
        "a step never depends on it; which rank gets them does)",
    )
    modules: Modules = Field(
        Modules.HYBRID, description="hybrid: encoder + LLM cost; llm: the LLM's alone"
    )
    refit: RefitSpec | None = Field(
        None,
        description="refit alpha and beta from the trainers' reported step times (off by "
        "default; beta/alpha stays within 1/16..16 times the plan's)",
    )


class ShuffleSpec(_Model):
    """How a shard's records are ordered while it streams (the rule: the docs' order concepts).

    A shard is read in *blocks* (the lines that start in ``block_bytes`` of a
    JSONL file, a row group of a Parquet file); the records of
    ``window_blocks`` blocks are permuted together. A loader holds a window's
    text, never a whole shard.
    """

    block_bytes: int = Field(
        1 << 20, ge=256, description="bytes of a JSONL file (decompressed) in one block"
    )
    window_blocks: int = Field(8, ge=1, description="blocks whose records are permuted together")


class Plan(_Model):
    """A whole data plan. Build one with :func:`load_plan` or ``Plan.model_validate``."""

    seed: int = Field(0, description="the seed every permutation of the order is drawn from")
    sources: list[SourceSpec] = Field(min_length=1, description="the data sources")
    tokenizer: TokenizerSpec = Field(
        TokenizerSpec(), description="the tokenizer every source goes through"
    )
    mixture: MixtureSpec | None = Field(
        None, description="how the sources mix over training (default: equal shares of tokens)"
    )
    batch: BatchSpec = Field(description="the shape of one optimizer step")
    world: World = Field(World(), description="the trainer's mesh: dp, cp, tp, pp and order")
    balance: BalanceSpec = Field(
        BalanceSpec(), description="how each step is balanced across DP ranks"
    )
    on_error: OnError = Field(
        OnError.FAIL,
        description="a bad record: fail (a SourceError naming it) or skip (counted and reported)",
    )
    shuffle: ShuffleSpec = Field(
        ShuffleSpec(), description="how a shard streams (part of the order)"
    )
    loading: LoadingSpec = Field(LoadingSpec(), description="how SourceLoaders read")
    placement: PlacementSpec = Field(
        PlacementSpec(), description="where roles run and what they reserve (Ray runtime)"
    )
    recovery: RecoverySpec = Field(
        RecoverySpec(), description="the planner's journal, for restarts and rewinds"
    )
    autoscale: AutoscaleSpec = Field(
        AutoscaleSpec(), description="sizing each source's loaders (on when cpus is set)"
    )
    monitoring: MonitoringSpec = Field(MonitoringSpec(), description="the Prometheus endpoint")
    transforms: TransformsSpec = Field(
        TransformsSpec(), description="whether sources may name code outside overlord's own"
    )
    vision: VisionSpec | None = Field(
        None, description="how images become patches and tokens (image-text sources)"
    )
    quarantine: QuarantineSpec | None = Field(
        None,
        description="samples and files skipped from a step on, as if absent from their source "
        "(kept in the state: a resume keeps it)",
    )

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _fingerprints: dict[str, str] = PrivateAttr(default_factory=dict)  # a frozen plan's
    _stream_fingerprint: str | None = PrivateAttr(None)  # made once (every state holds it)

    @property
    def base_dir(self) -> Path:
        """Folder that relative source paths are resolved against (the plan file's)."""
        return self._base_dir

    @property
    def rows_per_step(self) -> int:
        """Packed rows of ``max_seq_len`` tokens in one global step."""
        return self.batch.tokens_per_step // self.batch.max_seq_len

    @property
    def rows_per_rank(self) -> int:
        """Rows each DP rank receives per step."""
        return self.rows_per_step // self.world.dp

    @property
    def source_names(self) -> list[str]:
        """Source names in plan order."""
        return [s.name for s in self.sources]

    def with_dp(self, dp: int) -> Plan:
        """The same plan for another DP size (validated again)."""
        data = self.model_dump(mode="json")
        data["world"]["dp"] = dp
        return validate_plan(data, base_dir=self._base_dir)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Plan:
        """A copy (pydantic's), with the fingerprints made again: ``update`` may change them."""
        copy = super().model_copy(update=update, deep=deep)
        copy._fingerprints, copy._stream_fingerprint = {}, None
        return copy

    def stream_fingerprint(self) -> str:
        """Hash of every field that decides which samples form each step.

        The world and the balance method are left out: they decide only who
        gets a sample, so a checkpoint resumes across them (elastic resume).
        """
        if self._stream_fingerprint is None:
            self._stream_fingerprint = self._hash_of_stream()
        return self._stream_fingerprint

    def _hash_of_stream(self) -> str:
        data = self.model_dump(
            mode="json",
            exclude={
                *("world", "balance", "loading", "placement", "recovery", "autoscale"),
                *("monitoring", "transforms"),
                "quarantine",  # the state records it, with the step it applies from
            },
        )
        for s in data["sources"]:
            s.pop("loaders")
            s.pop("shadows")
            s.pop("storage_options")
            s.pop("loss_on")  # which labels are kept: not which samples form a step
            for key in ("image_field", "dtype", "eos_id"):
                if s[key] is None:  # unset: a text plan's fingerprint stays as it was
                    s.pop(key)
        if data["vision"] is None:
            data.pop("vision")
        if data["mixture"] is not None and data["mixture"]["adapt"] is None:
            data["mixture"].pop("adapt")  # unset: the fingerprint stays as it was
        if data["tokenizer"]["chat_template"] is None:  # unset: the fingerprint stays as it was
            data["tokenizer"].pop("chat_template")
        data["batch"].pop("cp_layout")  # who gets which slice, like the world: not the stream
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def source_fingerprint(self, name: str) -> str:
        """Hash of what decides one source's items and their order (checked on resume).

        The hash of :meth:`source_recipe`. The source's files are not in it: the
        state records them, and a resume checks them file by file
        (:mod:`overlord.sources.catalog`).
        """
        if name in self._fingerprints:
            return self._fingerprints[name]
        self._fingerprints[name] = fingerprint_of(self.source_recipe(name))
        return self._fingerprints[name]

    def source_recipe(self, name: str) -> dict[str, Any]:
        """What decides one source's items and their order, as plain data.

        Keys: ``seed``, ``source`` (its fields, ``loaders``, ``shadows`` and
        ``storage_options`` left out), ``tokenizer`` (text sources),
        ``max_seq_len``, ``long_docs``, ``on_error``, ``shuffle``, and ``vision``
        for image sources. A resume with another plan compares it field by field
        (:mod:`overlord.state.changes`).
        """
        spec = next(s for s in self.sources if s.name == name)
        # a field that is not set leaves the hash as it was before the field existed
        unset = {f for f in ("image_field", "dtype", "eos_id") if getattr(spec, f) is None}
        unset |= {"loaders", "shadows", "storage_options"}  # who reads, and how: not the items
        unset.add("loss_on")  # which labels are kept: not the items nor their order
        data: dict[str, Any] = {
            "seed": self.seed,
            "source": spec.model_dump(mode="json", exclude=unset),
            "tokenizer": self.tokenizer.model_dump(
                mode="json",
                exclude={"chat_template"} if self.tokenizer.chat_template is None else set(),
            ),
            "max_seq_len": self.batch.max_seq_len,
            "long_docs": self.batch.long_docs.value,
            "on_error": self.on_error.value,
            "shuffle": self.shuffle.model_dump(mode="json"),
        }
        if self.vision is not None and (spec.format is Format.WEBDATASET or spec.image_field):
            data["vision"] = self.vision.model_dump(mode="json")
        if spec.format.pretokenized:
            del data["tokenizer"]  # the plan's tokenizer reads text sources only
        return data


def fingerprint_of(data: Any) -> str:
    """The 16 hex digits of the sha256 of ``data``'s canonical JSON (a recipe's fingerprint)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validate_plan(
    data: Any,
    base_dir: str | Path | None = None,
    origin: str | None = None,
) -> Plan:
    """Validate a plan from plain data (a dict as read from YAML) or a Plan.

    Raises :class:`PlanError` listing every problem with its field path: schema
    problems and problems between fields, all in one message. This is the plan
    document alone; :func:`overlord.validate_plan` checks the sources' files too.
    """
    if isinstance(data, Plan):
        plan: Plan | None = data
        raw = data.model_dump(mode="json")
    elif isinstance(data, dict):
        raw = data
        try:
            plan = Plan.model_validate(data)
        except ValidationError as e:
            plan = None
            problems = [(_loc(err["loc"]), err["msg"]) for err in e.errors()]
    else:
        raise PlanError([("", f"a plan is a mapping, found {type(data).__name__}")], origin)
    if plan is not None:
        problems = []
        raw = plan.model_dump(mode="json")
    problems += [p for p in semantic_problems(raw) if p not in problems]
    if problems or plan is None:
        raise PlanError(problems, origin)
    if base_dir is not None:
        plan._base_dir = Path(base_dir).resolve()
    return plan


def load_plan(path: str | Path) -> Plan:
    """Read, validate and return the plan in a YAML (or JSON) file: the document alone.

    Relative source paths are resolved against the file's folder.
    :func:`overlord.load_plan` also checks that every source's glob matches a file.
    """
    path = Path(path)
    return validate_plan(read_plan_file(path), base_dir=path.parent, origin=str(path))
