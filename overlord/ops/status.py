"""``overlord status JOB``: a live terminal table of a job served on Ray.

It asks the job's planner for what monitoring shows
(``OpsRole.monitor``, the figures of the Prometheus endpoint) and draws them
with ``rich``: one table per source, one per rank.
``--once`` prints it once; otherwise it is redrawn every ``interval`` seconds
until Ctrl-C.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from overlord.errors import LoaderError


def _mean_wait_ms(h: dict[str, Any]) -> str:
    return f"{1e3 * h['sum'] / h['count']:.2f}" if h["count"] else "-"


def _num(x: float, fmt: str = "{:.4g}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def render(job: str, f: dict[str, Any]) -> Any:
    """The tables of one reading of the figures (a ``rich`` renderable)."""
    from rich.console import Group
    from rich.table import Table

    plan_h = f["plan"]
    title = (
        f"overlord job '{job}': {f['steps']:,} steps consumed by every rank, next to plan "
        f"{f['next_step']}; failovers: "
        + ", ".join(f"{role} {n}" for role, n in f["failovers"].items())
        + f"; planning {_mean_wait_ms(plan_h)} ms per step"
    )
    src = Table(title=title, title_justify="left")
    for col in ("source", "tokens", "samples", "share", "target", "epoch", "loaders",
                "threads", "buffered tokens", "reads in flight", "skipped", "retries"):  # fmt: skip
        src.add_column(col, justify="left" if col == "source" else "right")
    for name, s in f["sources"].items():
        src.add_row(
            name,
            f"{s['tokens']:,}",
            f"{s['samples']:,}",
            f"{100 * s['share']:.2f}%",
            f"{100 * s['target_share']:.2f}%",
            str(s["epoch"]),
            str(s["loaders"]),
            str(s["threads"]),
            f"{s['buffered_tokens']:,}",
            str(s["reads_in_flight"]),
            str(s["skipped"]),
            str(s["retries"]),
        )
    k = f["seconds_per_cost"]
    ranks = Table(
        title=f"per rank (fitted seconds per unit of cost: {_num(k, '{:.4g}')})",
        title_justify="left",
    )
    for col in ("rank", "consumed up to", "mean wait (ms)", "waits", "predicted cost",
                "step s", "predicted step s"):  # fmt: skip
        ranks.add_column(col, justify="right")
    for r, h in enumerate(f["wait"]):
        ranks.add_row(
            str(r),
            str(f["consumed"][r]),
            _mean_wait_ms(h),
            str(h["count"]),
            _num(f["rank_cost"][r]),
            _num(f["rank_step_s"][r], "{:.4f}"),
            _num(f["rank_step_s_predicted"][r], "{:.4f}"),
        )
    return Group(src, ranks)


def status(
    job: str,
    address: str | None = None,
    once: bool = False,
    interval: float = 1.0,
    connect_timeout: float | None = None,
) -> int:
    """Show job ``job``'s figures: once, or redrawn every ``interval`` s until Ctrl-C.

    Joining the cluster gives up after ``connect_timeout`` seconds (None:
    ``OVERLORD_CONNECT_TIMEOUT``, else 60) with an error naming its address.
    """
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError as e:
        raise LoaderError("overlord status needs rich: pip install 'overlord-data[metrics]'") from e
    from overlord.roles.api import OpsRole
    from overlord.runtime.base import Handle
    from overlord.runtime.ray_runtime import init_ray, lookup
    from overlord.serve import job_address

    # the address given, else RAY_ADDRESS, else the job's own when this user serves it here
    init_ray(address or os.environ.get("RAY_ADDRESS") or job_address(job) or "auto",
             connect_timeout)  # fmt: skip
    planner: Handle[OpsRole] = lookup(job, "planner")

    def read() -> dict[str, Any]:
        return planner.call(OpsRole.monitor).result()

    console = Console()
    if once:
        console.print(render(job, read()))
        return 0
    with Live(render(job, read()), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            live.update(render(job, read()))
