"""The rules between a plan's fields: every problem that involves several of them.

They work on the plan as plain data (a mapping read from YAML), so that they run even where
the schema has problems and both kinds are reported in one message; a rule whose fields are
themselves invalid is skipped (the schema names those).
"""

from __future__ import annotations

from typing import Any

from overlord.plan.kinds import Format, TokenizerKind
from overlord.plan.mesh import mesh_problems
from overlord.plan.vision import vision_problems

# overlord's own transforms (overlord.sources.transforms): a plan names them without consent
BUILTIN_TRANSFORMS = frozenset(
    f"overlord.sources.transforms:{name}" for name in ("zlib_json", "clean_text", "pack_zlib_json")
)


def _transform_problems(data: dict[str, Any], sources: list[Any]) -> list[tuple[str, str]]:
    """Transforms that are code from outside overlord, in a plan that did not allow them."""
    if _get(data, "transforms", "allow_imports") is True:
        return []
    out = []
    for i, src in enumerate(sources):
        name = _get(src, "transform")
        if isinstance(name, str) and name not in BUILTIN_TRANSFORMS:
            out.append(
                (
                    f"sources[{i}].transform",
                    f"'{name}' is code from outside overlord: the plan would import it and "
                    "call it on every record. A plan names such code only with "
                    "transforms: {allow_imports: true}",
                )
            )
    return out


def _get(data: Any, *path: str) -> Any:
    """``data[path[0]][path[1]]...`` or None where a level is missing or not a mapping."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def _token_source_problems(i: int, src: Any) -> list[tuple[str, str]]:
    """What a pre-tokenized source needs (an eos for flat tokens) and what it cannot have."""
    fmt = _get(src, "format")
    out: list[tuple[str, str]] = []
    if fmt not in (Format.TOKENS.value, Format.MEGATRON.value):
        for key in ("dtype", "eos_id"):
            if _get(src, key) is not None:
                out.append((f"sources[{i}].{key}", f"applies to format tokens only, not {fmt}"))
        return out
    if fmt == Format.TOKENS.value and _get(src, "eos_id") is None:
        out.append((f"sources[{i}].eos_id", "format tokens needs the id that ends a document"))
    if fmt == Format.MEGATRON.value:
        for key in ("dtype", "eos_id"):
            if _get(src, key) is not None:
                out.append(
                    (f"sources[{i}].{key}", "format megatron: its .idx file says how to read it")
                )
    for key, why in (
        ("transform", "a transform works on text; this source holds token ids"),
        ("image_field", "images come with image-text sources only"),
    ):
        if _get(src, key) is not None:
            out.append((f"sources[{i}].{key}", f"not for format {fmt}: {why}"))
    return out


def _adapt_problems(data: dict[str, Any], names: list[str]) -> list[tuple[str, str]]:
    """An adaptive mixture's bounds: of sources that exist, with room for every weight."""
    adapt = _get(data, "mixture", "adapt")
    bounds = _get(adapt, "bounds")
    if not isinstance(adapt, dict) or not names:
        return []
    out: list[tuple[str, str]] = []
    bounds = bounds if isinstance(bounds, dict) else {}
    for name in bounds:
        if name not in names:
            out.append(
                (f"mixture.adapt.bounds.{name}", f"no source is named '{name}': {names}")
            )
    pairs = [bounds.get(n, (0.0, 1.0)) for n in names]
    floor = _get(adapt, "floor")
    floor = floor if isinstance(floor, (int, float)) else 0.0
    try:
        low = sum(max(float(lo), floor) for lo, _ in pairs)
        high = sum(float(hi) for _, hi in pairs)
    except (TypeError, ValueError):
        return out  # the schema names a bound that is not [min, max]
    if low > 1 or high < 1:
        out.append(
            (
                "mixture.adapt.bounds",
                f"the weights must sum to 1 within the bounds and floor: the minimums sum to "
                f"{low:g}, the maximums to {high:g}; lower the minimums or the floor, or raise "
                "the maximums",
            )
        )
    return out


def _chat_problems(data: dict[str, Any], i: int, src: Any) -> list[tuple[str, str]]:
    """What a chat source cannot have, and the template the bytes tokenizer cannot give."""
    if _get(src, "format") != Format.CHAT.value:
        return []
    out = [
        (f"sources[{i}].{key}", f"not for format chat: {why}")
        for key, why in (
            ("transform", "a transform works on a text; a chat record is a list of messages"),
            ("image_field", "images come with image-text sources only"),
        )
        if _get(src, key) is not None
    ]
    kind = _get(data, "tokenizer", "kind") or TokenizerKind.BYTES.value
    if kind == TokenizerKind.BYTES.value and _get(data, "tokenizer", "chat_template") is None:
        out.append(
            (
                "tokenizer.chat_template",
                f"source {_get(src, 'name')!r} is format chat, and the bytes tokenizer has no "
                "tokenizer_config.json to hold a chat template: give a template file here",
            )
        )
    return out


