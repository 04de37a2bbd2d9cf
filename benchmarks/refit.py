"""A cost model that learns: the refit against a plan whose beta is 2x wrong, both ways.

A synthetic trainer takes ``A * S1 + B * S2`` seconds on a rank's step, where
``S1`` and ``S2`` are the sums of the rank's document lengths and of their
squares (a dense transformer with document-masked attention; ``B / A`` puts
attention equal to the linear term at a document of ``A / B`` tokens), with a
multiplicative noise (``--noise``, a normal of that standard deviation). The
plan gives ``alpha = A`` and a ``beta`` 2x too small (``half``) or 2x too large
(``double``). Every rank reports its seconds after each step
(``client.report``); ``balance.refit`` refits every ``--every`` steps on the
last ``--window`` reported steps.

Baseline, in the same run, on the same corpus: the plan given the true
``beta`` (``true``), no refit. The items of each step do not depend on the
cost model (only their ranks do), so each step is compared with the same
step of the baseline.

Per step, it reports:

- ``err``: the relative error of the most loaded rank's predicted seconds
  (the rank of highest predicted cost; the planner's ``predicted_seconds``,
  its cost times the seconds per cost of the model it was planned with, read
  *before* the step's reports arrive) against its measured seconds;
- ``max/true``: the most loaded rank's measured seconds over the baseline's
  on the same step (1.0: as good as balancing with the true coefficients).

The targets: ``err`` under 5% within 3 refits, and ``max/true`` within 2%
after them (the mean over the steps after the third refit).

Run from the repository root::

    .venv/bin/python -m benchmarks.refit            # about a minute
    .venv/bin/python -m benchmarks.refit --steps 30 --every 4
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from overlord import Loader, load_plan
from overlord.roles.api import OpsRole

A = 1e-6  # seconds per token
B = A / 1024  # attention equals the linear term at a 1,024-token document


def corpus(root: Path, docs: int, seed: int) -> None:
    """Two JSONL sources of long-tailed documents (bytes tokenizer: a token per byte)."""
    rng = random.Random(seed)
    for name, median, files in (("web", 300, 4), ("books", 2500, 2)):
        folder = root / "data" / name
        folder.mkdir(parents=True)
        for f in range(files):
            with open(folder / f"part-{f}.jsonl", "w") as out:
                for _ in range(docs // files):
                    n = max(16, min(20000, int(rng.lognormvariate(np.log(median), 1.0))))
                    text = "".join(rng.choice("abcdefgh ") for _ in range(n))
                    out.write(json.dumps({"text": text}) + "\n")


def write_plan(root: Path, beta: float, refit: dict[str, int] | None, dp: int, seq: int) -> Path:
    plan: dict[str, Any] = {
        "seed": 7,
        "sources": [
            {"name": "web", "path": "data/web/*", "format": "jsonl"},
            {"name": "books", "path": "data/books/*", "format": "jsonl"},
        ],
        "mixture": {"schedule": [{"step": 0, "weights": {"web": 0.5, "books": 0.5}}]},
        "batch": {"tokens_per_step": dp * 2 * seq, "max_seq_len": seq, "prefetch_steps": 1},
        "world": {"dp": dp},
        "balance": {"method": "kk", "cost": {"alpha": A, "beta": beta}},
    }
    if refit:
        plan["balance"]["refit"] = refit
    path = root / f"plan-{beta:.3g}-{bool(refit)}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def run(
    path: Path, steps: int, noise: float, seed: int, true_beta: float = B
) -> dict[str, Any]:
    """Every step's most loaded rank: predicted and measured seconds; the refits."""
    rng = np.random.default_rng(seed)
    plan = load_plan(path)
    out: dict[str, list[float]] = {"err": [], "max": [], "refits": []}
    with Loader(plan, runtime="inline") as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(steps):
            batches = [next(c) for c in clients]
            # the planner's prediction, in seconds, before this step's reports reach it
            seen = loader.planner.call(OpsRole.feedback, batches[0].step).result()
            seconds = []
            for b in batches:
                t = np.array([s.tokens for s in b.samples], dtype=np.float64)
                true = A * t.sum() + true_beta * (t * t).sum()
                seconds.append(true * (1.0 + noise * rng.standard_normal()))
            top = int(np.argmax([b.cost for b in batches]))
            predicted = seen[batches[top].rank].get("predicted_seconds", float("nan"))
            out["err"].append(abs(predicted - seconds[top]) / seconds[top])
            out["max"].append(max(seconds))
            for c, b, s in zip(clients, batches, seconds):
                c.report(b.step, s)
            clients[0].flush()
            out["refits"].append(loader.stats()["feedback"]["refits"])
        out["beta"] = [loader.stats()["feedback"]["beta"]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attention-at", type=float, default=A / B, metavar="L",
        help="the document length at which attention equals the linear term (A / B; "
        "smaller: attention dominates more of the step)",
    )  # fmt: skip
    args = p.parse_args()
    b = A / args.attention_at
    refit = {"every": args.every, "window": args.window, "min_samples": 2 * args.dp}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus(root, 6000, args.seed)
        base = run(write_plan(root, b, None, args.dp, args.seq), args.steps, args.noise, 1, b)
        print(
            f"DP {args.dp}, {args.seq}-token rows, 2 rows per rank; true beta/alpha "
            f"1/{A / b:.0f}; refit every {args.every} steps on {args.window}; "
            f"noise {args.noise:.0%}"
        )
        for case, beta in (("half", b / 2), ("double", 2 * b)):
            plan = write_plan(root, beta, refit, args.dp, args.seq)
            got = run(plan, args.steps, args.noise, 1, b)
            ratio = np.array(got["max"]) / np.array(base["max"])
            refits = np.array(got["refits"])
            third = int(np.argmax(refits >= 3)) if (refits >= 3).any() else len(refits)
            print(f"\nplan beta = {case} the truth; refit beta/true: {got['beta'][0] / b:.4f}")
            print("| step | refits | err | max/true |")
            print("|---:|---:|---:|---:|")
            for s in range(args.steps):
                print(f"| {s} | {refits[s]} | {got['err'][s]:.2%} | {ratio[s]:.4f} |")
            after = slice(third + 1, None)
            print(
                f"\nbefore the first refit: err mean {np.nanmean(got['err'][: args.every]):.2%}, "
                f"max/true mean {ratio[: args.every].mean():.4f}; after the third refit "
                f"(step {third}): err max {np.nanmax(got['err'][after]):.2%}, max/true mean "
                f"{ratio[after].mean():.4f} (max {ratio[after].max():.4f})"
            )


if __name__ == "__main__":
    main()
