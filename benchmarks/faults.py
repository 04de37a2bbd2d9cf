"""The fault table: trainers killed and restarted, damaged checkpoints, hostile inputs, flat memory.

Four parts, each with its verdicts (``benchmarks/chaos.py`` kills roles instead):

(a) **Trainers killed and restarted from earlier checkpoints.** A job runs
    (the embedded runtime, in this process: the job's roles stay up, as under
    ``overlord serve``); its trainers (every DP rank) checkpoint every
    ``--every`` steps and are killed at a random step; new trainers restart
    from a checkpoint chosen at random among those the job wrote so far, with
    the state API of a live job (the planner's ``reconnect``, the call
    ``overlord.connect(job, rank, state=)`` makes). Each trial's batches are
    checked, line for line, against the uninterrupted run's dump. A restart
    the job refuses (a checkpoint older than ``recovery.rewind_steps`` allows)
    is counted as refused, with its message, and the trial goes on from the
    newest checkpoint.
(b) **Damaged checkpoints and journals** (:mod:`benchmarks._lib.damage`):
    each must be refused, with a message naming the file (and the field).
(c) **Hostile inputs** (:mod:`benchmarks._lib.hostile`): each named or
    skipped and counted, the run's peak memory against the same run without
    it (at most 1.5x) and its wall time against its timeout.
(d) ``--rss``: the resident memory of an embedded run of 64 sources at steps
    10,000, 20,000 ... 100,000 (a small token budget per step); its drift from
    step 10,000 to the last must be within 2%.

    .venv/bin/python -m benchmarks.faults              # (a) to (c), a few minutes
    .venv/bin/python -m benchmarks.faults --quick      # smaller: the test's mode
    .venv/bin/python -m benchmarks.faults --rss        # (d), several minutes
    .venv/bin/python -m benchmarks.faults --rss --quick
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._lib import damage, hostile
from benchmarks._lib.corpus import write_corpus
from overlord import Loader, load_plan
from overlord.errors import LoaderError
from overlord.ops.run import dump_line
from overlord.plan.spec import Plan, validate_plan
from overlord.roles.api import PlannerRole
from overlord.roles.client import Client
from overlord.roles.rewind import STAMP, Stamps

PEAK_RATIO = 1.5  # a hostile input's run peaks within this of the run without it
RSS_DRIFT = 0.02  # resident memory from step RSS_FROM to the last
RSS_FROM = 10_000


# ---- (a) trainers killed and restarted --------------------------------------------------------


def trial_plan(root: Path, rewind_steps: int) -> Plan:
    """A small two-source job of two DP ranks that keeps ``rewind_steps`` steps to rewind."""
    plan = load_plan(write_corpus(root, sources=2, files=3, docs=150))
    data = plan.model_dump(mode="json")
    data["world"]["dp"] = 2
    data["batch"].update(tokens_per_step=2048, max_seq_len=512)
    data["recovery"]["rewind_steps"] = rewind_steps
    return validate_plan(data, base_dir=plan.base_dir)


def as_a_job(loader: Loader) -> Loader:
    """An embedded Loader whose planner stamps its states, as a job on Ray does.

    Only a job's states can be reconnected with (``overlord.connect(job, rank,
    state=)``); an embedded Loader hands out unstamped ones, since no trainer
    process reconnects to it.
    """
    planner = loader.planner.obj  # type: ignore[attr-defined]
    planner.stamps = planner.consumption.stamps = Stamps(None)
    return loader


def restarted(loader: Loader, rank: int, state: dict[str, Any]) -> Any:
    """A trainer's new client of the live job, from its checkpoint ``state``."""
    # the killed trainers' consumption notices were sent before they died: they land before
    # a new process reconnects (seconds later, on Ray), not after
    loader._notices.flush()  # noqa: SLF001
    state = copy.deepcopy(state)  # as a checkpoint read from a file: the job's own
    # the embedded runtime's equivalent of overlord.connect(job, rank, state=): the same call
    start = loader.planner.call(PlannerRole.reconnect, rank, state).result()
    return Client(rank, loader._constructor_of[rank], loader.planner, start, None, None,
                  loader._notices)  # fmt: skip


def uninterrupted(plan: Plan, steps: int) -> tuple[dict[tuple[int, int], str], dict[int, Any]]:
    """The uninterrupted run: each (step, rank)'s dump line, and the state before each step."""
    lines, states = {}, {}
    with Loader(plan, runtime="inline") as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for step in range(steps):
            for c in clients:
                batch = next(c)
                lines[(batch.step, batch.rank)] = dump_line(batch)
            states[step + 1] = json.loads(json.dumps(clients[0].state_dict()))
    return lines, states


