"""Reading a plan file: YAML (or JSON) as plain data, with the limits a plan needs.

A plan is data, and reading it must not cost a machine: PyYAML's safe loader builds no
objects but plain ones, yet it accepts a key given twice in one mapping (the last one wins,
silently) and aliases that multiply a small file into an exponential tree (an alias of an
alias of ...: a one-kilobyte "billion laughs" file). Here a repeated key is an error naming
both lines, and a document whose tree, aliases expanded, passes :data:`MAX_PLAN_NODES` nodes
is refused before anything walks it. PyYAML is imported on use only, so that the planning
modules import with numpy and pydantic alone.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from overlord.errors import PlanError

MAX_PLAN_NODES = 1_000_000  # a plan of 10,000 sources has about 100,000


@functools.cache
def _loader() -> type:
    """A safe YAML loader that refuses repeated keys (built on first use: PyYAML is lazy)."""
    import yaml

    class PlanLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # ``<<: *base`` keys may be overridden: that is what they are for
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the safe constructor names it below
                if first is not None:
                    where = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise _Repeated(f"the key {key!r} is given twice: at {where}")
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return PlanLoader


class _Repeated(Exception):
    pass


def expanded_nodes(root: Any, limit: int = MAX_PLAN_NODES) -> int:
    """The nodes of a composed YAML tree with every alias expanded, counted up to ``limit``.

    An alias is the node it names, composed once; counting with a memo costs one visit per
    distinct node however many times aliases repeat it. Past ``limit`` it stops and returns
    ``limit + 1``.
    """
    memo: dict[int, int] = {}

    def size(node: Any) -> int:
        known = memo.get(id(node))
        if known is not None:
            return known
        total = 1
        value = node.value
        if isinstance(value, list):
            for item in value:
                for child in item if isinstance(item, tuple) else (item,):
                    total += size(child)
                    if total > limit:
                        return limit + 1
        memo[id(node)] = total
        return total

    return size(root)


def read_plan_file(path: str | Path) -> Any:
    """The plain data of a YAML (or JSON) plan file, not yet validated.

    Raises :class:`PlanError` naming the file for a file it cannot read, text that is not
    YAML, a key given twice in one mapping, and a document too large once its aliases are
    expanded or nested too deeply to read.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanError([("", f"cannot read the plan file: {e.strerror}")], str(path)) from None
    loader = _loader()(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        if expanded_nodes(root) > MAX_PLAN_NODES:
            raise _Repeated(
                f"the document has over {MAX_PLAN_NODES:,} values once its aliases are "
                "expanded: a plan needs far fewer (aliases that repeat aliases multiply)"
            )
        return loader.construct_document(root)
    except yaml.YAMLError as e:
        raise PlanError([("", f"not valid YAML: {e}")], str(path)) from None
    except _Repeated as e:
        raise PlanError([("", str(e))], str(path)) from None
    except RecursionError:
        raise PlanError([("", "the document is nested too deeply to read")], str(path)) from None
    finally:
        loader.dispose()
