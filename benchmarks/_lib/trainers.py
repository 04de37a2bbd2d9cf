"""Part (a) of ``benchmarks/faults.py`` on Ray: trainers as processes of their own, SIGKILLed.

The job runs on Ray (served by the benchmark's process, as ``overlord serve``
would); every trial starts one process per DP rank, which connects with
``overlord.connect(job, rank, state=)`` (no state for the first), writes its
dump lines, saves a checkpoint every ``every`` steps with
:func:`overlord.checkpoint.save`, and kills itself with SIGKILL after the
trial's kill step. The next trial's processes restart from a checkpoint drawn
among all those written so far; a restart the job refuses is retried from the
newest; if the newest is refused too, the trials stop there (the job is not
started again). What each restart serves is checked against the uninterrupted
run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from overlord import Loader
from overlord.plan.spec import Plan

REFUSED = 3  # a trainer's exit status when the job refused its state

TRAINER = """
import os, signal, sys
from pathlib import Path
import overlord
from overlord import checkpoint
from overlord.errors import LoaderError
from overlord.ops.run import dump_line

job, rank, state_file, kill, out, ckpt, every = sys.argv[1:8]
rank, kill, every = int(rank), int(kill), int(every)
state = checkpoint.load(state_file) if state_file else None
try:
    client = overlord.connect(job, rank=rank, state=state, stop_step=kill + 1)
except LoaderError as e:
    print(" ".join(str(e).split()))
    sys.exit(3)
mine = Path(ckpt) / f"rank-{rank}"
with open(out, "a") as f:
    for batch in client:
        f.write(dump_line(batch) + "\\n")
        f.flush()
        if (batch.step + 1) % every == 0:
            checkpoint.save(mine, client.state_dict())
        if batch.step == kill:
            # synchronous training: a collective keeps a rank from dying before its peers
            # took the step (they would wait on it forever); its consumption notices landed
            client.flush()
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _spawn(job: str, dp: int, state: Path | None, kill: int, out: Path, ckpt: Path,
           every: int, env: dict[str, str]) -> tuple[bool, str]:  # fmt: skip
    """Run the trainers of every rank to ``kill``; (refused, the refusal's message)."""
    procs = []
    for r in range(dp):
        state_file = "" if state is None else str(state.parent.parent / f"rank-{r}" / state.name)
        args = [job, str(r), state_file, str(kill), str(out), str(ckpt), str(every)]
        procs.append(subprocess.Popen([sys.executable, "-c", TRAINER, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    refused, message = False, ""
    for p in procs:
        so, se = p.communicate(timeout=300)
        if p.returncode == REFUSED:
            refused, message = True, so.strip()
        elif p.returncode not in (0, -9):
            raise RuntimeError(f"a trainer failed (rc {p.returncode}): {se[-2000:]}")
    return refused, message


def ray_trials(plan: Plan, root: Path, want: dict[tuple[int, int], str], steps: int, every: int,
               count: int, seed: int) -> dict[str, Any]:  # fmt: skip
    """``count`` kills and restarts of trainer processes against a job on Ray."""
    import ray

    rng = random.Random(seed)
    dp = plan.world.dp
    ckpt = root / "ckpt"
    rows: list[dict[str, Any]] = []
    first_exact = False
    with Loader(plan, runtime="ray", job="faults-trials"):
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        start, state = 0, None
        for trial in range(count + 1):
            last = trial == count
            kill = min(steps - 1, start + (every if last else rng.randrange(1, 3 * every)))
            out = root / f"trial-{trial}.jsonl"
            refused, message = _spawn("faults-trials", dp, state, kill, out, ckpt, every, env)
            if refused and rows:  # the job refused the drawn checkpoint: from the newest
                rows[-1]["refused"] = message
                newest = max(_saved(ckpt, kill_before=rows[-1]["ran"][1]))
                state = ckpt / "rank-0" / f"step-{newest:08d}.json"
                start = newest
                kill = min(steps - 1, start + (every if last else rng.randrange(1, 3 * every)))
                refused, message = _spawn("faults-trials", dp, state, kill, out, ckpt, every, env)
                if refused:
                    rows[-1]["failed"] = message
                    break
            lines = out.read_text().splitlines() if out.exists() else []
            exact = bool(lines) and all(
                want.get((d["step"], d["rank"])) == line
                for line in lines for d in [json.loads(line)]
            )  # fmt: skip
            if rows:  # the checkpoints are not compared with the uninterrupted states here
                rows[-1].update(exact=exact, lines_exact=exact, states_exact=None)
            else:
                first_exact = exact
            if last:
                break
            saved = _saved(ckpt, kill_before=kill)
            chosen = rng.choice(saved) if saved else 0
            rows.append({"trial": trial, "ran": (start, kill), "restart": chosen,
                         "newest": saved[-1] if saved else 0, "refused": None, "failed": None,
                         "exact": False, "lines_exact": False, "states_exact": None})  # fmt: skip
            state = ckpt / "rank-0" / f"step-{chosen:08d}.json" if saved else None
            start = chosen
    return {"rows": rows, "first_exact": first_exact, "trials": len(rows),
            "exact": sum(r["exact"] for r in rows),
            "lines_exact": sum(r["exact"] for r in rows), "states_exact": None,
            "refused": sum(r["refused"] is not None for r in rows),
            "failed": sum(r["failed"] is not None for r in rows),
            "as_chosen": sum(r["exact"] and r["refused"] is None for r in rows),
            "older": sum(r["restart"] < r["newest"] for r in rows)}  # fmt: skip


def _saved(ckpt: Path, kill_before: int) -> list[int]:
    """Steps of the checkpoints every rank saved, up to the step after ``kill_before``."""
    steps = None
    for rank_dir in sorted(ckpt.glob("rank-*")):
        mine = {int(p.name[5:13]) for p in rank_dir.glob("step-*.json")}
        steps = mine if steps is None else steps & mine
    return sorted(s for s in (steps or set()) if s <= kill_before + 1)