def trials(plan: Plan, steps: int, every: int, count: int, seed: int) -> dict[str, Any]:
    """``count`` kills and restarts of every trainer, checked against the uninterrupted run.

    A trial kills the trainers at a random step and restarts them from a random
    checkpoint the job wrote so far. It is exact when what the restarted trainers
    receive, up to the next kill, is the uninterrupted run's, line for line. (Whether
    the checkpoints they write equal the uninterrupted run's states is counted too; a
    state may differ and still resume the same stream.) A trial that is not exact
    leaves the job restarted from the uninterrupted run's state (and its checkpoints
    replaced by those), so that each trial is judged on its own.
    """
    want, truth = uninterrupted(plan, steps + 1)
    rng = random.Random(seed)
    dp = plan.world.dp
    saved: dict[int, dict[str, Any]] = {}  # the job's checkpoints, by step
    rows: list[dict[str, Any]] = []
    first_exact = False
    loader = as_a_job(Loader(plan, runtime="inline"))
    try:
        clients = [loader.client(r) for r in range(dp)]
        start = 0
        for trial in range(count + 1):  # the last runs only to check the last restart
            last = trial == count
            kill = min(steps - 1, start + (every if last else rng.randrange(1, 3 * every)))
            lines_exact, states_exact = True, True
            for step in range(start, kill + 1):
                for c in clients:
                    batch = next(c)
                    lines_exact &= dump_line(batch) == want[(batch.step, batch.rank)]
                if (step + 1) % every == 0:
                    # as a checkpoint file holds it (the embedded runtime hands out its own)
                    states = [json.loads(json.dumps(c.state_dict())) for c in clients]
                    states_exact &= all(_bare(s) == truth[step + 1] for s in states)
                    saved[step + 1] = states[0]
            exact = lines_exact
            if rows:  # what the previous trial's restart served
                rows[-1].update(exact=exact, lines_exact=lines_exact, states_exact=states_exact)
            else:
                first_exact = exact
            if last:
                break
            # every trainer is killed after step `kill`: its clients are dropped unclosed
            row: dict[str, Any] = {"trial": trial, "ran": (start, kill), "restart": None,
                                   "newest": None, "refused": None, "failed": None}  # fmt: skip
            rows.append(row)
            older = sorted(s for s in saved if s <= kill + 1)
            chosen = row["restart"] = rng.choice(older) if older else 0
            row["newest"] = older[-1] if older else 0
            if not exact:  # the job went astray: judge the next trial from the true state
                saved = {k: truth[k] for k in saved}
            try:
                if not exact or not older:
                    raise _Restart
                clients = [restarted(loader, r, saved[chosen]) for r in range(dp)]
            except LoaderError as e:
                row["refused"] = " ".join(str(e).split())
                chosen = older[-1]  # the trial goes on from the newest, which the job keeps
                try:
                    clients = [restarted(loader, r, saved[chosen]) for r in range(dp)]
                except LoaderError as e2:  # the live job cannot go back: restart it from there
                    row["failed"] = " ".join(str(e2).split())
                    loader, clients = _new_job(loader, plan, saved.get(chosen))
            except _Restart:
                loader, clients = _new_job(loader, plan, saved.get(chosen))
            start = chosen
    finally:
        loader.close()
    return {"rows": rows, "exact": sum(r["exact"] for r in rows), "trials": len(rows),
            "first_exact": first_exact,
            "lines_exact": sum(r["lines_exact"] for r in rows),
            "states_exact": sum(r["states_exact"] for r in rows),
            "refused": sum(r["refused"] is not None for r in rows),
            "as_chosen": sum(r["exact"] and r["refused"] is None for r in rows),
            "failed": sum(r["failed"] is not None for r in rows),
            "older": sum(r["restart"] < r["newest"] for r in rows)}  # fmt: skip


def _bare(state: dict[str, Any]) -> dict[str, Any]:
    """A state without the job's stamp (the uninterrupted run's have none)."""
    return {k: v for k, v in state.items() if k != STAMP}


class _Restart(Exception):
    """The job is started again (from a state), not rewound."""


def _new_job(old: Loader, plan: Plan, state: dict[str, Any] | None) -> tuple[Loader, list[Any]]:
    old.close()
    loader = as_a_job(Loader(plan, runtime="inline", state=copy.deepcopy(state)))
    return loader, [loader.client(r) for r in range(plan.world.dp)]


# ---- (c) hostile inputs -----------------------------------------------------------------------


