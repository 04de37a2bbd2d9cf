"""overlord: a disaggregated, cost-balanced, deterministic data loader for many sources.

The public names are imported on first use (PEP 562), so that ``import overlord.plan.spec``
and the other pure planning modules need numpy, pydantic and pyyaml only: the loader, its
roles and runtimes (pyarrow, fsspec, Ray) load when ``overlord.Loader`` or
``overlord.connect`` is first touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overlord.batch import Batch, Sample
    from overlord.errors import (
        CheckpointError,
        LoaderError,
        OverlordError,
        PlanError,
        SourceError,
    )
    from overlord.loader import Loader
    from overlord.plan.spec import Plan
    from overlord.plans import load_plan, validate_plan
    from overlord.replays import replay
    from overlord.serve import connect
    from overlord.streams import RankStream
    from overlord.world import World

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "CheckpointError",
    "Loader",
    "LoaderError",
    "OverlordError",
    "Plan",
    "PlanError",
    "RankStream",
    "Sample",
    "SourceError",
    "World",
    "connect",
    "load_plan",
    "replay",
    "validate_plan",
]

# public name -> the module that defines it
_HOMES = {
    "Batch": "overlord.batch",
    "Sample": "overlord.batch",
    "CheckpointError": "overlord.errors",
    "LoaderError": "overlord.errors",
    "OverlordError": "overlord.errors",
    "PlanError": "overlord.errors",
    "SourceError": "overlord.errors",
    "Loader": "overlord.loader",
    "Plan": "overlord.plan.spec",
    "load_plan": "overlord.plans",
    "validate_plan": "overlord.plans",
    "replay": "overlord.replays",
    "connect": "overlord.serve",
    "RankStream": "overlord.streams",
    "World": "overlord.world",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use, then keep it here."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'overlord' has no attribute '{name}'")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the public ones not yet imported included."""
    return sorted({*globals(), *__all__})
