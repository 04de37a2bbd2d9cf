"""overlord: a disaggregated, cost-balanced, deterministic data loader for many sources."""

from overlord.batch import Batch, Sample
from overlord.errors import CheckpointError, LoaderError, OverlordError, PlanError, SourceError
from overlord.loader import Loader
from overlord.plan.spec import Plan, load_plan, validate_plan
from overlord.serve import connect
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
    "Sample",
    "SourceError",
    "World",
    "connect",
    "load_plan",
    "validate_plan",
]
