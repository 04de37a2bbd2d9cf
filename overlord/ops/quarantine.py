"""``overlord quarantine JOB add ID... [--from-step S]``: skip samples of a live job, from a step.

It reaches the job's planner by name, as ``overlord status`` does
(``OpsRole.add_quarantine``), and prints what was added and the step it
applies from. The planner refuses a step it has planned already, naming the
earliest it can take, an id that names no file of the job, a malformed id and
a pattern that matches no file: the command prints the refusal and exits 1.
``list`` prints the additions in force.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, found {value}")
    return value


def quarantine(
    job: str,
    action: str,
    ids: list[str],
    files: list[str],
    from_step: int | None = None,
    address: str | None = None,
    connect_timeout: float | None = None,
) -> int:
    """Add to job ``job``'s quarantine (``action`` ``add``) or print it (``list``)."""
    from overlord.roles.api import OpsRole
    from overlord.runtime.base import Handle
    from overlord.runtime.ray_runtime import init_ray, lookup
    from overlord.serve import job_address

    # the address given, else RAY_ADDRESS, else the job's own when this user serves it here
    init_ray(address or os.environ.get("RAY_ADDRESS") or job_address(job) or "auto",
             connect_timeout)  # fmt: skip
    planner: Handle[OpsRole] = lookup(job, "planner")
    if action == "list":
        stats: dict[str, Any] = planner.call(OpsRole.stats).result()
        print(json.dumps(stats.get("quarantine", {"entries": [], "samples": {}}), indent=2))
        return 0
    added = planner.call(OpsRole.add_quarantine, ids, files, from_step).result()
    what = f"{len(added['ids'])} sample id(s), {len(added['files'])} files pattern(s)"
    if added["added"]:
        print(f"overlord: job '{job}' quarantines {what} from step {added['from_step']}")
    else:
        print(f"overlord: job '{job}' already quarantines {what}: nothing added")
    return 0
