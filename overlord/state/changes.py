"""What a resume with a changed plan changes: each change classified, allowed or refused.

A checkpoint holds, per source (by name), its cursor, its mixture account,
its files and the fingerprint of its *recipe*: what decides the source's
items and their order (:meth:`overlord.plan.spec.Plan.source_recipe`: its
path, format and fields, and the plan's seed, tokenizer, shuffle,
``max_seq_len``, ``long_docs`` and ``on_error``). A plan resumed from it may
differ; the rule is one sentence:

    whatever decides a kept source's items is refused (its positions would
    mean other samples); everything else is allowed, from the resume step on.

So adding a source (it starts at its epoch 0), removing one (its state is
dropped and the state records it), a new schedule, tokens per step, the mesh,
loading, autoscale and the quarantine are allowed; a kept source's path,
format, fields, tokenizer, shuffle, the seed and ``max_seq_len`` are refused.

The state records only the recipe's fingerprint, not its fields: with the
checkpoint's plan at hand (``before``) every change is named with its old
and new value; without it a refused source is named with the fields that
may have changed. :func:`classify` is pure: ``overlord diff`` prints it, and
:func:`overlord.state.checkpoint.check_state` refuses what it refuses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from overlord.plan.spec import Plan, fingerprint_of

DROPPED = "dropped"  # the state's record of removed sources: [{"source", "step"}, ...]

# what a recipe holds besides the source's own fields, and where each is in a plan
_PLAN_FIELDS = {
    "seed": "seed",
    "tokenizer": "tokenizer",
    "max_seq_len": "batch.max_seq_len",
    "long_docs": "batch.long_docs",
    "on_error": "on_error",
    "shuffle": "shuffle",
    "vision": "vision",
}
_SOURCE_ONLY = ("loaders", "shadows", "storage_options")  # who reads it and how: not its items

# why a setting outside every recipe may change, by its section
_ALLOWED_WHY = {
    "mixture": "the new weights hold from step {step}; the weights before it are history "
    "(each source's account of tokens placed carries on)",
    "batch": "steps from {step} on take the new value; a source's order does not depend on it",
    "world": "the same global stream on the new mesh (elastic resume)",
    "quarantine": "the quarantine in force from step {step} on",
}
_SETTINGS_WHY = "it decides who reads, how or where, not which samples a source yields"


@dataclass(frozen=True)
class Change:
    """One difference between a checkpoint's plan and the plan resumed from it.

    ``field``: where (``sources.web``, ``sources.web.text_field``, ``seed``,
    ``batch.tokens_per_step``); ``old`` and ``new`` its values (None: absent
    or not recorded); ``why``: what the resume does with it, or what to do.
    """

    field: str
    allowed: bool
    old: Any
    new: Any
    why: str

    def line(self) -> str:
        """One line: ``allowed|refused  FIELD: OLD -> NEW: WHY``."""
        verdict = "allowed" if self.allowed else "refused"
        values = f"{_show(self.old)} -> {_show(self.new)}"
        return f"{verdict}  {self.field}: {values}: {self.why}"


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, str):
        return value
    return repr(value) if not isinstance(value, dict | list) else _compact(value)


def _compact(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= 120 else text[:117] + "..."


def refused(changes: list[Change]) -> list[Change]:
    """The changes a resume refuses."""
    return [c for c in changes if not c.allowed]


def dropped_sources(state: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """The state's record of removed sources, with those this plan removes at its step.

    >>> from overlord.plan.spec import validate_plan
    >>> plan = validate_plan({"sources": [{"name": "a", "path": "x", "format": "jsonl"}],
    ...                       "batch": {"tokens_per_step": 64, "max_seq_len": 32}})
    >>> dropped_sources({"step": 7, "sources": {"a": {}, "b": {}}}, plan)
    [{'source': 'b', 'step': 7}]
    """
    out = [dict(d) for d in state.get(DROPPED, [])]
    step = int(state.get("step", 0))
    names = set(plan.source_names)
    return out + [{"source": n, "step": step} for n in state["sources"] if n not in names]


def classify(state: dict[str, Any], plan: Plan, before: Plan | None = None) -> list[Change]:
    """Every change from ``state`` (a checkpoint) to ``plan``, each allowed or refused.

    ``before``: the plan the checkpoint was written with, when known; it names
    each field that changed with its old and new value. Without it, what the
    state records (its sources, their fingerprints, the stream's fingerprint)
    decides, and a refused source names the fields that may have changed.
    """
    step = int(state["step"])
    saved: dict[str, Any] = state["sources"]
    kept = [n for n in plan.source_names if n in saved]
    removed = [n for n in saved if n not in plan.source_names]
    added = [n for n in plan.source_names if n not in saved]
    if saved and not kept:
        return [
            Change(
                "sources", False, sorted(saved), plan.source_names,
                "the checkpoint shares no source with this plan: it is another run's "
                "checkpoint (or every source was renamed, which starts each over); start "
                "this plan without resuming, or resume a plan that keeps one of its sources",
            )
        ]  # fmt: skip
    renamed = _renames(saved, plan, removed, added)
    out: list[Change] = []
    for n in removed:
        to = [a for r, a in renamed if r == n]
        note = (
            f" (a rename to '{to[0]}' is a removal and an addition: '{to[0]}' starts at "
            f"its epoch 0; keep the name '{n}' to continue its order)" if to else ""
        )  # fmt: skip
        out.append(
            Change(
                f"sources.{n}", True, "in the checkpoint", None,
                f"removed: its state is dropped, and the state records it dropped at step "
                f"{step}{note}",
            )
        )  # fmt: skip
    earlier = {d.get("source"): d.get("step") for d in state.get(DROPPED, [])}
    for n in added:
        frm = [r for r, a in renamed if a == n]
        note = f" (a rename of '{frm[0]}': it does not continue that source's order)" if frm else ""
        if n in earlier:
            note += f" (dropped at step {earlier[n]}: it starts over, not where it stopped)"
        out.append(
            Change(
                f"sources.{n}", True, None, "in the plan",
                f"added: it starts at its epoch 0 from step {step}{note}",
            )
        )  # fmt: skip
    if before is not None:
        out += _field_changes(state, plan, before, kept)
    else:
        out += _fingerprint_changes(state, plan, kept, bool(removed or added))
    out += _schedule_start(state, plan, before)
    return out


def _renames(
    saved: dict[str, Any], plan: Plan, removed: list[str], added: list[str]
) -> list[tuple[str, str]]:
    """``(old, new)`` names of added sources that read what a removed one read."""
    pairs = []
    for a in added:
        recipe = plan.source_recipe(a)
        for r in removed:
            recipe["source"]["name"] = r
            if fingerprint_of(recipe) == saved[r].get("fingerprint"):
                pairs.append((r, a))
    return pairs


def _fingerprint_changes(
    state: dict[str, Any], plan: Plan, kept: list[str], sources_changed: bool
) -> list[Change]:
    """Without the checkpoint's plan: what the recorded fingerprints tell."""
    out = []
    for n in kept:
        old, new = state["sources"][n].get("fingerprint"), plan.source_fingerprint(n)
        if old != new:
            out.append(
                Change(
                    f"sources.{n}", False, f"fingerprint {old}", f"fingerprint {new}",
                    "what decides its items changed: its path, format, fields or transform, "
                    "or the plan's seed, tokenizer, shuffle, max_seq_len, long_docs or "
                    "on_error (overlord diff CHECKPOINT PLAN --was OLD_PLAN names which); "
                    "set them back to continue its order, or give the source a new name "
                    "to read it the new way from its epoch 0",
                )
            )  # fmt: skip
    recorded = state.get("fingerprint")
    if not out and not sources_changed and recorded is not None:
        now = plan.stream_fingerprint()
        if recorded != now:
            out.append(
                Change(
                    "settings", True, f"fingerprint {recorded}", f"fingerprint {now}",
                    "the mixture, tokens per step or other settings that decide no "
                    "source's items changed; they hold from step "
                    f"{state['step']} on (--was OLD_PLAN names them)",
                )
            )  # fmt: skip
    return out


def _field_changes(
    state: dict[str, Any], plan: Plan, before: Plan, kept: list[str]
) -> list[Change]:
    """With the checkpoint's plan: every field that changed, with its old and new value."""
    step = int(state["step"])
    out = []
    refused_plan_fields: dict[str, list[str]] = {}
    for n in kept:
        if n not in before.source_names:
            out.append(
                Change(
                    f"sources.{n}", False, None, "in the plan",
                    f"the checkpoint has source '{n}', the plan given as the old one does "
                    "not: give the plan the checkpoint was written with",
                )
            )  # fmt: skip
            continue
        recorded = state["sources"][n].get("fingerprint")
        if recorded == plan.source_fingerprint(n):
            pass  # it reads the source as the checkpoint did: it continues
        elif recorded != before.source_fingerprint(n):
            out.append(
                Change(
                    f"sources.{n}", False, f"fingerprint {recorded}",
                    f"fingerprint {plan.source_fingerprint(n)}",
                    "what decides its items changed, and the plan given as the old one is "
                    "not the one the checkpoint was written with (its fingerprint differs "
                    "too): give that plan to name the fields",
                )
            )  # fmt: skip
        else:
            old, new = before.source_recipe(n), plan.source_recipe(n)
            for key in sorted(set(old) | set(new)):
                if key != "source" and old.get(key) != new.get(key):
                    refused_plan_fields.setdefault(_PLAN_FIELDS.get(key, key), []).append(n)
            for path, a, b in _leaves(old.get("source", {}), new.get("source", {}), ""):
                out.append(
                    Change(
                        f"sources.{n}.{path}", False, a, b,
                        "it decides the source's items, so the checkpoint's positions would "
                        f"mean other samples: set it back to {_show(a)} to continue '{n}', or "
                        "give the source a new name to read it the new way from its epoch 0",
                    )
                )  # fmt: skip
        a_spec = before.sources[before.source_names.index(n)].model_dump(mode="json")
        b_spec = plan.sources[plan.source_names.index(n)].model_dump(mode="json")
        for key in _SOURCE_ONLY:
            if a_spec[key] != b_spec[key]:
                out.append(Change(f"sources.{n}.{key}", True, a_spec[key], b_spec[key],
                                  _SETTINGS_WHY))  # fmt: skip
    a_all, b_all = before.model_dump(mode="json"), plan.model_dump(mode="json")
    for top in sorted((set(a_all) | set(b_all)) - {"sources"}):
        a, b = a_all.get(top), b_all.get(top)
        if top == "mixture":  # a schedule is one value: its points move together
            if isinstance(a, dict) and isinstance(b, dict) and a["interpolation"] == b[
                "interpolation"
            ]:
                pairs = [("mixture.schedule", a["schedule"], b["schedule"])]
            else:
                pairs = [(top, a, b)]
        else:
            pairs = list(_leaves(a, b, top))
        for path, a, b in pairs:
            if a == b:
                continue
            users = refused_plan_fields.get(path) or refused_plan_fields.get(top)
            if users:
                out.append(
                    Change(
                        path, False, a, b,
                        f"it decides the items of {', '.join(repr(u) for u in users)}, so the "
                        f"checkpoint's positions would mean other samples: set it back to "
                        f"{_show(a)}, or give those sources new names to read them the new "
                        "way from their epoch 0",
                    )
                )  # fmt: skip
                continue
            why = _ALLOWED_WHY.get(top, _SETTINGS_WHY)
            if top in _PLAN_FIELDS or path in _PLAN_FIELDS.values():
                why = "no kept source reads it the way it changed"
            out.append(Change(path, True, a, b, why.format(step=step)))
    return out


def _leaves(a: Any, b: Any, where: str) -> Iterator[tuple[str, Any, Any]]:
    """``(path, old, new)`` of every leaf that differs; a list is one leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            path = f"{where}.{key}" if where else str(key)
            yield from _leaves(a.get(key), b.get(key), path)
    elif a != b:
        yield where, a, b


def _schedule_start(state: dict[str, Any], plan: Plan, before: Plan | None) -> list[Change]:
    """A changed schedule must say the weights at the resume step: its first point at or before."""
    step = int(state["step"])
    if plan.mixture is None or plan.mixture.schedule[0].step <= step:
        return []
    if before is not None:
        changed = before.model_dump(mode="json")["mixture"] != plan.model_dump(mode="json")[
            "mixture"
        ]
    else:
        changed = state.get("fingerprint") not in (None, plan.stream_fingerprint())
    if not changed:
        return []
    first = plan.mixture.schedule[0].step
    return [
        Change(
            "mixture.schedule[0].step", False, None, first,
            f"the new schedule starts at step {first}, after the resume step {step}: the "
            f"weights of steps {step} to {first - 1} are not given (a schedule's first "
            f"weights would hold there by default); add a point at step {step} or earlier",
        )
    ]  # fmt: skip
