"""The declarative data plan: what a user writes, validated on load.

A plan is a YAML file or a Python object. Validation reports every problem at
once, each with its field path (``mixture.schedule[1].weights.wbe``), and
checks what only the files can tell (a glob that matches nothing) as well.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)

from overlord.errors import PlanError
from overlord.world import World


class Format(str, Enum):
    """On-disk format of a source's shards."""

    JSONL = "jsonl"
    PARQUET = "parquet"


class TokenizerKind(str, Enum):
    """``bytes``: UTF-8 bytes and an end-of-document id; ``hf``: a tokenizer.json file."""

    BYTES = "bytes"
    HF = "hf"


class Interpolation(str, Enum):
    """How mixture weights move between schedule points."""

    LINEAR = "linear"
    STEP = "step"


class LongDocs(str, Enum):
    """What to do with a document longer than ``max_seq_len`` tokens."""

    SPLIT = "split"
    TRUNCATE = "truncate"
    DROP = "drop"


class BalanceMethod(str, Enum):
    """How a step's samples are assigned to DP ranks."""

    KK = "kk"
    LPT = "lpt"
    NONE = "none"


class OnError(str, Enum):
    """What a bad record does: stop the run, or get skipped, counted and reported."""

    FAIL = "fail"
    SKIP = "skip"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class SourceSpec(_Model):
    """One data source: a set of shards in one format."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="unique name")
    path: str | list[str] = Field(description="glob(s), relative to the plan's folder, or URLs")
    format: Format
    text_field: str = "text"
    loaders: int = Field(1, ge=1, description="SourceLoaders that share this source's shards")


class TokenizerSpec(_Model):
    """The tokenizer every source goes through."""

    kind: TokenizerKind = TokenizerKind.BYTES
    path: str | None = Field(None, description="tokenizer.json, for kind hf")
    eos: str | None = Field(None, description="hf: token appended to every document")


class SchedulePoint(_Model):
    """Mixture weights (shares of tokens) from ``step`` on."""

    step: int = Field(ge=0)
    weights: dict[str, float]

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, w in v.items() if not w >= 0]
        if bad:
            raise ValueError(f"weights must be >= 0, found {', '.join(f'{k}={v[k]}' for k in bad)}")
        if v and sum(v.values()) <= 0:
            raise ValueError("weights must not all be zero")
        return v


class MixtureSpec(_Model):
    """A curriculum: weights at schedule points, interpolated between them."""

    interpolation: Interpolation = Interpolation.LINEAR
    schedule: list[SchedulePoint] = Field(min_length=1)


class BatchSpec(_Model):
    """Shape of one optimizer step."""

    tokens_per_step: int = Field(gt=0, description="global token budget of one step")
    max_seq_len: int = Field(gt=0, description="capacity of one packed row")
    long_docs: LongDocs = LongDocs.SPLIT
    lookahead: int = Field(
        64, ge=1, description="items a source may skip over to fill a row; bounds the carry-over"
    )
    prefetch_steps: int = Field(2, ge=1, description="steps planned and built ahead")


class ModelShape(_Model):
    """A dense transformer, for deriving the cost model."""

    params: float = Field(gt=0)
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)


class CostSpec(_Model):
    """Cost of a document of L tokens: ``alpha * L + beta * L**2`` (plus image terms)."""

    alpha: float | None = Field(None, ge=0)
    beta: float | None = Field(None, ge=0)
    model: ModelShape | None = None
    patch_alpha: float = Field(0.0, ge=0, description="encoder cost per image patch")
    patch_beta: float = Field(0.0, ge=0, description="encoder cost per squared patch count")


class BalanceSpec(_Model):
    """How each step is balanced across DP ranks."""

    method: BalanceMethod = BalanceMethod.KK
    cost: CostSpec = CostSpec(alpha=1.0, beta=0.0)


class LoadingSpec(_Model):
    """How source loaders read ahead."""

    threads: int = Field(1, ge=1, description="reader threads per SourceLoader")
    timeout_s: float = Field(300.0, gt=0, description="longest wait for a source before failing")


class Plan(_Model):
    """A whole data plan. Build one with :func:`load_plan` or ``Plan.model_validate``."""

    seed: int = 0
    sources: list[SourceSpec] = Field(min_length=1)
    tokenizer: TokenizerSpec = TokenizerSpec()
    mixture: MixtureSpec | None = None
    batch: BatchSpec
    world: World = World()
    balance: BalanceSpec = BalanceSpec()
    on_error: OnError = OnError.FAIL
    loading: LoadingSpec = LoadingSpec()

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

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

    def stream_fingerprint(self) -> str:
        """Hash of every field that decides which samples form each step.

        The world and the balance method are left out: they decide only who
        gets a sample, so a checkpoint resumes across them (elastic resume).
        """
        data = self.model_dump(mode="json", exclude={"world", "balance", "loading"})
        for s in data["sources"]:
            s.pop("loaders")
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def source_fingerprint(self, name: str) -> str:
        """Hash of what decides one source's items and their order (checked on resume)."""
        spec = next(s for s in self.sources if s.name == name)
        data = {
            "seed": self.seed,
            "source": spec.model_dump(mode="json", exclude={"loaders"}),
            "tokenizer": self.tokenizer.model_dump(mode="json"),
            "max_seq_len": self.batch.max_seq_len,
            "long_docs": self.batch.long_docs.value,
            "on_error": self.on_error.value,
        }
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


