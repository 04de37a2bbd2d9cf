"""Conversations (``format: chat``): messages rendered by a chat template, and the loss mask.

A chat record's field (``messages`` unless ``text_field`` names another) holds a list of
``{role, content}`` mappings; the readers hand it on as its JSON text
(:class:`overlord.sources.records.JsonField`). Here each record is rendered by the
tokenizer's chat template, as ``transformers``' ``apply_chat_template`` renders it (the same
Jinja options, filters and globals, ``add_generation_prompt`` false), in Jinja's
*immutable sandbox*: a template is data from the plan's files, and it cannot call into
Python beyond what the sandbox allows. The rendered text is tokenized with character
offsets, and a token is an *assistant token* when its characters overlap an assistant span
of the text (:func:`assistant_mask`). The spans (the rule, with examples, in the docs'
chat guide):

- a template with ``{% generation %} ... {% endgeneration %}`` blocks marks them: each
  block's output is a span (what ``return_assistant_tokens_mask`` uses);
- any other template: each assistant message's content, found in the rendered text in
  order (as it is, or stripped of white space when the template trims it), and, if the
  text goes on with the tokenizer's ``eos_token`` (white space between at most), up to
  the end of that token: the end of the turn, which the model must learn to produce.

The end-of-document token overlord appends (``tokenizer.eos``, the bytes tokenizer's 256)
is never an assistant token. With ``loss_on: all`` there is no mask: every label is kept,
as a text source's.
"""

from __future__ import annotations

import functools
import json
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from overlord.errors import PlanError
from overlord.plan.spec import LossOn, Plan, SourceSpec, TokenizerKind

MARKS = re.compile(r"\{%-?\s*generation\s*-?%\}")  # a template that marks its assistant output
SPECIAL_TOKENS = (  # what transformers passes a template: the tokenizer's special tokens
    *("bos_token", "eos_token", "unk_token", "pad_token"),
    *("sep_token", "cls_token", "mask_token"),
)


class ChatRecordError(ValueError):
    """A chat record that cannot be rendered: the reason, for the record's SourceError."""


@dataclass
class Rendered:
    """A conversation rendered: its text and its assistant spans ``[start, end)``, in order."""

    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)


class ChatTemplate:
    """A chat template compiled in Jinja's immutable sandbox, with its tokenizer's special tokens.

    ``where`` names the template's file (for errors); ``tokens`` are the special tokens a
    template reads (``bos_token``, ``eos_token``, ...), as ``tokenizer_config.json`` gives them.
    """

    def __init__(self, source: str, where: str, tokens: dict[str, str] | None = None):
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("format chat needs jinja2: pip install 'overlord-data[chat]'") from e
        self.where, self.tokens = where, dict(tokens or {})
        self.marked = MARKS.search(source) is not None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_generation_extension(), jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        # as transformers hardens them: no dunder names on a namespace, a dict() of its own.
        # No strftime_now: a template that reads the date would make the stream depend on it
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _namespace_class()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            problem = ("tokenizer.chat_template", f"{where}: not a Jinja template ({e})")
            raise PlanError([problem]) from None

    def render(self, messages: list[dict[str, Any]]) -> Rendered:
        """The conversation's text, and where its assistant's turns are in it."""
        import jinja2

        spans: list[tuple[int, int]] = []
        blocks: list[str] = []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self._template.generate(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=False,
                **self.tokens,
            ):
                blocks.append(block)
        except jinja2.TemplateError as e:  # raise_exception, or the sandbox refusing
            raise ChatRecordError(f"the chat template {self.where} refused it: {e}") from None
        except Exception as e:  # a template is code of the data's: its failure is the record's
            raise ChatRecordError(f"the chat template {self.where} failed on it: {e!r}") from None
        finally:
            _TRACKING.reset(token)
        text = "".join(blocks)
        if self.marked:
            return Rendered(text, [(a, b) for a, b in spans if b > a])
        return Rendered(text, self._content_spans(text, messages))

    def _content_spans(self, text: str, messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
        """Each assistant message's content in ``text``, in order, with its end of turn."""
        eot = self.tokens.get("eos_token")
        spans, at = [], 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            content = m["content"]
            start = text.find(content, at)
            if start < 0 and content.strip():
                content = content.strip()
                start = text.find(content, at)
            if start < 0:
                raise ChatRecordError(
                    f"message {k} (assistant): its content is not in the text the chat template "
                    f"{self.where} renders (the template changes it); a template with "
                    "{% generation %} marks says where the assistant's tokens are"
                )
            end = start + len(content)
            if eot:
                rest = len(text) - len(text[end:].lstrip())
                if text.startswith(eot, rest):
                    end = rest + len(eot)
            if end > start:  # an empty content followed by no end of turn: nothing to learn
                spans.append((start, end))
            at = end
        return spans


_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "overlord_chat_tracking", default=None
)


