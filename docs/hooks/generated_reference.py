"""Reference pages generated from the code, so that they cannot drift from it.

MkDocs runs this file as a hook (``hooks:`` in ``mkdocs.yml``): a page holding
``<!-- generated: plan -->`` (or ``metrics``, ``cli``) gets the generated text
in place of that line. ``tests/test_docs.py`` calls the same functions:

- :func:`plan_reference`: every model of the data plan (``overlord.plan.spec.Plan``
  and every model nested in it), each field with its type, default, constraints
  and description, read from the pydantic models;
- :func:`missing_descriptions`: the fields that have no description (the test
  requires none);
- :func:`metrics_reference`: the metric names of overlord's ``METRICS`` table;
- :func:`cli_reference`: the commands and flags of ``overlord``'s argument parser.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def use_checkout() -> None:
    """Import ``overlord`` from this checkout, not from wherever an installed one points.

    MkDocs restores ``sys.path`` after loading a hook, so each generator calls this.
    """
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if p != str(ROOT)]
    loaded = sys.modules.get("overlord")
    if loaded is not None and not Path(loaded.__file__ or "").resolve().is_relative_to(ROOT):
        for name in [n for n in sys.modules if n == "overlord" or n.startswith("overlord.")]:
            del sys.modules[name]


use_checkout()

from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

# Fields of models outside overlord/plan/spec.py and overlord/plan/settings.py that have no
# description in the code yet: the text shown until the model carries it. The tests fail
# once the model has one (delete the entry then) and for any other field without one.
PENDING: dict[str, str] = {}

MARKER = "<!-- generated: {} -->"


# ---------------------------------------------------------------- the plan's models


def _plan_class() -> type[BaseModel]:
    use_checkout()
    from overlord.plan.spec import Plan

    return Plan


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names (``X``, ``X | None``, ``list[X]``...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return found


def plan_models() -> list[tuple[type[BaseModel], list[str]]]:
    """Every model of the plan, breadth first from ``Plan``, with the YAML paths it appears at.

    >>> [m.__name__ for m, _ in plan_models()][:3]
    ['Plan', 'SourceSpec', 'TokenizerSpec']
    """
    root = _plan_class()
    order: list[type[BaseModel]] = [root]
    paths: dict[type[BaseModel], list[str]] = {root: [""]}
    queue = [(root, "")]
    while queue:
        model, path = queue.pop(0)
        for name, field in model.model_fields.items():
            is_list = typing.get_origin(field.annotation) is list
            sub = f"{path}.{name}" if path else name
            for inner in _models_in(field.annotation):
                where = sub + ("[]" if is_list else "")
                if inner not in paths:
                    paths[inner] = []
                    order.append(inner)
                    queue.append((inner, where))
                paths[inner].append(where)
    return [(m, paths[m]) for m in order]


def _key(model: type[BaseModel], field: str) -> str:
    return f"{model.__name__}.{field}"


def description(model: type[BaseModel], field: str) -> str | None:
    """The field's description: the model's own, else the pending text above."""
    info = model.model_fields[field]
    return info.description or PENDING.get(_key(model, field))


def missing_descriptions() -> list[str]:
    """``Model.field`` of every field of the plan with no description, in the code or pending."""
    return [
        _key(model, name)
        for model, _ in plan_models()
        for name in model.model_fields
        if not description(model, name)
    ]


def stale_pending() -> list[str]:
    """Entries of :data:`PENDING` whose field now has a description in the code (or is gone)."""
    models = {m.__name__: m for m, _ in plan_models()}
    stale = []
    for key in PENDING:
        model_name, field = key.split(".")
        model = models.get(model_name)
        if (
            model is None
            or field not in model.model_fields
            or model.model_fields[field].description
        ):
            stale.append(key)
    return stale


def _type_text(annotation: Any) -> str:
    """A type as a plan's author reads it: ``int``, ``str or list of str``, an enum's values."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " or ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args)
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return f"map of {_type_text(args[0])} to {_type_text(args[1])}"
    if origin is tuple:
        return "(" + ", ".join(_type_text(a) for a in args) + ")"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "the defaults below"
    if isinstance(value, Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


_BOUNDS = {"ge": "≥ {}", "gt": "> {}", "le": "≤ {}", "lt": "< {}"}


def _constraints_text(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        for attr, form in _BOUNDS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(form.format(value))
        min_length = getattr(meta, "min_length", None)
        if min_length is not None:
            parts.append(f"at least {min_length}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def plan_reference() -> str:
    """The plan reference in Markdown: one section per model, one table row per field."""
    out = [
        "Generated from the plan's pydantic models when the site is built "
        "(`docs/hooks/generated_reference.py`): what you read here is what "
        "`overlord.load_plan` accepts. Paths are YAML keys from the top of the plan; "
        "`[]` marks a list's items.",
        "",
    ]
    for model, paths in plan_models():
        title = model.__name__
        where = ", ".join(f"`{p}`" for p in paths if p) or "the top of the plan"
        out += [f"## {title}", "", f"At {where}.", ""]
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        doc = re.sub(r":\w+:`([^`]+)`", r"`\1`", doc).replace("``", "`")  # reST to Markdown
        if doc:
            out += [doc, ""]
        out += [
            "| field | type | default | constraints | description |",
            "|---|---|---|---|---|",
        ]
        for name, info in model.model_fields.items():
            row = [
                f"`{name}`",
                _type_text(info.annotation),
                _default_text(info),
                _constraints_text(info),
                description(model, name) or "",
            ]
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- metrics


def metrics_table() -> dict[str, tuple[str, str]]:
    """The metric names of overlord: name -> (type, help)."""
    use_checkout()
    for home in ("overlord.monitor.prometheus", "overlord.metrics"):
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        table = getattr(module, "METRICS", None)
        if table is not None:
            return dict(table)
    raise ImportError("no METRICS table in overlord.monitor.prometheus or overlord.metrics")


def metrics_reference() -> str:
    """The metric names in Markdown, from the ``METRICS`` table (the contract)."""
    out = [
        "Generated from overlord's `METRICS` table when the site is built. The names are "
        "the contract; what each label means is in the "
        "[monitoring guide](../guides/monitoring.md).",
        "",
        "| metric | type | what |",
        "|---|---|---|",
    ]
    for name, (kind, doc) in metrics_table().items():
        out.append(f"| `{name}` | {kind} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- the command line


def _script_target() -> str:
    """The ``module:function`` that the ``overlord`` console command runs (pyproject.toml)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["scripts"]["overlord"])


def cli_parser() -> argparse.ArgumentParser:
    """``overlord``'s argument parser, from the module its console command runs."""
    use_checkout()
    module = importlib.import_module(_script_target().split(":")[0])
    return module.build_parser()  # type: ignore[no-any-return]


def cli_reference() -> str:
    """Every command of ``overlord`` with its usage and flags, from its argument parser."""
    parser = cli_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = [
        "Generated from `overlord`'s argument parser when the site is built. What each "
        "command does, with examples, is in [Python API and CLI](../guides/api-and-cli.md).",
        "",
    ]
    for name, command in sub.choices.items():
        command.formatter_class = functools.partial(argparse.HelpFormatter, width=88)
        usage = command.format_usage().replace("usage: ", "").strip()
        out += [f"## overlord {name}", "", helps.get(name) or "", "", "```text", usage, "```", ""]
        rows = []
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(action.option_strings) or action.dest.upper()
            default = action.default
            shown = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
            if action.required and action.option_strings:
                shown = "required"
            choices = " or ".join(f"`{c}`" for c in action.choices or [])
            rows.append(f"| `{flag}` | {shown} | {choices} | {_cell(action.help or '')} |")
        if rows:
            out += ["| argument | default | choices | what |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


# ---------------------------------------------------------------- the MkDocs hook

GENERATORS = {"plan": plan_reference, "metrics": metrics_reference, "cli": cli_reference}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: put the generated text where a page holds its marker."""
    for name, generate in GENERATORS.items():
        marker = MARKER.format(name)
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
