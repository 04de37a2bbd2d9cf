"""``overlord replay``: one step's samples, where they sat, and what the trainer received.

One JSON line per (step, rank), a superset of ``overlord run --dump``'s line
(:func:`overlord.ops.run.dump_line`): the same keys and values first, then
``placement`` (each sample's row of the rank's batch and its offset in that
row, in tokens, as the rank's rows are packed before any CP slicing) and, with
``--text``, ``ids`` (each sample's token ids as the trainer received them) and
``text`` (their text, by the plan's tokenizer; None for a pre-tokenized source).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from overlord.batch import Batch
from overlord.errors import OutputError
from overlord.plan.spec import Plan
from overlord.replays import ReplayError, build, find_point
from overlord.sources.tokenizers import Tokenizer, make_tokenizer

from .run import close_dump, dump_line, open_dump


def placement(batch: Batch) -> list[dict[str, int]]:
    """Each sample's row and offset in it (tokens): documents sit back to back in a row.

    >>> from overlord.batch import Sample
    >>> import numpy as np
    >>> z = np.zeros(0)
    >>> samples = [Sample("a", "x:0", 3, 0), Sample("a", "x:1", 2, 0), Sample("b", "y:0", 4, 1)]
    >>> b = Batch(0, 0, None, None, z, z, z, samples, 1.0)
    >>> placement(b)
    [{'row': 0, 'offset': 0}, {'row': 0, 'offset': 3}, {'row': 1, 'offset': 0}]
    """
    used: dict[int, int] = {}
    out = []
    for s in batch.samples:
        offset = used.get(s.row, 0)
        out.append({"row": s.row, "offset": offset})
        used[s.row] = offset + s.tokens
    return out


def replay_line(batch: Batch, plan: Plan, tokenizer: Tokenizer | None = None) -> str:
    """One line of ``overlord replay``: the dump's line, then placement (and ids, text)."""
    line = json.loads(dump_line(batch))  # dicts keep their order: the dump's keys come first
    places = placement(batch)
    line["placement"] = places
    if tokenizer is not None:
        if batch.input_ids is None or batch.cp_size > 1:
            raise ReplayError(
                f"--text: rank {batch.rank}'s batch holds no whole rows (a CP slice or a "
                "later pipeline stage's view); replay without --text for its samples"
            )
        pretokenized = {s.name for s in plan.sources if s.format.pretokenized}
        ids, text = [], []
        for s, p in zip(batch.samples, places):
            got = batch.input_ids[p["row"], p["offset"] : p["offset"] + s.tokens]
            ids.append([int(i) for i in got])
            text.append(None if s.source in pretokenized else _decode(tokenizer, got))
        line.update(ids=ids, text=text)
    return json.dumps(line, separators=(",", ":"))


def _decode(tokenizer: Tokenizer, ids: Any) -> str | None:
    decode = getattr(tokenizer, "decode", None)  # a tokenizer without one shows ids alone
    return None if decode is None else str(decode(ids))


def dp_batches(plan: Plan, batches: list[Batch]) -> list[Batch]:
    """One batch per DP rank: in a mesh, that of its first process, as ``--dump`` writes it."""
    world = plan.world
    if world.peers == 1:
        return batches
    return [batches[world.global_rank(dp=r)] for r in range(world.dp)]


def run_replay(
    where: str,
    step: int,
    out: TextIO,
    rank: int | None = None,
    text: bool = False,
    plan: Plan | None = None,
    address: str | None = None,
    connect_timeout: float | None = None,
) -> int:
    """Write step ``step``'s lines (every DP rank, or ``rank``'s) to ``out``; lines written."""
    point = find_point(where, step, plan, address, connect_timeout)
    dp = point.plan.world.dp
    if rank is not None and not 0 <= rank < dp:
        raise ReplayError(f"--rank {rank} is outside the run's world: dp={dp}, ranks 0..{dp - 1}")
    tokenizer = None
    if text:
        tokenizer = make_tokenizer(point.plan.tokenizer, str(point.plan.base_dir))
    written = 0
    for b in dp_batches(point.plan, build(point)):
        if rank is None or b.rank == rank:
            try:
                out.write(replay_line(b, point.plan, tokenizer) + "\n")
            except OSError as e:
                raise OutputError(f"cannot write the replay: {e.strerror or e}") from None
            written += 1
    return written


def add_parser(sub: Any, connect_timeout: Any) -> None:
    """``overlord replay``'s arguments (``connect_timeout`` adds ``--connect-timeout``)."""
    r = sub.add_parser("replay", help="the exact samples (and text) of one step, per rank")
    r.add_argument(
        "where",
        metavar="DIR",
        help="a checkpoint folder of `overlord run --checkpoint-dir` (its kept journal), or a "
        "live job's name (overlord serve --name)",
    )
    r.add_argument("--step", type=int, required=True, help="the global step to replay")
    r.add_argument("--rank", type=int, help="this DP rank only (default: every rank)")
    r.add_argument(
        "--text", action="store_true", help="add each sample's token ids and text as received"
    )
    r.add_argument("--out", help="write the lines to this file (default: standard output)")
    r.add_argument(
        "--plan", help="the run's plan: only for a folder of checkpoints without a kept journal"
    )
    r.add_argument(
        "--address",
        help="the Ray cluster of a live job (default: RAY_ADDRESS, else the address of the job "
        "that `overlord serve` serves on this machine)",
    )
    connect_timeout(r)
    r.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Run ``overlord replay``."""
    from overlord.plans import load_plan

    plan = load_plan(args.plan) if args.plan else None
    out = open_dump(args.out) if args.out else sys.stdout
    try:
        run_replay(
            args.where, args.step, out, args.rank, args.text, plan, args.address,
            getattr(args, "connect_timeout", None),
        )  # fmt: skip
    finally:
        if args.out:
            close_dump(out)
    return 0
