"""Which runs ``benchmarks/memory.py`` makes, and the plan overlord's designs follow.

The designs, the cells of a sweep and what fits this machine: pure functions over a
handful of integers and states, unit-tested in ``tests/test_bench_memory.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._lib.colocated import IMAGE_ID, State, images_shuffle, overlord_shuffle
from benchmarks._lib.memory_report import INDEX_TARGET, NODE

# the colocated loader; overlord on Ray (a driver, Ray's processes, a loader process);
# overlord's node mode (torchrun on one node, no Ray: rank 0 runs the embedded Loader)
DESIGNS = ("baseline", "overlord", NODE)
BASELINE_FITS = 4 * 2**30  # largest baseline state measured: W x S x state bytes
OVERLORD_FITS = 8 * 2**30  # largest overlord state measured: (1 + shadows) x S x HELD_WINDOWS
HELD_WINDOWS = 2  # what a loader process holds per source, in windows (see docs/concepts/memory.md)
SEQ = 8192  # max_seq_len
ROWS = 4  # rows per rank and step: 32K tokens per trainer per step
# at ``images``: 1 row of 8K tokens per rank and step in both designs (a row holds about
# 5,000 image tokens, 20,000 float32 patches: 50 MB of pixel_values; 4 rows would have each
# trainer decode 600 images a step, and hold 200 MB per batch in flight, on 2 cores)
IMAGE_ROWS = 1


def rows_of(state: str) -> int:
    """Rows per rank and step at a state."""
    return IMAGE_ROWS if state.startswith("images") else ROWS


@dataclass(frozen=True)
class Cell:
    """One measured run: a design on (R, W, S) at a state (W: 0 for overlord and bare).

    ``kind`` is the design (or ``bare``); node mode runs with ``shadows`` 0 (the embedded
    runtime keeps no standby).
    """

    kind: str  # "bare" | "baseline" | "overlord" | "overlord-node"
    state: str
    r: int
    w: int
    s: int
    shadows: int = 0


def parse_designs(text: str) -> tuple[str, ...]:
    """``baseline,overlord-node`` -> those designs, in ``DESIGNS`` order; ValueError else."""
    got = {t.strip() for t in text.split(",") if t.strip()}
    bad = sorted(got - set(DESIGNS))
    if bad or not got:
        raise ValueError(
            f"--designs {text!r}: expected a comma-separated subset of {', '.join(DESIGNS)}"
            + (f" (unknown: {', '.join(bad)})" if bad else "")
        )
    return tuple(d for d in DESIGNS if d in got)


def fit_sources(target: int, per_source: int, fits: int) -> list[int]:
    """Sources to measure at: ``[target]`` when it fits, else the two largest that do.

    ``per_source`` bytes of state per source; ``fits`` bytes the run may hold. Halving
    from ``target``: the largest S that fits and half of it (a line to carry to ``target``).
    """
    if per_source * target <= fits:
        return [target]
    s = target
    while s > 1 and per_source * s > fits:
        s //= 2
    return [max(1, s // 2), s] if s > 1 else [1, 2]


def plan_cells(
    states: list[State],
    shadows: list[int],
    target: tuple[int, int, int],
    quick: bool,
    designs: tuple[str, ...] = DESIGNS,
) -> list[Cell]:
    """Every run the sweep makes, bare runs first (every design's loader memory needs them)."""
    r, w, s = target
    cells = [Cell("bare", "", 1, 0, 0), Cell("bare", "", r, 0, 0)]
    for st in states:
        if "baseline" in designs:
            for n in fit_sources(s, w * st.bytes, BASELINE_FITS):
                cells.append(Cell("baseline", st.label, 1, w, n))
        # at ``images`` overlord holds the images encoded in its window and uint8 patches
        # (a quarter of the workers' float32) in its read-ahead: less than one buffer
        held = st.bytes if st.kind == "images" else HELD_WINDOWS * st.bytes
        for sh in shadows if "overlord" in designs else []:
            for n in fit_sources(s, (1 + sh) * held, OVERLORD_FITS):
                cells.append(Cell("overlord", st.label, r, 0, n, sh))
        if NODE in designs:
            cells += [Cell(NODE, st.label, r, 0, n) for n in fit_sources(s, held, OVERLORD_FITS)]
    if not quick and any(st.kind == "index" for st in states):
        ir, iw, is_ = INDEX_TARGET
        if "baseline" in designs:
            cells.append(Cell("baseline", "index", ir, iw, is_))
        if "overlord" in designs:
            cells += [Cell("overlord", "index", ir, 0, is_, sh) for sh in shadows]
        if NODE in designs:
            cells.append(Cell(NODE, "index", ir, 0, is_))
    return list(dict.fromkeys(cells))


def run_key(x: dict[str, Any]) -> tuple[Any, ...]:
    """A measured run's cell, as ``keys`` gives it (runs of earlier sweeps included)."""
    return (x["kind"], x["state"], x["R"], x["W"], x["S"], x.get("shadows", 0))


def keys(c: Cell, target: tuple[int, int, int]) -> set[tuple[Any, ...]]:
    """Runs that stand for cell ``c``: itself, or (carried) the same run at the target's S."""
    own = c.state == "index" and (c.r, c.s) == (INDEX_TARGET[0], INDEX_TARGET[2])
    sizes = {c.s} if own else {c.s, target[2]}
    return {(c.kind, c.state, c.r, c.w, n, c.shadows) for n in sizes}


# ---- plan -------------------------------------------------------------------------------------


def write_plan(
    root: Path,
    sources: list[dict[str, Any]],
    dp: int,
    state: State,
    tokenizer: str | None,
    shadows: int,
    loader_processes: int | None,
) -> Path:
    """The plan overlord follows: the baseline's sources, mixture, batch and tokenizer."""
    import yaml

    from benchmarks._lib.colocated import EOS

    images = state.kind == "images"
    plan: dict[str, Any] = {
        "seed": 7,
        "sources": [
            {
                "name": s["name"],
                "path": f"{'isources' if images else 'sources'}/{s['name']}/*",
                "format": "webdataset" if images else "jsonl",
                **({"text_field": "txt"} if images else {}),
                "shadows": shadows,
            }
            for s in sources
        ],
        "tokenizer": {"kind": "hf", "path": tokenizer, "eos": EOS}
        if tokenizer
        else {"kind": "bytes"},
        "mixture": {
            "schedule": [{"step": 0, "weights": {s["name"]: s["weight"] for s in sources}}]
        },
        "batch": {"tokens_per_step": dp * rows_of(state.label) * SEQ, "max_seq_len": SEQ},
        "world": {"dp": dp},
        "shuffle": images_shuffle(
            state,
            sum(s["decoded_bytes"] for s in sources) / len(sources),
            sum(s["sample_bytes"] for s in sources) / len(sources),
        )
        if images
        else overlord_shuffle(state),
        "placement": {
            "constructors": "trainer",
            **({"loader_processes": loader_processes} if loader_processes else {}),
        },
        "on_error": "skip",
    }
    if images:
        plan["vision"] = {"image_token_id": IMAGE_ID}
    path = root / f"plan-dp{dp}-s{len(sources)}-{state.kind}{state.bytes}-sh{shadows}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path