def hostile_table(
    root: Path, quick: bool, timeout_s: float, steps: int, only: str | None = None
) -> list[dict[str, Any]]:
    """Each hostile case (whose name holds ``only``), run with and without its hostile piece."""
    rows = []
    for case in hostile.CASES:
        if only is not None and only not in case.name:
            continue
        folder = root / case.name.replace(" ", "_").replace("(", "").replace(")", "")
        runs = {}
        for bad in (False, True):
            plan = case.write(folder / ("with" if bad else "without"), bad, quick)
            runs[bad] = hostile.run_case(plan, steps, timeout_s)
        shutil.rmtree(folder, ignore_errors=True)  # a huge line takes hundreds of MB
        with_it, without = runs[True], runs[False]
        ratio = with_it["peak_kib"] / max(1, without["peak_kib"])
        verdict = hostile.verdict(with_it)
        rows.append({
            "case": case.name,
            "size": case.quick_size if quick else case.size,
            "verdict": verdict,
            "peak_mib": with_it["peak_kib"] / 1024,
            "base_mib": without["peak_kib"] / 1024,
            "ratio": ratio,
            "wall_s": with_it["wall_s"],
            "timeout_s": timeout_s,
            "ok": verdict in ("named", "skipped") and ratio <= PEAK_RATIO
            and not with_it["timed_out"],
            "message": hostile.message(with_it),
        })  # fmt: skip
    return rows


# ---- (d) resident memory over 100,000 steps ---------------------------------------------------


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def rss_plan(root: Path, sources: int) -> Plan:
    """``sources`` small JSONL sources, equal weights, a small token budget per step."""
    rng = random.Random(5)
    entries = []
    for s in range(sources):
        folder = root / f"s{s:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "a.jsonl", "w") as f:
            for i in range(40):
                f.write(json.dumps({"text": f"s{s} d{i} " + "w " * rng.randrange(4, 60)}) + "\n")
        entries.append({"name": f"s{s:02d}", "path": f"s{s:02d}/*.jsonl", "format": "jsonl"})
    data = {
        "seed": 5,
        "sources": entries,
        "tokenizer": {"kind": "bytes"},
        "batch": {"tokens_per_step": 256, "max_seq_len": 64, "long_docs": "split"},
        "world": {"dp": 1},
        "loading": {"timeout_s": 60},
    }
    return validate_plan(data, base_dir=root)


def rss_run(plan: Plan, steps: int, every: int, trace: bool) -> dict[str, Any]:
    """Resident memory every ``every`` steps; with ``trace``, what grew (tracemalloc)."""
    import tracemalloc

    points: list[tuple[int, int]] = []
    first_snapshot = None
    grew: list[str] = []
    t0 = time.perf_counter()
    with Loader(plan, runtime="inline") as loader:
        client = loader.client(0)
        for step in range(steps):
            next(client)
            done = step + 1
            if done % every == 0:
                points.append((done, rss_kib()))
                print(f"    step {done:,}: {points[-1][1] / 1024:.1f} MiB", flush=True)
            # traced from half-way to RSS_FROM: what the first snapshot holds was allocated
            # since (what is replaced in steady state, the planner's history, included)
            if trace and done == RSS_FROM // 2:
                tracemalloc.start(12)
            if trace and done == RSS_FROM:
                first_snapshot = tracemalloc.take_snapshot()
        if trace and first_snapshot is not None:
            top = tracemalloc.take_snapshot().compare_to(first_snapshot, "traceback")
            grew = [f"{s.size_diff / 1024:+.0f} KiB {s.count_diff:+d}: {s.traceback.format()[-1]}"
                    for s in top[:8]]  # fmt: skip
            tracemalloc.stop()
    # from step 10,000 (the planner's history, HISTORY_STEPS, fills in the first 4,096)
    start, base = next(((s, k) for s, k in points if s >= RSS_FROM), points[0])
    drift = (points[-1][1] - base) / base
    return {"points": points, "drift": drift, "from": start, "ok": abs(drift) <= RSS_DRIFT,
            "grew": grew, "seconds": time.perf_counter() - t0}  # fmt: skip


# ---- the table --------------------------------------------------------------------------------


def print_trials(a: dict[str, Any]) -> None:
    print(f"(a) trainers killed and restarted from random earlier checkpoints: {a['exact']}/"
          f"{a['trials']} exact (batches {a['lines_exact']}, checkpoints "
          f"{'not compared' if a['states_exact'] is None else a['states_exact']}); "
          f"{a['as_chosen']}/{a['trials']} exact from the checkpoint chosen; "
          f"{a['older']} chose an older checkpoint than the newest, "
          f"{a['refused']} refused, {a['failed']} of those not resumed from the newest either "
          "(inline: the job restarted from it; ray: the trials stop)")  # fmt: skip
    for r in a["rows"]:
        to = f"step {r['restart']} (newest {r['newest']})"
        verdict = (
            "exact"
            if r["exact"]
            else (
                f"DIFFERS (batches {'exact' if r['lines_exact'] else 'differ'}, checkpoints "
                f"{ {True: 'exact', False: 'differ', None: 'not compared'}[r['states_exact']] })"
            )
        )
        note = f"  REFUSED: {r['refused'][:150]}" if r["refused"] else ""
        note += f"  NEWEST FAILED TOO: {r['failed'][:150]}" if r["failed"] else ""
        print(f"  trial {r['trial']:>2}: ran steps {r['ran'][0]:>3}..{r['ran'][1]:<3}, killed; "
              f"restart from {to}: {verdict}{note}")  # fmt: skip