@functools.cache
def _generation_extension() -> type:
    """The ``{% generation %}`` tag: its output is a span, at the text rendered before it.

    The text so far is what the template's stream yielded before the block (the blocks of
    this render, in a context variable: renders on other threads have their own).
    """
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_span")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _span(self, context: Any, caller: Any) -> str:
            out = str(caller())
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(out)))
            return out

    return Generation


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:  # fmt: skip
    # as transformers': Jinja's own tojson escapes HTML characters, which a template does not want
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """``dict`` for a template: a call and ``fromkeys``, nothing else of the type to reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


@functools.cache
def _namespace_class() -> type:
    """Jinja's ``namespace``, refusing names that start with an underscore."""
    import jinja2
    import jinja2.utils

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set {name!r} on a namespace (a name starting with _)"
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: self in args
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def parse_messages(text: str, field_name: str, need_assistant: bool) -> list[dict[str, Any]]:
    """A record's messages from their JSON text, checked: a list of ``{role, content}``.

    Raises :class:`ChatRecordError` naming what is wrong (which message, which key).
    """
    try:
        messages = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ChatRecordError(f"field '{field_name}' is not JSON ({e})") from None
    if not isinstance(messages, list) or not messages:
        kind = type(messages).__name__ if not isinstance(messages, list) else "an empty list"
        raise ChatRecordError(f"field '{field_name}' is {kind}, expected a list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatRecordError(
                f"message {k} is {type(m).__name__}, expected a mapping {{role, content}}"
            )
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                found = "missing" if key not in m else type(m[key]).__name__
                raise ChatRecordError(f"message {k}: '{key}' is {found}, expected a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        roles = sorted({m["role"] for m in messages})
        raise ChatRecordError(
            f"no assistant turn (roles: {roles}): with loss_on: assistant it has no token "
            "to learn from"
        )
    return messages


def assistant_mask(
    starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]]
) -> np.ndarray:
    """uint8 per token: 1 where its characters ``[start, end)`` overlap a span.

    A token of no characters (``start == end``) counts as the one character at ``start``;
    a token with ``start < 0`` (the appended end of document) is never in a span.

    >>> assistant_mask(np.array([0, 2, 5, -1]), np.array([2, 5, 7, -1]), [(3, 6)]).tolist()
    [0, 1, 1, 0]
    """
    if not spans:
        return np.zeros(len(starts), np.uint8)
    lo = np.fromiter((a for a, _ in spans), np.int64, len(spans))
    hi = np.fromiter((b for _, b in spans), np.int64, len(spans))
    end = np.maximum(ends, starts + 1)
    j = np.searchsorted(lo, end, side="left") - 1  # the last span that starts before the end
    inside = (j >= 0) & (starts >= 0) & (hi[np.maximum(j, 0)] > starts)
    return inside.astype(np.uint8)


@dataclass
class ChatPiece:
    """A piece's conversations tokenized: what :func:`overlord.sources.shard.cut_items` cuts."""

    tokens: np.ndarray  # int32, the documents back to back
    offsets: np.ndarray  # int64, one more than records; a bad record has no token
    mask: np.ndarray | None  # uint8 per token (loss_on: assistant), else None
    bad: list[tuple[int, str]]  # (record in the piece, why): records that cannot be rendered


