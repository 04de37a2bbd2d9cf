"""The choices a plan's fields take: formats, tokenizers, interpolation, long documents, balance.

Enumerations only, so that the plan's models (:mod:`overlord.plan.spec`) and the rules
between its fields (:mod:`overlord.plan.rules`) name the same values.
"""

from __future__ import annotations

from enum import Enum


class Format(str, Enum):
    """On-disk format of a source's shards."""

    JSONL = "jsonl"
    PARQUET = "parquet"
    WEBDATASET = "webdataset"  # tar shards of samples: key.jpg|png|... beside key.txt|json
    TOKENS = "tokens"  # flat token arrays (.npy, or raw .bin with a dtype), documents end at eos
    MEGATRON = "megatron"  # Megatron-LM's indexed datasets: .idx + .bin pairs
    CHAT = "chat"  # conversations (JSONL or Parquet by extension), rendered by a chat template

    @property
    def pretokenized(self) -> bool:
        """Its shards hold token ids, not text: no tokenizer, no transform."""
        return self in (Format.TOKENS, Format.MEGATRON)


class LossOn(str, Enum):
    """Which tokens of a conversation (``format: chat``) the loss is on."""

    ASSISTANT = "assistant"  # the assistant turns' tokens, as the template marks them
    ALL = "all"  # every token, as a text source's


class TokenDtype(str, Enum):
    """The integer type of a raw token file's ids."""

    UINT16 = "uint16"
    UINT32 = "uint32"
    INT32 = "int32"


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
