"""Chaos: kill SourceLoaders, DataConstructors and the Planner while a trainer consumes.

A plan runs on Ray for many steps. Before chosen steps a role is killed, by
``ray.kill`` or by SIGKILL of its process. The trainer here is one driver that
takes every rank's batch of a step, then "trains" for ``--step-time`` seconds.

Pass (checked, and printed):
- the dump equals the uninterrupted embedded run's, line for line (no sample
  missing or repeated, same order, same ranks);
- after the job closes, no overlord actor process is left and the shared
  memory folder holds what it held before;
- peak memory (PSS of every process of the run) stays within 25% of the same
  run without faults.

Figures: the longest wait of the trainer for a batch, against the step time of
the fault-free run, with shadows (default) and without (``--shadows 0``), and
each failover's time as the planner saw it. The journal's bytes per step are
measured by ``benchmarks/journal.py``.

    tools/loopback .venv/bin/python -m benchmarks.chaos            # about two minutes
    tools/loopback .venv/bin/python -m benchmarks.chaos --quick
"""

from __future__ import annotations

import argparse
import io
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._lib.corpus import write_corpus
from benchmarks._lib.procfs import ACTOR_TITLES, rollup, run_pids
from overlord import Loader, load_plan
from overlord.ops.run import dump_line, run_plan
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.api import ConstructorRole, LoaderRole, OpsRole

ROLES = ("loader", "constructor", "planner")


@dataclass(frozen=True)
class Kill:
    step: int  # before the trainer asks for this step
    role: str  # loader, constructor or planner
    how: str  # "ray.kill" or "sigkill"


@dataclass
class Result:
    lines: list[str]
    waits: list[float]  # seconds the trainer waited for each step's batches
    peak_pss: int
    events: list[dict[str, Any]] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)
    shm_before: set[str] = field(default_factory=set)
    shm_after: set[str] = field(default_factory=set)


def with_shadows(plan: Plan, shadows: int | None) -> Plan:
    data = plan.model_dump(mode="json")
    for s in data["sources"]:
        s["shadows"] = shadows
    return validate_plan(data, base_dir=plan.base_dir)


