"""The documentation: install names, the generated references, the pages' code blocks.

The blocks themselves run through Sybil (the repository's ``conftest.py``); these
tests check what Sybil cannot: that every block is one it runs or one marked as
not run with a reason, that install lines name this distribution, that the
plan reference covers every field with a description, and that the site's nav
lists every page.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUN = {"python", "bash", "sh", "console", "yaml"}  # the languages conftest.py runs
SHOWN = {"text"}  # listings: output, transcripts of measurements, diagrams
SKIP = re.compile(r'<!-- skip: next "(?P<reason>[^"]+)" -->')


def _reference() -> ModuleType:
    path = ROOT / "docs" / "hooks" / "generated_reference.py"
    spec = importlib.util.spec_from_file_location("generated_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _distribution() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["name"])


def _fences(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, the line before)`` of every fenced block that opens on a page."""
    lines = page.read_text().split("\n")
    found, inside = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if not inside:
                found.append((i + 1, line[3:].strip(), lines[i - 1] if i else ""))
            inside = not inside
    return found


def test_the_distribution_is_overlord_data():
    assert _distribution() == "overlord-data"


def test_install_lines_name_the_distribution():
    dist = _distribution()
    named = 0
    for page in PAGES:
        for n, line in enumerate(page.read_text().split("\n"), 1):
            for rest in re.findall(r"pip install\s+([^`#\n]*)", line):
                for token in rest.split():
                    token = token.strip("'\"`),;")
                    if not token or token.startswith(("-", ".", "/")):
                        continue
                    name = re.split(r"[\[<>=!~;]", token)[0]
                    if name.lower().startswith("overlord"):
                        named += 1
                        where = f"{page.relative_to(ROOT)}:{n}"
                        assert name == dist, f"{where}: installs {name!r}, the project is {dist!r}"
    assert named >= 5, "the README and the docs should say how to install overlord"


def test_every_plan_field_has_a_description():
    ref = _reference()
    assert ref.missing_descriptions() == [], "add description= to these fields"
    assert ref.stale_pending() == [], "these fields have a description now: drop them from PENDING"


def test_the_plan_reference_lists_every_field_of_every_model():
    ref = _reference()
    text = ref.plan_reference()
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    models = ref.plan_models()
    assert {m.__name__ for m, _ in models} >= {"Plan", "SourceSpec", "BatchSpec", "World"}
    for model, _ in models:
        section = sections[model.__name__]
        for name in model.model_fields:
            assert f"| `{name}` |" in section, f"{model.__name__}.{name} is not in the reference"


def test_metrics_are_in_the_reference_and_the_guide():
    ref = _reference()
    names = list(ref.metrics_table())
    generated = ref.metrics_reference()
    guide = (ROOT / "docs" / "guides" / "monitoring.md").read_text()
    assert len(names) >= 10
    for name in names:
        assert f"`{name}`" in generated
        assert f"`{name}" in guide, f"{name} is missing from the monitoring guide's table"


def test_the_cli_reference_lists_every_command():
    ref = _reference()
    text = ref.cli_reference()
    for command in ("demo", "validate", "run", "plan", "serve", "status", "diff", "replay", "why",
                    "simulate"):
        assert f"## overlord {command}\n" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_runs_or_says_why_not(page: Path):
    for line, language, before in _fences(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        assert language in RUN | SHOWN, f"{where}: a block needs a language of {RUN | SHOWN}"
        if before.startswith("<!-- skip"):
            assert SKIP.fullmatch(before), f'{where}: write <!-- skip: next "why" -->'


ISSUE_NUMBER = re.compile(r"\bissues?[ -]\d+|(?<![\w:/])#\d+\b", flags=re.IGNORECASE)
# in code, "#12" is also a chunk id or an HTML entity: only a reference in parentheses counts
CODE_ISSUE_NUMBER = re.compile(r"\bissues?[ -]\d+|\(#\d+\)", flags=re.IGNORECASE)
CODE = sorted(
    p for d in ("overlord", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers(page: Path):
    found = ISSUE_NUMBER.findall(page.read_text())
    assert found == [], f"{page.relative_to(ROOT)}: history belongs in the git log: {found}"


def test_no_issue_numbers_in_the_code():
    found = {
        str(p.relative_to(ROOT)): hits
        for p in CODE
        if p.name != "test_docs.py" and (hits := CODE_ISSUE_NUMBER.findall(p.read_text()))
    }
    assert found == {}, f"history belongs in the git log: {found}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().split("\n")) <= 150


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_the_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = _nav_pages(config["nav"])
    pages = [str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")]
    assert sorted(listed) == sorted(pages)


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _missing_code_names() -> list[str]:
    """Files (``overlord/x/y.py``) and modules (``overlord.x.y[.attr]``) the docs name."""
    missing = set()
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"overlord/[A-Za-z0-9_/]+\.py", text):
            if not (ROOT / path).is_file():
                missing.add(path)
        for dotted in re.findall(r"\boverlord(?:\.[a-z_]+)+", text):
            parts = dotted.split(".")
            if len(parts) < 3 or _module_file(parts):
                continue
            home = _module_file(parts[:-1])
            if home is None or not re.search(rf"\b{parts[-1]}\b", home.read_text()):
                missing.add(dotted)
    return sorted(missing)


@pytest.mark.xfail(
    not (ROOT / "overlord" / "ops").is_dir(),
    reason="the docs name the package layout of overlord/ops, overlord/state, overlord/batch...",
    strict=True,
)
def test_the_code_the_docs_name_exists():
    assert _missing_code_names() == []


def test_the_readme_links_to_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


@pytest.mark.integration
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """What ``make docs`` runs: a broken link, an unlisted page or a failing hook fails it."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    plan_page = (tmp_path / "site" / "reference" / "plan" / "index.html").read_text()
    assert "max_seq_len" in plan_page and "SourceSpec" in plan_page  # generated at build