def encode_chat(
    template: ChatTemplate, tokenizer: Any, spec: SourceSpec, texts: pa.Array
) -> ChatPiece:
    """Render, tokenize (with character offsets) and mask a piece's conversations."""
    assistant = spec.loss_on is LossOn.ASSISTANT
    field_name = chat_field(spec)
    rendered: list[Rendered] = []
    bad: list[tuple[int, str]] = []
    good: list[int] = []
    for i, text in enumerate(texts.to_pylist()):
        try:
            r = template.render(parse_messages(text, field_name, assistant))
        except ChatRecordError as e:
            bad.append((i, str(e)))
            continue
        if assistant and not r.spans:
            bad.append((i, f"the chat template {template.where} renders no assistant token"))
            continue
        good.append(i)
        rendered.append(r)
    tokens, offs, starts, ends = tokenizer.encode_spans([r.text for r in rendered])
    lengths = np.zeros(len(texts), np.int64)
    lengths[good] = np.diff(offs)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    mask = None
    if assistant:
        # one call for the piece: every text's characters placed after the previous text's
        base = np.cumsum([0] + [len(r.text) + 1 for r in rendered])
        shift = np.repeat(base[:-1], np.diff(offs))
        spans = [(a + at, b + at) for r, at in zip(rendered, base.tolist()) for a, b in r.spans]
        real = starts >= 0  # the appended end of document stays outside every span
        mask = assistant_mask(np.where(real, starts + shift, -1), ends + shift, spans)
    return ChatPiece(tokens, offsets, mask, bad)


def chat_field(spec: SourceSpec) -> str:
    """The record field that holds a chat source's messages: ``messages`` unless given."""
    return spec.text_field if "text_field" in spec.model_fields_set else "messages"


def plan_template(plan: Plan) -> ChatTemplate:
    """The chat template of a plan: ``tokenizer.chat_template``'s file, else the tokenizer's.

    The tokenizer's is the ``chat_template`` of the ``tokenizer_config.json`` beside its
    ``tokenizer.json`` (a string, or a list of named templates of which ``default`` is taken).
    The special tokens come from that file either way, where there is one.
    """
    spec = plan.tokenizer
    base = str(plan.base_dir)
    config = None
    if spec.kind is TokenizerKind.HF and spec.path is not None:
        path = spec.path if os.path.isabs(spec.path) else os.path.join(base, spec.path)
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    template = None
    if spec.chat_template is not None:
        template = spec.chat_template
        template = template if os.path.isabs(template) else os.path.join(base, template)
    return _load(template, config, *(_version(p) for p in (template, config)))


def _version(path: str | None) -> tuple[int, int]:
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return (-1, -1)
    return (-1, -1) if st is None else (st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(
    template: str | None, config: str | None, _v1: tuple[int, int], _v2: tuple[int, int]
) -> ChatTemplate:
    """The template (and special tokens) of these files; their versions key the cache."""
    settings: dict[str, Any] = {}
    if config is not None and os.path.exists(config):
        try:
            with open(config, encoding="utf-8") as f:
                settings = json.load(f)
        except (OSError, ValueError) as e:
            raise PlanError([("tokenizer.path", f"cannot read {config}: {e}")]) from None
        if not isinstance(settings, dict):
            raise PlanError([("tokenizer.path", f"{config} is not a JSON object")])
    tokens = {k: v for k in SPECIAL_TOKENS if (v := _token(settings.get(k))) is not None}
    if template is not None:
        try:
            with open(template, encoding="utf-8") as f:
                return ChatTemplate(f.read(), template, tokens)
        except OSError as e:
            raise PlanError([("tokenizer.chat_template", f"cannot read {template}: {e}")]) from None
    source = settings.get("chat_template")
    if isinstance(source, list):  # named templates: [{name, template}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        where = config if config is not None else "the bytes tokenizer"
        found = (
            "no such file"
            if config is not None and not os.path.exists(config)
            else ("no chat_template in it")
        )
        raise PlanError(
            [
                (
                    "tokenizer.chat_template",
                    f"a chat source needs a chat template, and {where} has none ({found}): "
                    "give a template file as tokenizer.chat_template",
                )
            ]
        )
    return ChatTemplate(source, f"{config}:chat_template", tokens)


def _token(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an added token's mapping."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