def _semantic_problems(plan: Plan) -> list[tuple[str, str]]:
    """Problems that involve several fields, all of them."""
    problems: list[tuple[str, str]] = []
    names = plan.source_names
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen:
            problems.append((f"sources[{i}].name", f"'{n}' is used by more than one source"))
        seen.add(n)

    b = plan.batch
    if b.tokens_per_step % b.max_seq_len:
        problems.append(
            (
                "batch.tokens_per_step",
                f"must be a whole number of rows of max_seq_len={b.max_seq_len} tokens, "
                f"found {b.tokens_per_step} ({b.tokens_per_step / b.max_seq_len:.3f} rows)",
            )
        )
    elif plan.rows_per_step % plan.world.dp:
        problems.append(
            (
                "world.dp",
                f"a step has {plan.rows_per_step} rows, which do not split evenly over "
                f"dp={plan.world.dp} ranks: choose tokens_per_step = k * dp * max_seq_len",
            )
        )

    if plan.mixture is not None:
        steps = [p.step for p in plan.mixture.schedule]
        for i in range(1, len(steps)):
            if steps[i] <= steps[i - 1]:
                problems.append(
                    (
                        f"mixture.schedule[{i}].step",
                        f"steps must increase, found {steps[i]} after {steps[i - 1]}",
                    )
                )
        for i, point in enumerate(plan.mixture.schedule):
            for name in point.weights:
                if name not in seen:
                    problems.append(
                        (
                            f"mixture.schedule[{i}].weights.{name}",
                            f"unknown source '{name}'; the plan's sources are {sorted(seen)}",
                        )
                    )
            if point.weights and not any(point.weights.get(n, 0) > 0 for n in seen):
                problems.append(
                    (f"mixture.schedule[{i}].weights", "gives no weight to any known source")
                )

    tok = plan.tokenizer
    if tok.kind is TokenizerKind.HF and not tok.path:
        problems.append(("tokenizer.path", "kind 'hf' needs the path of a tokenizer.json"))
    if tok.kind is TokenizerKind.BYTES and (tok.path or tok.eos):
        problems.append(("tokenizer", "kind 'bytes' takes no path or eos"))

    cost = plan.balance.cost
    direct = cost.alpha is not None or cost.beta is not None
    if cost.model is not None and direct:
        problems.append(("balance.cost", "give either alpha/beta or model, not both"))
    if cost.model is None and (cost.alpha is None or cost.beta is None):
        problems.append(("balance.cost", "give both alpha and beta, or model"))
    return problems


def validate_plan(data: Any, base_dir: str | Path | None = None, origin: str | None = None) -> Plan:
    """Validate a plan from plain data (a dict as read from YAML) or return a Plan as is.

    Raises :class:`PlanError` listing every problem with its field path.
    """
    if isinstance(data, Plan):
        plan = data
    else:
        if not isinstance(data, dict):
            raise PlanError([("", f"a plan is a mapping, found {type(data).__name__}")], origin)
        try:
            plan = Plan.model_validate(data)
        except ValidationError as e:
            problems = [(_loc(err["loc"]), err["msg"]) for err in e.errors()]
            raise PlanError(problems, origin) from None
    problems = _semantic_problems(plan)
    if problems:
        raise PlanError(problems, origin)
    if base_dir is not None:
        plan._base_dir = Path(base_dir).resolve()
    return plan


def load_plan(path: str | Path, check_files: bool = True) -> Plan:
    """Read, validate and return the plan in a YAML (or JSON) file.

    Relative source paths are resolved against the file's folder. With
    ``check_files`` every source's glob must match at least one file.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanError([("", f"cannot read the plan file: {e.strerror}")], str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PlanError([("", f"not valid YAML: {e}")], str(path)) from None
    plan = validate_plan(data, base_dir=path.parent, origin=str(path))
    if check_files:
        from overlord.sources.files import resolve_files

        problems = []
        for i, src in enumerate(plan.sources):
            try:
                resolve_files(src, plan.base_dir)
            except PlanError as e:
                problems += [(f"sources[{i}].path", msg) for _, msg in e.problems]
        if problems:
            raise PlanError(problems, str(path))
    return plan
