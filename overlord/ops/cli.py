"""``overlord``: the command line: every subcommand, its parser and its dispatch."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from overlord.errors import OverlordError
from overlord.loader import Loader
from overlord.ops import replay as replay_command
from overlord.ops import why as why_command
from overlord.ops.quarantine import non_negative_int
from overlord.ops.run import close_dump, open_dump, run_plan
from overlord.ops.run import dump_line as dump_line  # re-exported: its home was here
from overlord.ops.run import summarize as summarize  # re-exported: its home was here
from overlord.plan.spec import Plan
from overlord.plans import load_plan
from overlord.runtime import RUNTIMES
from overlord.state import checkpoint, runs
from overlord.state.checkpoint import check_state


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (``--steps 0`` is an error, not an empty run)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, found '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, found {value}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0 (``--connect-timeout``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, found '{text}'") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, found {text}")
    return value


def _with_dp(plan: Plan, dp: int | None) -> Plan:
    return plan if dp is None else plan.with_dp(dp)


def _with_metrics_port(plan: Plan, port: int | None) -> Plan:
    """``--metrics-port``: the plan's ``monitoring.port`` replaced."""
    if port is None:
        return plan
    from overlord.plan.spec import validate_plan

    data = plan.model_dump(mode="json")
    data["monitoring"]["port"] = port
    return validate_plan(data, base_dir=plan.base_dir)


def print_summary(s: dict[str, Any], out: TextIO | None = None) -> None:
    """The run summary, for people (on stdout by default)."""
    out = out or sys.stdout
    a, b = s["steps"]
    print(
        f"steps {a}..{b - 1}: {s['tokens']:,} tokens in {s['seconds']:.2f} s "
        f"({s['tokens_per_s']:,.0f} tokens/s), rows {100 * s['fill_mean']:.1f}% full",
        file=out,
    )
    print(
        f"balance ({s['balance_method']}): most loaded rank / lower bound = "
        f"{s['balance_mean']:.4f} mean, {s['balance_p95']:.4f} p95; "
        f"per-rank loader without balancing: {s['baseline_balance_mean']:.4f}",
        file=out,
    )
    for name, m in s["mixture"].items():
        real, want = 100 * m["realized"], 100 * m["target"]
        print(f"  {name:>16}: {real:6.2f}% of tokens (target {want:6.2f}%)", file=out)
    if s["skipped_records"]:
        print(f"skipped {s['skipped_records']} bad record(s) (on_error: skip), e.g.:", file=out)
        for e in s["skipped_examples"]:
            print(f"  {e}", file=out)
    if s["dropped_docs"]:
        print(f"dropped {s['dropped_docs']} document(s) (too long, long_docs: drop)", file=out)
    if s.get("records"):
        print(
            "records per source (each file counted once per loader that read it, "
            "not once per epoch; read-ahead included):",
            file=out,
        )
    for name, r in s.get("records", {}).items():
        print(
            f"  {name:>16}: {r['read']:,} read, {r['empty']:,} empty (not samples), "
            f"{r['skipped']:,} skipped (bad), {r['dropped']:,} dropped (too long); "
            f"{r['epochs']} epoch(s) begun",
            file=out,
        )
    if "quarantined_samples" in s:
        counts = ", ".join(f"{n} {c}" for n, c in s["quarantined_samples"].items())
        print(f"quarantined samples skipped in consumed steps: {counts}", file=out)
    if s["checkpoint_bytes"]:
        print(f"checkpoint: {s['checkpoint_bytes']} bytes", file=out)
    for name, sizes in s.get("scaling", {}).items():
        print(f"autoscaler, {name}:", file=out)
        for z in sizes:
            print(
                f"  step {z['step']:>6}: {z['loaders']} loader(s) x {z['threads']} thread(s), "
                f"supply {z['capacity_tokens_per_s']:,.0f} for demand "
                f"{z['demand_tokens_per_s']:,.0f} tokens/s, {z['cpu_cores']:.2f} cores",
                file=out,
            )
    for e in s.get("faults", []):
        print(f"fault at step {e['step']}: {e}", file=out)


def _cmd_validate(args: argparse.Namespace) -> int:
    from overlord.sources.probe import check_sources

    plan = load_plan(args.plan)
    problems = check_sources(plan)
    if problems:
        print(
            f"overlord: {args.plan}: {len(problems)} problem(s) opening the tokenizer and the "
            "first record of each source:",
            file=sys.stderr,
        )
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(
        f"{args.plan}: valid: {len(plan.sources)} source(s), {plan.rows_per_step} rows of "
        f"{plan.batch.max_seq_len} tokens per step, dp={plan.world.dp} "
        f"({plan.rows_per_rank} row(s) per rank), balance={plan.balance.method.value}"
    )
    return 0


def _folder(resume: str) -> Path:
    """The checkpoint folder of ``--resume`` (a folder, or one of its files)."""
    return Path(resume) if Path(resume).is_dir() else Path(resume).parent