def schedule(steps: int, kills: int, seed: int, roles: tuple[str, ...] = ROLES) -> list[Kill]:
    """``kills`` kills at random steps (after the first few), cycling through ``roles``."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(3, steps - 2), kills))
    return [
        Kill(s, roles[i % len(roles)], rng.choice(("ray.kill", "sigkill")))
        for i, s in enumerate(at)
    ]


def reference(plan: Plan, steps: int) -> list[str]:
    out = io.StringIO()
    run_plan(plan, steps, runtime="inline", dump=out, progress=False)
    return out.getvalue().splitlines()


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _kill(loader: Loader, kill: Kill, rng: random.Random) -> str:
    import ray

    handle: Any
    if kill.role == "planner":
        handle, pid_of = loader.planner, OpsRole.pid
    elif kill.role == "constructor":
        handle, pid_of = rng.choice(loader.constructors), ConstructorRole.pid
    else:
        primaries = [slot[0] for slots in loader.slots().values() for slot in slots if slot]
        handle, pid_of = rng.choice(primaries), LoaderRole.pid
        handle = getattr(handle, "group", handle)  # a group member: its process
    if kill.how == "sigkill":
        pid = handle.call(pid_of).result()
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL {handle.name} (pid {pid})"
    # planner and constructors are restarted by Ray; loaders are replaced by the planner
    ray.kill(handle.actor, no_restart=kill.role == "loader")
    return f"ray.kill {handle.name}"


class _PeakPss:
    """Samples the total PSS of every process of this run on a thread."""

    def __init__(self, every: float = 0.2):
        self.peak, self.every = 0, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pss = sum((rollup(p) or {}).get("pss", 0) for p in run_pids({os.getpid()}))
            pss += (rollup(os.getpid()) or {}).get("pss", 0)
            self.peak = max(self.peak, pss)
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def actor_processes() -> list[str]:
    """Live processes of overlord actors (Ray titles a process by the actor it runs)."""
    out = []
    for pid in run_pids({os.getpid()}):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(ACTOR_TITLES):
            out.append(f"{title} (pid {pid})")
    return out


def run(
    plan: Plan, steps: int, kills: list[Kill], step_time: float, job: str, seed: int = 0
) -> Result:
    """Consume ``steps`` steps on Ray, killing roles as ``kills`` says."""
    rng = random.Random(seed)
    shm_before = _shm()
    meter = _PeakPss()
    lines: list[str] = []
    waits: list[float] = []
    by_step = {k.step: k for k in kills}
    loader = Loader(plan, runtime="ray", job=job)
    events: list[dict[str, Any]] = []
    try:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(steps):
            if step in by_step:
                what = _kill(loader, by_step[step], rng)
                events.append({"step": step, "kill": what})
            t0 = time.perf_counter()
            batches = [next(c) for c in clients]
            waits.append(time.perf_counter() - t0)
            lines += [dump_line(b) for b in batches]
            time.sleep(step_time)  # the training step
        events += loader.stats()["events"]
    finally:
        loader.close()
    peak = meter.stop()
    deadline = time.monotonic() + 20
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(0.25)
    return Result(lines, waits, peak, events, actor_processes(), shm_before, _shm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kills", type=int, default=9)
    ap.add_argument("--step-time", type=float, default=0.2, help="simulated training step (s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="40 steps, 3 kills")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.kills = 40, 3
    import ray

    from overlord.runtime.ray_runtime import init_ray

    init_ray(None)
    root = Path(tempfile.mkdtemp(prefix="overlord-chaos-"))
    plan = load_plan(write_corpus(root))
    want = reference(plan, a.steps)
    kills = schedule(a.steps, a.kills, a.seed)
    print(f"plan: {root / 'plan.yaml'}; {a.steps} steps; kills: {kills}")
    rows = []
    for label, shadows, ks in [
        ("fault-free", None, []),
        ("kills, 1 shadow", 1, kills),
        ("kills, no shadow", 0, kills),
    ]:
        res = run(with_shadows(plan, shadows), a.steps, ks, a.step_time, f"chaos-{len(rows)}")
        exact = res.lines == want
        rows.append((label, res, exact))
        for e in res.events:
            print(f"  [{label}] {e}")
    base = rows[0][1]
    step = a.step_time + sum(base.waits[1:]) / len(base.waits[1:])
    print(f"\nfault-free step time (training {a.step_time:.2f} s + mean wait): {step:.3f} s")
    print("waits exclude the first step (actors starting: 'first batch')\n")
    print(
        "| run | exact | first batch (s) | longest wait (s) | / step time | "
        "peak PSS (MiB) | vs fault-free |"
    )
    print("|---|---|---|---|---|---|---|")
    ok = True
    for label, res, exact in rows:
        ratio = res.peak_pss / base.peak_pss
        longest = max(res.waits[1:])
        print(
            f"| {label} | {'yes' if exact else 'NO'} | {res.waits[0]:.2f} | {longest:.3f} | "
            f"{longest / step:.2f} | {res.peak_pss / 2**20:.0f} | {ratio:.2f} |"
        )
        ok &= exact and ratio <= 1.25 and not res.leftover and res.shm_after <= res.shm_before
        if res.leftover:
            print(f"  left over after close: {res.leftover}")
        if not res.shm_after <= res.shm_before:
            print(f"  new in /dev/shm: {sorted(res.shm_after - res.shm_before)}")
    print("\nlongest wait in the 3 steps from a kill, by the role killed (s, and / step time):\n")
    print("| run | " + " | ".join(ROLES) + " |")
    print("|---|" + "---|" * len(ROLES))
    for label, res, _ in rows[1:]:
        cells = []
        for role in ROLES:
            ws = [max(res.waits[k.step : k.step + 3]) for k in kills if k.role == role]
            cells.append(f"{max(ws):.3f} ({max(ws) / step:.2f})" if ws else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    fails = [e for _, r, _ in rows for e in r.events if e.get("event") == "failover"]
    if fails:
        secs = sorted(e["seconds"] for e in fails)
        print(
            f"\nfailover time in the planner: median {secs[len(secs) // 2] * 1e3:.1f} ms, "
            f"max {secs[-1] * 1e3:.1f} ms over {len(secs)} failovers"
        )
    ray.shutdown()
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
