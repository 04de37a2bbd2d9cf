"""The package's import structure: no cycles, and the planning modules stay light.

The planning modules (``overlord.plan``) are pure functions over numpy arrays and
pydantic models; a tool that only validates or plans must be able to import them
without pyarrow, fsspec, Ray or torch. The package facade (``overlord/__init__.py``)
imports its public names lazily so that importing ``overlord.plan.spec`` does not
drag the loader in.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import overlord

PACKAGE = Path(overlord.__file__).resolve().parent
ROOT = PACKAGE.parent
HEAVY = ("pyarrow", "fsspec", "ray", "torch", "yaml")


def module_name(path: Path) -> str:
    """``overlord/plan/spec.py`` -> ``overlord.plan.spec``; an ``__init__`` -> its package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PLAN_MODULES = sorted(m for m in MODULES if m == "overlord.plan" or m.startswith("overlord.plan."))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth (in functions too), except under ``if TYPE_CHECKING``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement of module ``importer`` loads by name."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        targets = {a.name for a in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package
            is_pkg = MODULES[importer].name == "__init__.py"
            pkg = importer.split(".")
            pkg = pkg if is_pkg else pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        targets = {base}
        # ``from overlord import checkpoint`` loads the submodule overlord.checkpoint
        targets |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
    return {t for t in targets if t in MODULES}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (module level and inside functions)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= _resolve(name, node)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in components:
        start = min(comp)
        # breadth-first within the component from start back to start: a shortest cycle
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        path.append(start)
        cycles.append(path[::-1])
    return sorted(cycles)


def test_find_cycles_reports_a_cycle_and_accepts_a_tree() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_import_graph_sees_function_level_imports_and_skips_type_checking() -> None:
    graph = import_graph()
    # plan/spec.py imports sources/files.py inside _glob_problems
    assert "overlord.sources.files" in graph["overlord.plan.spec"]
    # the facade names its public modules only under TYPE_CHECKING (and in strings)
    assert graph["overlord"] == set()
    # ``from overlord import checkpoint`` is an edge to the submodule
    assert "overlord.state.checkpoint" in graph["overlord.ops.cli"]


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


_PROBE = """
import importlib, importlib.abc, json, sys

BLOCKED = {blocked!r}
tried = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            tried.append(name)
            raise ImportError(f"{{name}} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
already = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
for m in {modules!r}:
    importlib.import_module(m)
import overlord
light = [type(getattr(overlord, n)).__name__ for n in {light!r}]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({{"already": already, "tried": tried, "loaded": loaded}}))
"""


@pytest.mark.integration
def test_plan_modules_import_without_pyarrow_fsspec_ray_torch() -> None:
    light = ["Plan", "World", "PlanError", "load_plan", "validate_plan", "Batch", "Sample"]
    code = _PROBE.format(blocked=HEAVY, modules=PLAN_MODULES, light=light)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["already"] == []  # else the block proves nothing
    assert result["tried"] == [], f"planning modules reached for {result['tried']}"
    assert result["loaded"] == []


def test_facade_resolves_every_public_name() -> None:
    for name in overlord.__all__:
        value = getattr(overlord, name)
        assert getattr(value, "__name__", None) == name, name
    assert set(overlord.__all__) <= set(dir(overlord))
    with pytest.raises(AttributeError, match="no_such_name"):
        overlord.no_such_name  # noqa: B018
