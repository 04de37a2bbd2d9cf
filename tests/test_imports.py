"""The package's structure: its layers in order, no cycles, light planning modules, sizes.

The package is layered (``docs/internals/architecture.md``): a module imports only its own
package and the layers below it, type-only imports (``if TYPE_CHECKING``) included, since
they record a dependency as real as any other. The planning modules (``overlord.plan``) are
pure functions over numpy arrays and pydantic models; a tool that only validates or plans
must be able to import them without pyarrow, fsspec, Ray or torch. The package facade
(``overlord/__init__.py``) imports its public names lazily so that importing
``overlord.plan.spec`` does not drag the loader in.
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


def _imports(tree: ast.AST, type_checking: bool = True) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth (in functions too); ``if TYPE_CHECKING`` ones too
    unless ``type_checking`` is false."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
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


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports (module level, in functions, type-only)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree, type_checking):
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


def test_import_graph_sees_function_level_and_type_only_imports() -> None:
    graph = import_graph()
    # overlord/plans.py imports sources/files.py inside validate_plan
    assert "overlord.sources.files" in graph["overlord.plans"]
    # the facade names its public modules under TYPE_CHECKING (and in strings)
    assert "overlord.loader" in graph["overlord"]
    assert "overlord.loader" not in import_graph(type_checking=False)["overlord"]
    # ``from overlord.state import checkpoint`` is an edge to the submodule
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


# The layers, lowest first. A module may import its own unit and the units of lower layers;
# a unit is a package (``overlord.plan``) or a top-level module. The public face is one unit:
# its modules build on each other (``overlord.hf`` on ``overlord.torch``).
PUBLIC_FACE = (
    "overlord",
    "overlord.loader",
    "overlord.streams",
    "overlord.serve",
    "overlord.torch",
    "overlord.hf",
    "overlord.checkpoint",
    "overlord.plans",
    "overlord.replays",
)
LAYERS: list[tuple[str, ...]] = [
    ("overlord.errors", "overlord.world", "overlord.blocks"),
    ("overlord.plan",),
    ("overlord.sources", "overlord.state", "overlord.monitor", "overlord.runtime"),
    ("overlord.batch",),
    ("overlord.roles",),
    ("overlord.dist",),
    PUBLIC_FACE,
    ("overlord.ops",),
    ("overlord.__main__",),  # ``python -m overlord``: the command
]


def unit_of(module: str) -> str:
    """The unit a module belongs to: its package under ``overlord``, or the public face."""
    if module in PUBLIC_FACE:
        return "public face"
    parts = module.split(".")
    return ".".join(parts[:2])


def layer_of(module: str) -> int:
    unit = unit_of(module)
    for i, layer in enumerate(LAYERS):
        if unit == "public face" and layer is PUBLIC_FACE or unit in layer:
            return i
    raise AssertionError(f"{module} belongs to no layer: add its unit to LAYERS")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a unit that is neither ``a``'s own nor in a lower layer."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            if unit_of(a) != unit_of(b) and layer_of(b) >= layer_of(a):
                bad.append(f"{a} -> {b}")
    return bad


def test_layer_rule_reports_an_upward_and_a_sideways_import() -> None:
    graph = {
        "overlord.plan.spec": {"overlord.errors", "overlord.sources.files"},
        "overlord.sources.files": {"overlord.state.format", "overlord.plan.spec"},
        "overlord.roles.planner": {"overlord.roles.api", "overlord.batch.rows"},
    }
    assert layer_violations(graph) == [
        "overlord.plan.spec -> overlord.sources.files",
        "overlord.sources.files -> overlord.state.format",
    ]


def test_every_module_imports_only_its_own_unit_and_the_layers_below() -> None:
    graph = import_graph()
    for module in graph:
        layer_of(module)  # every module is placed
    violations = layer_violations(graph)
    assert violations == [], "imports against the layer order:\n" + "\n".join(violations)


# what a role may know of the runtime layer: the seam (its package's face, which imports no
# runtime), its capabilities' Protocols, and threads; never a runtime (inline, ray, hosting)
SEAM = {"overlord.runtime", "overlord.runtime.base", "overlord.runtime.objects"}
SEAM |= {"overlord.runtime.threads"}


def test_the_seam_package_imports_no_runtime() -> None:
    assert import_graph()["overlord.runtime"] <= SEAM | {"overlord.runtime.hosting"}
    hosting = import_graph()["overlord.runtime.hosting"]
    assert not hosting & {"overlord.runtime.inline", "overlord.runtime.ray_runtime"}


def test_no_module_under_roles_names_a_runtime() -> None:
    graph = import_graph()
    runtimes = {m for m in MODULES if m.startswith("overlord.runtime.")} - SEAM
    found = {r: sorted(graph[r] & runtimes) for r in graph if r.startswith("overlord.roles.")}
    assert {r: t for r, t in found.items() if t} == {}


def code_lines(path: Path) -> int:
    """Lines of code: docstrings, comments and blank lines not counted."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    prose: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                prose.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    count = 0
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.strip()
        if text and not text.startswith("#") and number not in prose:
            count += 1
    return count


def test_code_lines_skip_docstrings_comments_and_blanks(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        '"""Doc.\n\nMore."""\n\n# note\nx = 1\n\n\ndef f():\n    """One."""\n    return 1\n'
    )
    assert code_lines(f) == 3


MAX_CODE_LINES = 450


def test_modules_are_sized_by_concept() -> None:
    sizes = {m: code_lines(p) for m, p in MODULES.items()}
    over = {m: n for m, n in sizes.items() if n > MAX_CODE_LINES}
    assert over == {}, f"modules over {MAX_CODE_LINES} lines of code: split them by concept"


def test_examples_import_only_the_public_surface() -> None:
    public = set(PUBLIC_FACE) | {"overlord.batch", "overlord.errors", "overlord.world"}
    for path in sorted((ROOT / "examples").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _imports(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if not node.level
                else []
            )
            for name in names:
                if name == "overlord" or name.startswith("overlord."):
                    assert name in public, f"{path.name} imports {name}, not the public surface"