def print_damage(rows: list[dict[str, Any]]) -> None:
    right = sum(r["refused"] == r["expected"] for r in rows)
    print(f"\n(b) damaged checkpoints and journals: {right}/{len(rows)} as expected")
    print("| file | damage | result | message |\n|---|---|---|---|")
    for r in rows:
        got = "refused" if r["refused"] else "resumed"
        mark = "" if r["refused"] == r["expected"] else " (UNEXPECTED)"
        print(f"| {r['what']} | {r['case']} | {got}{mark} | {r['message'][:140]} |")


def print_hostile(rows: list[dict[str, Any]]) -> None:
    ok = sum(r["ok"] for r in rows)
    print(f"\n(c) hostile inputs: {ok}/{len(rows)} named or skipped, within {PEAK_RATIO}x "
          "peak memory and their timeout")  # fmt: skip
    print("| input | size | verdict | peak MiB (without) | ratio | wall s / timeout | message |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        size = f"{r['size'] / (1 << 20):,.0f} MiB" if r["size"] else "-"
        print(f"| {r['case']} | {size} | {r['verdict']} | {r['peak_mib']:.0f} "
              f"({r['base_mib']:.0f}) | {r['ratio']:.2f}x | {r['wall_s']:.1f} / "
              f"{r['timeout_s']:.0f} | {r['message'][:110]} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer trials, smaller inputs")
    p.add_argument("--rss", action="store_true", help="part (d) only: memory over many steps")
    p.add_argument("--trace", action="store_true", help="with --rss: what grew (tracemalloc)")
    p.add_argument("--trials", type=int, help="default 20 (--quick: 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default="abc", help="which of (a), (b), (c) to run")
    p.add_argument("--runtime", default="inline", choices=("inline", "ray"),
                   help="(a): the job in this process, or on Ray with trainer processes "
                   "(run under tools/loopback)")  # fmt: skip
    p.add_argument("--cases", help="(c): only the hostile inputs whose name holds this")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    logging.getLogger("overlord").setLevel(logging.ERROR)  # each rewind logs a warning
    root = Path(tempfile.mkdtemp(prefix="overlord-faults-"))
    results: dict[str, Any] = {}
    try:
        if args.rss:
            steps, every = (20_000, 2_000) if args.quick else (100_000, 10_000)
            d = rss_run(rss_plan(root / "rss", 64), steps, every, args.trace)
            results["rss"] = d
            print(
                f"(d) RSS at 64 sources, every {every:,} steps ({d['seconds']:.0f} s): "
                + ", ".join(f"{s // 1000}k {kib / 1024:.1f} MiB" for s, kib in d["points"])
            )
            print(
                f"    drift from step {d['from']:,} to {steps:,}: {100 * d['drift']:+.2f}% "
                f"({'flat' if d['ok'] else 'NOT flat'} within {100 * RSS_DRIFT:.0f}%)"
            )
            for line in d["grew"]:
                print("    grew:", line)
        else:
            if "a" in args.parts:
                count = args.trials or (5 if args.quick else 20)
                plan = trial_plan(root / "trials", rewind_steps=4)
                steps = 40 if args.quick else 120
                if args.runtime == "ray":
                    from benchmarks._lib.trainers import ray_trials

                    want, _ = uninterrupted(plan, steps + 1)
                    (root / "ray").mkdir()
                    results["trials"] = ray_trials(plan, root / "ray", want, steps, 2, count,
                                                   args.seed)  # fmt: skip
                else:
                    results["trials"] = trials(plan, steps, 2, count, args.seed)
                print_trials(results["trials"])
            if "b" in args.parts:
                plan = trial_plan(root / "damage", rewind_steps=0)
                (root / "dmg").mkdir()
                results["damage"] = damage.damage_table(plan, root / "dmg", args.seed)
                print_damage(results["damage"])
            if "c" in args.parts:
                results["hostile"] = hostile_table(
                    root / "hostile", args.quick, 120.0, 20, args.cases
                )
                print_hostile(results["hostile"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
