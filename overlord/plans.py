"""Loading a plan as users do: the plan document's checks, then its sources' files.

:mod:`overlord.plan.spec` validates the document alone (its schema and the rules between its
fields); it is pure and imports no reader. The functions here, ``overlord.load_plan`` and
``overlord.validate_plan``, add the checks that need the sources: every path pattern must
match a file (local or behind an fsspec URL), and every named transform must import. All the
problems of both kinds come in one :class:`~overlord.errors.PlanError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from overlord.errors import PlanError
from overlord.plan import spec
from overlord.plan.plan_file import read_plan_file


def validate_plan(
    data: Any,
    base_dir: str | Path | None = None,
    origin: str | None = None,
    check_files: bool = False,
) -> spec.Plan:
    """Validate a plan from plain data (a dict as read from YAML) or a Plan.

    Raises :class:`PlanError` listing every problem with its field path: schema problems,
    problems between fields and, with ``check_files``, source patterns that match no file
    under ``base_dir`` (default: the working directory) and transforms that cannot load.
    """
    try:
        plan: spec.Plan | None = spec.validate_plan(data, base_dir=base_dir, origin=origin)
        problems: list[tuple[str, str]] = []
    except PlanError as e:
        if not isinstance(data, dict | spec.Plan):
            raise
        plan, problems = None, list(e.problems)
    if check_files:
        from overlord.sources.files import check_files as file_problems  # fsspec: on use only

        raw = data.model_dump(mode="json") if isinstance(data, spec.Plan) else data
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        problems += [p for p in file_problems(raw, base) if p not in problems]
    if problems or plan is None:
        raise PlanError(problems, origin)
    return plan


def load_plan(path: str | Path, check_files: bool = True) -> spec.Plan:
    """Read, validate and return the plan in a YAML (or JSON) file.

    Relative source paths are resolved against the file's folder. With ``check_files``
    every source's glob must match at least one file.
    """
    path = Path(path)
    data = read_plan_file(path)
    return validate_plan(data, base_dir=path.parent, origin=str(path), check_files=check_files)
