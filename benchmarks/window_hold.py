"""Window text a SourceLoader and its shadow hold, over many windows cut at a trainer's pace.

A loader lets each piece of a window go once it is cut and reads the next window once
the one being cut has started on its last half (a shadow: on all of it), so over a
window's life it holds from half a window to one and a half (a shadow: none to one).
This drives a primary and a shadow of one source the way a planner does (metadata
taken, items released two steps later, at ``--rate`` windows of tokens a second), and
samples the bytes of text in their windows' pieces not yet let go: the window being
cut and any window read ahead. The window being built (read, then permuted into its
pieces) is not counted: it is one window of one source at a time.

Run (about 15 s)::

    .venv/bin/python -m benchmarks.window_hold [--rate 1.0] [--windows 9]

The JSONL source holds the modules of Python's standard library (as the demo's sources
do), one record each; windows are 8 x 1 MiB blocks; the bytes tokenizer makes a token of
each byte, so a window is about 8M tokens. A standby's pieces are counted as held:
compressed.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from overlord import load_plan
from overlord.roles.source_loader import SourceLoader
from overlord.sources.catalog import job_files
from overlord.sources.window import Packed

BLOCK, BLOCKS = 1 << 20, 8
WINDOW = BLOCK * BLOCKS


def held(loader: SourceLoader) -> int:
    """Bytes of text in the pieces a loader's windows still hold (compressed: as held)."""
    pieces = [p for w in loader.reader.view().windows for p in w.pieces if p is not None]
    return sum(p.data.size if isinstance(p, Packed) else p.texts.nbytes for p in pieces)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=1.0, help="windows of tokens consumed a second")
    ap.add_argument("--windows", type=float, default=9.0, help="windows to cut")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="overlord-window-hold-"))
    with open(root / "web.jsonl", "w") as f:  # Python's own modules, as the demo's sources
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
        written = 0
        while written < (a.windows + 3) * WINDOW:
            for path in files:
                text = path.read_text(errors="replace")
                f.write(json.dumps({"text": text}) + "\n")
                written += len(text)
    (root / "plan.yaml").write_text(
        json.dumps(
            {
                "sources": [{"name": "web", "path": "web.jsonl", "format": "jsonl"}],
                "batch": {"tokens_per_step": 1 << 18, "max_seq_len": 4096, "prefetch_steps": 2},
                "mixture": {"schedule": [{"step": 0, "weights": {"web": 1.0}}]},
                "shuffle": {"block_bytes": BLOCK, "window_blocks": BLOCKS},
                "tokenizer": {"kind": "bytes"},
            }
        )
    )
    plan = load_plan(root / "plan.yaml")
    files = job_files([("web", [str(root / "web.jsonl")])], str(root))["web"]
    loaders = {
        "primary": SourceLoader(plan, files, "web", 0, 1),
        "shadow": SourceLoader(plan, files, "web", 0, 1, shadow=True),
    }
    samples: dict[str, list[int]] = {k: [] for k in loaders}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            for k, loader in loaders.items():
                samples[k].append(held(loader))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lagging: list[np.ndarray] = []  # items of the last steps: released two steps late
    tokens, t0 = 0, time.monotonic()
    try:
        while tokens < a.windows * WINDOW:
            blocks = [b for b in loaders["primary"].metadata(5.0) if len(b["index"])]
            if blocks:
                keys = [
                    np.stack(
                        [
                            np.full(len(b["index"]), b["epoch"]),
                            np.full(len(b["index"]), b["shard_pos"]),
                            b["index"],
                        ],
                        1,
                    )
                    for b in blocks
                ]
                tokens += sum(int(b["tokens"].sum()) for b in blocks)
                lagging.append(np.concatenate(keys))
                if len(lagging) > 2:
                    old = lagging.pop(0)
                    for loader in loaders.values():
                        loader.release(old)
            time.sleep(max(0.002, t0 + tokens / (a.rate * WINDOW) - time.monotonic()))
    finally:
        done.set()
        sampler.join()
        for loader in loaders.values():
            loader.close()
    print(
        f"{tokens / WINDOW:.1f} windows of {WINDOW >> 20} MiB cut in {time.monotonic() - t0:.1f} s"
    )
    for k, xs in samples.items():
        x = np.array(xs) / WINDOW
        print(
            f"{k}: windows of text held: mean {x.mean():.2f}, max {x.max():.2f} ({len(x)} samples)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