def semantic_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Problems that involve several fields, all of them.

    Works on plain data, and skips a check whose fields are themselves invalid,
    so that it runs even when the schema has problems and both are reported.
    """
    problems: list[tuple[str, str]] = []
    sources: list[Any] = data["sources"] if isinstance(data.get("sources"), list) else []
    problems += _transform_problems(data, sources)
    seen: set[str] = set()
    for i, src in enumerate(sources):
        name = _get(src, "name")
        if isinstance(name, str):
            if name in seen:
                problems.append((f"sources[{i}].name", f"'{name}' is used by more than one source"))
            seen.add(name)
        problems += _token_source_problems(i, src)
        problems += [p for p in _chat_problems(data, i, src) if p not in problems]
    problems += _adapt_problems(data, sorted(seen))

    tokens, seq = (
        _int(_get(data, "batch", "tokens_per_step")),
        _int(_get(data, "batch", "max_seq_len")),
    )
    dp = _int(_get(data, "world", "dp")) if _get(data, "world", "dp") is not None else 1
    if tokens and seq and tokens % seq:
        problems.append(
            (
                "batch.tokens_per_step",
                f"must be a whole number of rows of max_seq_len={seq} tokens, "
                f"found {tokens} ({tokens / seq:.3f} rows)",
            )
        )
    elif tokens and seq and dp and (tokens // seq) % dp:
        problems.append(
            (
                "world.dp",
                f"a step has {tokens // seq} rows, which do not split evenly over "
                f"dp={dp} ranks: choose tokens_per_step = k * dp * max_seq_len",
            )
        )

    schedule = _get(data, "mixture", "schedule")
    schedule = schedule if isinstance(schedule, list) else []
    steps = [_get(p, "step") for p in schedule]
    for i in range(1, len(steps)):
        a, b = steps[i - 1], steps[i]
        if isinstance(a, int) and isinstance(b, int) and b <= a:
            problems.append(
                (f"mixture.schedule[{i}].step", f"steps must increase, found {b} after {a}")
            )
    for i, point in enumerate(schedule):
        weights = _get(point, "weights")
        if not isinstance(weights, dict) or not seen:
            continue
        for name in weights:
            if name not in seen:
                problems.append(
                    (
                        f"mixture.schedule[{i}].weights.{name}",
                        f"unknown source '{name}'; the plan's sources are {sorted(seen)}",
                    )
                )
        known = [weights.get(n) for n in seen]
        if weights and not any(isinstance(w, (int, float)) and w > 0 for w in known):
            problems.append(
                (f"mixture.schedule[{i}].weights", "gives no weight to any known source")
            )

    if _get(data, "placement", "loader_processes") and _get(data, "placement", "loader_nodes"):
        problems.append(
            (
                "placement.loader_nodes",
                "cannot pin sources to nodes when loader_processes groups them",
            )
        )
    nodes = _get(data, "placement", "loader_nodes")
    for name in nodes if isinstance(nodes, dict) and seen else []:
        if name not in seen:
            problems.append(
                (
                    f"placement.loader_nodes.{name}",
                    f"unknown source '{name}'; sources: {sorted(seen)}",
                )
            )

    problems += mesh_problems(data)
    problems += vision_problems(data)

    kind, path, eos = (_get(data, "tokenizer", k) for k in ("kind", "path", "eos"))
    if kind == TokenizerKind.HF.value and not path:
        problems.append(("tokenizer.path", "kind 'hf' needs the path of a tokenizer.json"))
    if kind in (None, TokenizerKind.BYTES.value) and (path or eos):
        problems.append(("tokenizer", "kind 'bytes' takes no path or eos"))

    cost = _get(data, "balance", "cost")
    if isinstance(cost, dict):
        direct = cost.get("alpha") is not None or cost.get("beta") is not None
        if cost.get("model") is not None and direct:
            problems.append(("balance.cost", "give either alpha/beta or model, not both"))
        if cost.get("model") is None and (cost.get("alpha") is None or cost.get("beta") is None):
            problems.append(("balance.cost", "give both alpha and beta, or model"))
    return problems