def _cmd_run(args: argparse.Namespace) -> int:
    plan = _with_metrics_port(_with_dp(load_plan(args.plan), args.dp), args.metrics_port)
    state = checkpoint.load(args.resume) if args.resume else None
    if state is not None:  # a changed plan: refused fields named with their old values
        check_state(state, plan, runs.kept_plan(_folder(args.resume), state.get("fingerprint")))
    if state is not None and int(state["step"]) >= args.steps:
        print(
            f"the checkpoint is at step {state['step']}, nothing to do up to --steps {args.steps}"
        )
        return 0
    dump = open_dump(args.dump) if args.dump else None  # a bad path fails before connecting
    started = False
    if args.runtime == "ray":
        from overlord.runtime.ray_connect import init_ray

        # joined (or started) here, within --connect-timeout; the run's Loader then uses it
        started = init_ray(args.address, args.connect_timeout)
    try:
        summary = run_plan(
            plan,
            args.steps,
            runtime=args.runtime,
            dump=dump,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            state=state,
            report=args.report,
        )
    finally:
        if dump is not None:
            close_dump(dump)
        if started:
            from overlord.runtime.ray_connect import shutdown_ray

            shutdown_ray()
    print_summary(summary)
    if summary.get("report"):
        print(f"report: {summary['report']}")
    if summary.get("report_error"):  # after the summary: the run itself is not lost
        print(f"overlord: {summary['report_error']}", file=sys.stderr)
        return 1
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    plan = _with_dp(load_plan(args.plan), args.dp)
    with Loader(plan, build_batches=False) as loader:
        hist = loader.dry_run(args.steps)
    names = plan.source_names
    print("step  max/LB  none/LB  fill   " + "  ".join(f"{n[:10]:>10}" for n in names))
    for h in hist:
        lb = h["lower_bound"] or 1.0
        total = sum(h["tokens"]) or 1
        shares = "  ".join(f"{100 * t / total:9.1f}%" for t in h["tokens"])
        print(
            f"{h['step']:>4}  {h['max_cost'] / lb:6.4f}  {h['baseline_max_cost'] / lb:7.4f}  "
            f"{100 * h['fill']:5.1f}%  {shares}"
        )
    if hist:
        lbs = [h["lower_bound"] or 1.0 for h in hist]
        ratio = np.mean([h["max_cost"] / lb for h, lb in zip(hist, lbs)])
        base = np.mean([h["baseline_max_cost"] / lb for h, lb in zip(hist, lbs)])
        method = plan.balance.method.value
        print(f"mean max/LB {ratio:.4f} ({method}); without balancing {base:.4f}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from overlord.ops.simulate import print_simulation, simulate, write_json

    result = simulate(load_plan(args.plan), args.steps, args.step_seconds, progress=True)
    if args.json:
        write_json(args.json, result)
    print_simulation(result)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from overlord.serve import serve

    plan = _with_metrics_port(_with_dp(load_plan(args.plan), args.dp), args.metrics_port)

    def ready(loader: Loader) -> None:
        import ray

        address = ray.get_runtime_context().gcs_address
        url = loader.metrics_url
        if url is not None:
            print(f"overlord: metrics at {url}", flush=True)
        print(
            f"overlord: job '{args.name}' is ready on Ray at {address}: dp={plan.world.dp}, "
            f"{sum(len(v) for v in loader.slots().values())} source loader(s), "
            f"{len(loader.constructors)} data constructor(s), from step {loader.start_step}.\n"
            f"Trainers: RAY_ADDRESS={address} and overlord.connect('{args.name}', rank=r). "
            "Ctrl-C stops the job.",
            flush=True,
        )

    code = serve(
        plan, args.name, address=args.address, resume=args.resume, ready=ready,
        connect_timeout=args.connect_timeout,
    )  # fmt: skip
    how = f" by {signal.Signals(code - 128).name}" if code > 128 else ""
    print(f"overlord: job '{args.name}' stopped{how}", flush=True)
    return code


def _cmd_status(args: argparse.Namespace) -> int:
    from overlord.ops.status import status

    return status(
        args.job, address=args.address, once=args.once, interval=args.interval,
        connect_timeout=args.connect_timeout,
    )  # fmt: skip


def _cmd_quarantine(args: argparse.Namespace) -> int:
    from overlord.ops.quarantine import quarantine

    return quarantine(
        args.job, args.action, args.ids, args.files, args.from_step, args.address,
        args.connect_timeout,
    )  # fmt: skip


def _cmd_demo(args: argparse.Namespace) -> int:
    from overlord.ops.demo import run_demo

    return run_demo(Path(args.out), steps=args.steps, dp=args.dp)


def _connect_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect-timeout",
        type=seconds,
        metavar="SECONDS",
        help="give up joining the Ray cluster after this long, with an error naming its "
        "address (default: OVERLORD_CONNECT_TIMEOUT, else 60)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``overlord``."""
    p = argparse.ArgumentParser(prog="overlord", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="build a corpus from Python's own files and run a plan on it")
    d.add_argument("--out", default="overlord-demo", help="folder for corpus, plan and report")
    d.add_argument("--steps", type=positive_int, default=300)
    d.add_argument("--dp", type=int, default=4)
    d.set_defaults(func=_cmd_demo)

    v = sub.add_parser("validate", help="check a plan; print every problem")
    v.add_argument("plan")
    v.set_defaults(func=_cmd_validate)

    r = sub.add_parser("run", help="consume a plan as a trainer with every DP rank would")
    r.add_argument("plan")
    r.add_argument(
        "--steps", type=positive_int, default=100, help="stop after global step N (steps 0..N-1)"
    )
    r.add_argument("--dp", type=int, help="override world.dp")
    r.add_argument("--dump", help="write one JSON line per (step, rank)")
    r.add_argument("--checkpoint-dir", help="write checkpoints here")
    r.add_argument("--checkpoint-every", type=int, help="checkpoint every K steps")
    r.add_argument("--resume", help="continue from the newest checkpoint in this folder")
    r.add_argument("--runtime", default="inline", choices=list(RUNTIMES))
    r.add_argument(
        "--address",
        help="with --runtime ray: the Ray cluster to join (default: RAY_ADDRESS, else a new "
        "local instance of this command's own)",
    )
    _connect_timeout(r)
    r.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (0: free)"
    )
    r.add_argument("--report", help="write a Markdown report with PNG plots to this folder")
    r.set_defaults(func=_cmd_run)

    sv = sub.add_parser("serve", help="run a plan's roles as named Ray actors for trainers")
    sv.add_argument("plan")
    sv.add_argument("--name", required=True, help="job name that trainers connect to")
    sv.add_argument(
        "--address",
        help="Ray cluster address (default: RAY_ADDRESS, else a new local instance of this "
        "command's own, never one another process started)",
    )
    _connect_timeout(sv)
    sv.add_argument("--resume", help="start from the newest checkpoint in this folder")
    sv.add_argument("--dp", type=int, help="override world.dp")
    sv.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (0: free)"
    )
    sv.set_defaults(func=_cmd_serve)

    st = sub.add_parser("status", help="a live table of a job served on Ray")
    st.add_argument("job")
    st.add_argument(
        "--address",
        help="Ray cluster address (default: RAY_ADDRESS, else the address of the job that "
        "this user serves here, else auto)",
    )
    _connect_timeout(st)
    st.add_argument("--once", action="store_true", help="print the table once and exit")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    st.set_defaults(func=_cmd_status)

    qu = sub.add_parser("quarantine", help="skip samples of a job served on Ray, from a step on")
    qu.add_argument("job")
    qu.add_argument("action", choices=["add", "list"], help="add to the quarantine, or print it")
    qu.add_argument("ids", nargs="*", metavar="ID", help="sample ids, as FILE:ROW[#CHUNK]")
    qu.add_argument(
        "--files", nargs="+", default=[], metavar="GLOB", help="quarantine every sample of these"
    )
    qu.add_argument(
        "--from-step", type=non_negative_int, metavar="S",
        help="the first step without them (default: the first step not planned yet)",
    )  # fmt: skip
    qu.add_argument("--address", help="Ray cluster address (as for status)")
    _connect_timeout(qu)
    qu.set_defaults(func=_cmd_quarantine)

    q = sub.add_parser("plan", help="per-step balance and mixture, without building batches")
    q.add_argument("plan")
    q.add_argument("--steps", type=positive_int, required=True)
    q.add_argument("--dp", type=int, help="override world.dp")
    q.set_defaults(func=_cmd_plan)

    from overlord.ops import diff

    diff.register(sub)
    replay_command.add_parser(sub, _connect_timeout)  # its code: overlord.ops.replay
    why_command.add_parser(sub, _connect_timeout)  # its code: overlord.ops.why
    m = sub.add_parser(
        "simulate", help="plan a run on the plan's data without batches: mixture, balance, cost"
    )
    m.add_argument("plan")
    m.add_argument("--steps", type=positive_int, default=100, help="steps to plan (0..N-1)")
    m.add_argument("--step-seconds", type=seconds, help="the trainer's step time: cores needed")
    m.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE")
    m.set_defaults(func=_cmd_simulate)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``overlord`` command."""
    args = build_parser().parse_args(argv)
    if getattr(args, "checkpoint_every", None) is not None and not args.checkpoint_dir:
        print("overlord: --checkpoint-every needs --checkpoint-dir", file=sys.stderr)
        return 2
    if getattr(args, "address", None) and getattr(args, "runtime", "ray") != "ray":
        print("overlord: --address needs --runtime ray", file=sys.stderr)
        return 2
    from overlord.serve import Stopped

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise Stopped(signum)

    # SIGTERM unwinds like Ctrl-C: whatever the command started (a local Ray instance, its
    # actors) is stopped on the way out, in every phase, connecting included
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        return int(args.func(args))
    except OverlordError as e:
        print(f"overlord: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"overlord: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
