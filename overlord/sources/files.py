"""Finding a source's shards: globs relative to the plan's folder, or fsspec URLs."""

from __future__ import annotations

import functools
import glob as _glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import fsspec

from overlord.errors import PlanError
from overlord.sources.remote import Retries, endpoint_problems, open_file


class SourcePaths(Protocol):
    """What finding a source's files needs of it: its name and its path pattern(s).

    :class:`overlord.plan.spec.SourceSpec` is one; the plan's layer lies below this one, so
    this module names the shape it needs instead of importing it.
    """

    @property
    def name(self) -> str:
        """The source's name, for error messages."""

    @property
    def path(self) -> str | list[str]:
        """One glob or URL, or a list of them."""


@dataclass(frozen=True)
class Shard:
    """One file of a source. ``name`` is how ids and errors refer to it."""

    url: str  # what to open: a local path or an fsspec URL
    name: str  # path relative to the plan's folder (local), else the URL
    # how to reach a URL (fsspec's storage options), and how its transient errors are retried
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False)
    retries: Retries | None = field(default=None, compare=False)

    def open(self, source: str) -> Any:
        """The file, opened for reading in binary (reads of a URL retried)."""
        return open_file(source, self.url, self.storage_options, self.retries)


def resolve_files(spec: SourcePaths, base_dir: Path) -> list[Shard]:
    """Every shard of a source, sorted by name, so that the order is the same everywhere.

    Raises :class:`PlanError` naming each pattern that matches nothing.
    """
    patterns = [spec.path] if isinstance(spec.path, str) else list(spec.path)
    # a SourceSpec's fsspec options for its URLs (endpoint, credentials), if it has them
    return find_shards(spec.name, patterns, base_dir, getattr(spec, "storage_options", None))


# what fsspec's base filesystem takes besides its class's own arguments (its instance cache,
# its listings cache)
_FSSPEC_COMMON = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}


def unknown_options(protocol: str, options: Mapping[str, Any]) -> str | None:
    """The keys of ``options`` that look misspelled for ``protocol``'s filesystem, named.

    A key is flagged when it is not one of the filesystem classes' named ``__init__``
    arguments but is close to one (``endpoint`` for ``endpoint_url``): fsspec would pass it on
    silently, and it would surface as a credentials error after retries. A key close to none
    is left alone, since filesystems take more than they name (s3fs hands the rest to its
    botocore session: ``profile``, ``region_name``). None when nothing looks misspelled, or
    the filesystem's package is missing.
    """
    import difflib
    import inspect

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None  # opening the URL names what is missing
    known = set(_FSSPEC_COMMON)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            params = inspect.signature(init).parameters.values()
            known |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    known.discard("self")
    said = []
    for key in sorted(k for k in options if k not in known):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        if close:
            said.append(f"'{key}' (did you mean '{close[0]}'?)")
    if not said:
        return None
    return f"{protocol}:// takes no option {', '.join(said)}"


def find_shards(
    source: str,
    patterns: list[str],
    base_dir: Path,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Shard]:
    """The files matching ``patterns`` (globs relative to ``base_dir``, or URLs), sorted.

    A URL's name is the URL itself (its ids read ``s3://bucket/web/part-3.jsonl:1207``).
    """
    options = dict(storage_options or {})
    shards: dict[str, Shard] = {}
    problems: list[tuple[str, str]] = []
    for pattern in patterns:
        if "://" in pattern and options:
            unknown = unknown_options(pattern.split("://", 1)[0], options)
            if unknown:  # before any request: a misspelled key is no credentials error later
                raise PlanError([("storage_options", f"source '{source}': {unknown}")])
        if "://" in pattern:
            fs, _, paths = Retries().call(
                source,
                pattern,
                "listing",
                functools.partial(fsspec.get_fs_token_paths, pattern, storage_options=options),
                lambda: None,
            )
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            found = [p if "://" in p else f"{protocol}://{p}" for p in paths]
            names = found
        else:
            full = pattern if os.path.isabs(pattern) else str(base_dir / pattern)
            found = [p for p in _glob.glob(full, recursive=True) if os.path.isfile(p)]
            names = [os.path.relpath(p, base_dir) for p in found]
        if not found:
            problems.append(
                (
                    "path",
                    f"source '{source}': '{pattern}' matches no file (looked in {base_dir})",
                )
            )
        for url, name in zip(found, names):
            shards[name] = Shard(url=url, name=name, storage_options=options)
    if problems:
        raise PlanError(problems)
    return [shards[k] for k in sorted(shards)]


def _field(data: Any, key: str) -> Any:
    """``data[key]``, or None where ``data`` is not a mapping."""
    return data.get(key) if isinstance(data, dict) else None


def check_files(data: dict[str, Any], base_dir: Path) -> list[tuple[str, str]]:
    """Every source pattern of a plan that matches no file, and every malformed transform name.

    ``data`` is the plan as plain data (a validated plan's ``model_dump(mode="json")``, or the
    mapping read from YAML: a plan with schema problems is checked as far as it can be);
    relative patterns are resolved against ``base_dir``. Problems are ``(field path, message)``
    pairs, the form of :class:`~overlord.errors.PlanError`.
    """
    problems: list[tuple[str, str]] = []
    sources: list[Any] = data["sources"] if isinstance(data.get("sources"), list) else []
    listed: list[tuple[int, str, list[str], dict[str, Any] | None]] = []
    for i, src in enumerate(sources):
        name, path = _field(src, "name"), _field(src, "path")
        patterns = [path] if isinstance(path, str) else path
        if not isinstance(name, str) or not isinstance(patterns, list):
            continue
        options = _field(src, "storage_options")
        options = options if isinstance(options, dict) else None
        listed.append((i, name, [p for p in patterns if isinstance(p, str)], options))
    # every endpoint tried at once first: one that is down is named with all its sources,
    # within loading.timeout_s, and none of them is listed (each would fail after retries)
    timeout = _field(_field(data, "loading"), "timeout_s")
    timeout = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 300.0
    index = {name: i for i, name, _, _ in listed}
    down: set[str] = set()
    for message, names in endpoint_problems([entry[1:] for entry in listed], timeout):
        problems.append((f"sources[{index[names[0]]}].storage_options", message))
        down.update(names)
    for i, name, patterns, options in listed:
        if name in down:
            continue
        try:
            find_shards(name, patterns, base_dir, options)
        except PlanError as e:
            problems += [(f"sources[{i}].path", msg) for _, msg in e.problems]
    for i, src in enumerate(sources):
        transform = _field(src, "transform")
        if isinstance(transform, str) and transform.count(":") != 1:
            # its form only: checking a transform is never importing it (that runs its code)
            problems.append((f"sources[{i}].transform", f"'{transform}' is not 'module:function'"))
    return problems
