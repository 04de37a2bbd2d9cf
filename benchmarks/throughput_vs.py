"""Throughput against the loaders people use: tokens/s to one consumer, and time to first batch.

Same corpus (the demo corpus of :func:`overlord.ops.demo.build_corpus`: ``stdlib``,
``tests``, ``docs``, ``licenses``), same mixture (weights 4:3:2:1), same
tokenizer (``bytes``, and the byte-level BPE that benchmarks/throughput.py
trains), same packed rows (4 rows of 8,192 tokens per batch), same cores (the
run is pinned to 2 CPUs), one consumer. Loaders:

1. *overlord embedded*: ``Loader(plan)``, dp=1, ``client(0)``, in the consumer's process.
2. *overlord on Ray*: ``Loader(plan, runtime="ray")`` with ``placement.constructors:
   trainer`` and ``placement.loader_processes: 1``; one trainer process consumes rank 0
   through ``overlord.connect``.
3. *torch DataLoader W=w*, for each w of ``--workers`` (default 0, 1, 2):
   ``DataLoader(num_workers=w)`` over a mixed ``IterableDataset`` written the way people
   write it: each worker (or, with w=0, the consumer's process) reads its share of every
   source's files, tokenizes them, picks the next document's source by weight with a
   seeded RNG, and cuts the concatenated stream into rows of 8,192.
4. *MosaicML Streaming W=w*, for the same w: each source converted by its own
   ``MDSWriter`` (a ``text`` column; conversion time reported apart), read by one
   ``StreamingDataset`` of weighted ``Stream``s (``proportion``) in a
   ``StreamingDataLoader(num_workers=w)``; the dataset's ``__iter__`` tokenizes 64 texts
   at a time and packs as in 3.

The baselines tokenize as overlord does: UTF-8 bytes, or the same ``tokenizers`` method
(``encode_batch_fast`` where it exists, else ``encode_batch``; see
``overlord/sources/tokenizers.py``). In DataLoader workers (w >= 1) ``worker_init_fn``
sets ``TOKENIZERS_PARALLELISM=false`` before the worker loads its tokenizer, as the
``tokenizers`` docs advise for forked workers: each worker then encodes on its own
thread, instead of every worker running a Rayon pool as large as the machine. The
worker checks that this took effect (no thread appears during its first encode). With
w=0 the tokenizer keeps its parallel pool in the consumer's process, as it does in
overlord's embedded runtime and as a user's would.
"Best baseline" is chosen over all of 3 and 4, per tokenizer, once by tokens per
CPU-second and once by tokens per second (wall); overlord's rows give both ratios.

Each measurement runs in a fresh process: it builds the loader, times the first batch
(time to first batch, from the loader's construction), consumes a warm-up past start-up
and read-ahead, then times a fixed number of tokens. CPU is that of every process of the
run (the measuring process and all its descendants: DataLoader workers, Ray's processes,
the trainer), read from ``/proc/PID/stat`` at the start and end of the timed window.
Each measurement is repeated 3 times; the table gives medians. Tokens are document tokens
(overlord: ``Batch.num_tokens``, padding excluded; the baselines pack without padding).

Mixture: overlord mixes by token share. The baselines draw a source per document (the
DataLoader with a seeded RNG, Streaming by ``proportion``, a share of samples), so their
document shares are set to ``weight / mean document bytes`` of each source (from the
corpus manifest): all four loaders then deliver about the same token shares.

Needs ``mosaicml-streaming`` for loader 4 (skipped without it). Run from the repository
root (Ray must stay on loopback)::

    tools/loopback .venv/bin/python -m benchmarks.throughput_vs          # 8-12 minutes, 2 cores
    tools/loopback .venv/bin/python -m benchmarks.throughput_vs --quick  # 3-6 minutes

On a larger machine, e.g. 16 cores: ``--cores 16 --workers 0,1,2,8,15``.

Besides the table it writes the plot ``benchmarks/throughput_vs.png`` (``--plot`` to
choose another path, ``--plot ''`` for none): tokens per CPU-second, tokens per second
and time to first batch of each loader, per tokenizer.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.machinery
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import yaml

from benchmarks._lib.corpus import EOS, train_bpe
from benchmarks._lib.procfs import tree_cpu
from benchmarks._lib.timing import REPO, module_command
from overlord.ops.demo import build_corpus

WEIGHTS = {"stdlib": 4.0, "tests": 3.0, "docs": 2.0, "licenses": 1.0}
TEXT_FIELD = {"docs": "content"}
MAX_SEQ_LEN = 8192
ROWS = 4  # rows per batch
CORES = 2  # the default of --cores
WORKERS = "0,1,2"  # the default of --workers
SEED = 1234
OVERLORD = ("overlord embedded", "overlord on Ray")
TORCH, STREAMING = "torch DataLoader", "MosaicML Streaming"  # + f" W={workers}"
# tokens of warm-up and of the timed window, per tokenizer (--quick: a quarter)
SIZES = {"bytes": (16_000_000, 96_000_000), "bpe": (1_500_000, 6_000_000)}


def consume(batches: Iterator[Any], count: Any, t_start: float, warm: int, timed: int, root: int):
    """Time to first batch, then tokens/s and tokens per CPU-s over ``timed`` tokens."""
    first = next(batches)
    ttfb = time.time() - t_start
    seen = count(first)
    while seen < warm:
        seen += count(next(batches))
    c0, w0, seen = tree_cpu(root), time.perf_counter(), 0
    while seen < timed:
        seen += count(next(batches))
    wall, cpu = time.perf_counter() - w0, tree_cpu(root) - c0
    return {"ttfb": ttfb, "tokens": seen, "wall": wall, "cpu": cpu}


# ---- overlord ------------------------------------------------------------------------------


def write_plan(root: Path, tokenizer: dict[str, Any], ray: bool) -> Path:
    plan: dict[str, Any] = {
        "seed": SEED,
        "sources": [
            {
                "name": s,
                "path": str(root / "data" / s / "*"),
                "format": "parquet" if s in TEXT_FIELD else "jsonl",
                "text_field": TEXT_FIELD.get(s, "text"),
            }
            for s in WEIGHTS
        ],
        "mixture": {"schedule": [{"step": 0, "weights": WEIGHTS}]},
        "tokenizer": tokenizer,
        "batch": {"tokens_per_step": ROWS * MAX_SEQ_LEN, "max_seq_len": MAX_SEQ_LEN},
        "world": {"dp": 1},
    }
    if ray:
        plan["placement"] = {"constructors": "trainer", "loader_processes": 1}
    path = root / f"plan-{tokenizer['kind']}-{'ray' if ray else 'inline'}.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def run_embedded(plan_path: Path, warm: int, timed: int) -> dict[str, Any]:
    from overlord import Loader

    t_start = time.time()
    with Loader(plan_path, runtime="inline") as loader:
        client = loader.client(0)
        return consume(client, lambda b: b.num_tokens, t_start, warm, timed, os.getpid())


# run with cwd=REPO, so that ``benchmarks`` imports
TRAINER = """
import json, sys
import overlord
from benchmarks.throughput_vs import consume
job, t_start, warm, timed, root = sys.argv[1], float(sys.argv[2]), *map(int, sys.argv[3:6])
client = overlord.connect(job, rank=0)
print(json.dumps(consume(client, lambda b: b.num_tokens, t_start, warm, timed, root)))
"""


def run_ray(plan_path: Path, warm: int, timed: int) -> dict[str, Any]:
    import ray

    from overlord import Loader

    t_start, job = time.time(), f"vs-{os.getpid()}"
    with Loader(plan_path, runtime="ray", job=job):
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        args = [job, repr(t_start), str(warm), str(timed)]
        out = subprocess.run(
            [sys.executable, "-c", TRAINER, *args, str(os.getpid())],
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
            text=True,
            check=True,
            timeout=600,
        ).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---- the baselines: what people write -----------------------------------------------------


def read_texts(path: Path) -> list[str]:
    """One file's texts: JSONL (gzip-compressed or not) or Parquet."""
    if path.suffix == ".parquet":
        return pq.read_table(path).column("content").to_pylist()
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return pa_json.read_json(io.BytesIO(data)).column("text").to_pylist()


class Encoder:
    """Texts to token lists, each ending with the end-of-document id."""

    def __init__(self, tokenizer: str | None):
        self.path = tokenizer
        self.tok: Any = None

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        if self.path is None:
            return [
                np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int32), 256) for t in texts
            ]
        serial = self.tok is None and os.environ.get("TOKENIZERS_PARALLELISM") == "false"
        if self.tok is None:  # loaded in the worker
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(self.path)
            self.eos = self.tok.token_to_id(EOS)
            # the method overlord's HFTokenizer calls (overlord/sources/tokenizers.py)
            self.encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        threads = len(os.listdir("/proc/self/task")) if serial else 0
        encs = self.encode(texts, add_special_tokens=False)
        if serial and len(os.listdir("/proc/self/task")) > threads:
            raise RuntimeError("TOKENIZERS_PARALLELISM=false did not keep the encode serial")
        return [np.array([*e.ids, self.eos], np.int32) for e in encs]


def serial_tokenizer(worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``: its tokenizer encodes on its own thread.

    The Rust side reads the variable when it encodes, so setting it here, before the
    worker's first encode, is enough. Without it every worker runs a Rayon pool with a
    thread per core: W workers and W x cores threads on the cores.
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def pack_rows(docs: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Concatenate documents and cut the stream into rows of MAX_SEQ_LEN."""
    buf: list[np.ndarray] = []
    have = 0
    for d in docs:
        buf.append(d)
        have += len(d)
        while have >= MAX_SEQ_LEN:
            flat = np.concatenate(buf)
            yield flat[:MAX_SEQ_LEN]
            buf, have = [flat[MAX_SEQ_LEN:]], len(flat) - MAX_SEQ_LEN


def doc_shares(root: Path) -> dict[str, float]:
    """Each source's share of documents that gives it its weight's share of tokens.

    A document of source s is about ``bytes_s / records_s`` long: drawing documents with
    probability proportional to ``weight_s / that`` makes token shares follow the weights,
    as overlord's do (with bytes as the proxy for tokens).
    """
    manifest = json.loads((root / "data" / "corpus.json").read_text())
    raw = {s: w * manifest[s]["records"] / manifest[s]["bytes"] for s, w in WEIGHTS.items()}
    return {s: v / sum(raw.values()) for s, v in raw.items()}


def mix(
    streams: dict[str, Iterator[np.ndarray]], shares: dict[str, float], seed: int
) -> Iterator[np.ndarray]:
    """The next document from a source drawn with a seeded RNG by its document share."""
    names = list(streams)
    p = np.array([shares[n] for n in names])
    rng = np.random.default_rng(seed)
    while True:
        yield next(streams[names[rng.choice(len(names), p=p)]])


def torch_dataset(
    files: dict[str, list[Path]], shares: dict[str, float], tokenizer: str | None
) -> Any:
    import torch

    class Mixed(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[np.ndarray]:
            info = torch.utils.data.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            encode = Encoder(tokenizer)

            def source(paths: list[Path]) -> Iterator[np.ndarray]:
                mine = paths[wid::nw] or paths  # a source with fewer files than workers
                while True:
                    for p in mine:
                        yield from encode(read_texts(p))

            return pack_rows(mix({s: source(ps) for s, ps in files.items()}, shares, SEED + wid))

    return Mixed()


def run_torch(
    files: dict[str, list[Path]],
    shares: dict[str, float],
    tokenizer: str | None,
    workers: int,
    warm: int,
    timed: int,
):
    import torch

    t_start = time.time()
    loader = torch.utils.data.DataLoader(
        torch_dataset(files, shares, tokenizer),
        batch_size=ROWS,
        num_workers=workers,
        worker_init_fn=serial_tokenizer,  # not called with num_workers=0
    )
    return consume(iter(loader), lambda b: b.numel(), t_start, warm, timed, os.getpid())


def import_streaming() -> Any:
    """``streaming``; where torchvision is absent, stubs of the two names its vision module
    imports (unused here: torchvision's wheels need a CUDA torch, this venv has a CPU one)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        stubs = {
            "torchvision": {},
            "torchvision.datasets": {"VisionDataset": type("VisionDataset", (), {})},
            "torchvision.transforms": {},
            "torchvision.transforms.functional": {"to_tensor": None},
        }
        for name, attrs in stubs.items():
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = mod
    import streaming

    return streaming


def convert_mds(files: dict[str, list[Path]], out: Path) -> float:
    """Each source through its own MDSWriter; seconds taken."""
    streaming = import_streaming()
    t0 = time.perf_counter()
    for s, paths in files.items():
        with streaming.MDSWriter(out=str(out / s), columns={"text": "str"}) as w:
            for p in paths:
                for t in read_texts(p):
                    w.write({"text": t})
    return time.perf_counter() - t0


def run_streaming(
    mds: Path,
    shares: dict[str, float],
    tokenizer: str | None,
    workers: int,
    warm: int,
    timed: int,
    epoch: int,
):
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    class Packed(streaming.StreamingDataset):
        def __iter__(self) -> Iterator[np.ndarray]:
            encode = Encoder(tokenizer)

            def docs() -> Iterator[np.ndarray]:
                texts = []
                for sample in super(Packed, self).__iter__():
                    texts.append(sample["text"])
                    if len(texts) == 64:  # tokenize in batches, as encode_batch wants
                        yield from encode(texts)
                        texts = []

            return pack_rows(docs())

    t_start = time.time()
    streams = [streaming.Stream(local=str(mds / s), proportion=p) for s, p in shares.items()]
    ds = Packed(streams=streams, shuffle=True, shuffle_seed=SEED, epoch_size=epoch, batch_size=ROWS)
    loader = streaming.StreamingDataLoader(
        ds, batch_size=ROWS, num_workers=workers, worker_init_fn=serial_tokenizer
    )
    return consume(iter(loader), lambda b: b.numel(), t_start, warm, timed, os.getpid())


# ---- driver --------------------------------------------------------------------------------


def corpus_files(root: Path) -> dict[str, list[Path]]:
    return {s: sorted((root / "data" / s).iterdir()) for s in WEIGHTS}


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    os.sched_setaffinity(0, list(sorted(os.sched_getaffinity(0)))[: args.cores])
    root = Path(args.root)
    tok = None if args.tokenizer == "bytes" else str(root / "bpe.json")
    spec = {"kind": "bytes"} if tok is None else {"kind": "hf", "path": tok, "eos": EOS}
    warm, timed = SIZES[args.tokenizer]
    if args.quick:
        warm, timed = warm // 4, timed // 4
    if args.one == "overlord embedded":
        return run_embedded(write_plan(root, spec, False), warm, timed)
    if args.one == "overlord on Ray":
        return run_ray(write_plan(root, spec, True), warm, timed)
    name, _, workers = args.one.rpartition(" W=")
    if name == TORCH:
        return run_torch(corpus_files(root), doc_shares(root), tok, int(workers), warm, timed)
    assert name == STREAMING, args.one
    # an epoch long enough for the run: 10 times the corpus's documents
    epoch = 10 * sum(
        m["records"] for m in json.loads((root / "data/corpus.json").read_text()).values()
    )
    return run_streaming(root / "mds", doc_shares(root), tok, int(workers), warm, timed, epoch)


def measure(root: Path, loader: str, tokenizer: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [*module_command("throughput_vs"), "--root", str(root), "--one", loader]
    cmd += ["--tokenizer", tokenizer, "--cores", str(args.cores)]
    cmd += ["--quick"] if args.quick else []
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, timeout=900, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best(med: dict[str, dict[str, float]], key: str) -> tuple[str, float]:
    """The baseline (any loader but overlord's) with the most ``key``, and that figure."""
    name = max((n for n in med if n not in OVERLORD), key=lambda n: med[n][key])
    return name, med[name][key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the tokens, 2 repeats")
    ap.add_argument("--repeats", type=int, help="measurements of each (default 3, quick 2)")
    ap.add_argument("--tokenizer", choices=["bytes", "bpe", "both"], default="both")
    ap.add_argument(
        "--workers",
        default=WORKERS,
        help=f"worker counts of the baselines, comma-separated (default {WORKERS})",
    )
    ap.add_argument("--cores", type=int, default=CORES, help=f"CPUs to run on (default {CORES})")
    ap.add_argument("--plot", default="benchmarks/throughput_vs.png", help="PNG path ('' for none)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return 0
    repeats = args.repeats or (2 if args.quick else 3)
    toks = ["bytes", "bpe"] if args.tokenizer == "both" else [args.tokenizer]
    workers = [int(w) for w in args.workers.split(",")]
    loaders = [*OVERLORD, *(f"{TORCH} W={w}" for w in workers)]
    try:
        import_streaming()
        loaders += [f"{STREAMING} W={w}" for w in workers]
    except ImportError:
        print("(mosaicml-streaming not installed: its rows are skipped)\n")
    with tempfile.TemporaryDirectory(prefix="overlord-vs-") as tmp:
        root = Path(tmp)
        manifest = build_corpus(root / "data")
        files = corpus_files(root)
        if "bpe" in toks:
            jsonl = {s: [p for p in ps if p.suffix == ".jsonl"] for s, ps in files.items()}
            train_bpe({s: ps for s, ps in jsonl.items() if ps}, root / "bpe.json", 8000)
        has_streaming = any(n.startswith(STREAMING) for n in loaders)
        convert = convert_mds(files, root / "mds") if has_streaming else None
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(repeats):  # interleaved, so that drift hits every loader alike
            for tok in toks:
                for loader in loaders:
                    results.setdefault((tok, loader), []).append(measure(root, loader, tok, args))
        shutil.rmtree(root / "mds", ignore_errors=True)

    size = sum(m["bytes"] for m in manifest.values())
    print("# Throughput to one consumer: overlord against the loaders people use\n")
    print(
        f"Corpus: the demo corpus ({len(manifest)} sources, {size / 1e6:.1f} MB), weights "
        f"{', '.join(f'{s} {w:g}' for s, w in WEIGHTS.items())}; batches of {ROWS} rows of "
        f"{MAX_SEQ_LEN}; {args.cores} cores (affinity), {os.cpu_count()} CPUs on the machine; "
        f"baselines with W = {', '.join(map(str, workers))} workers, "
        "TOKENIZERS_PARALLELISM=false in workers; "
        f"median of {repeats}."
    )
    if convert is not None:
        print(f"MosaicML Streaming conversion (MDSWriter, 4 sources): {convert:.2f} s, not timed.")
    print(
        "\n| tokenizer | loader | time to first batch s | tokens timed | tokens/s "
        "| CPU cores used | tokens/CPU-s | / best baseline per CPU-s | / best baseline wall |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    meds: dict[str, dict[str, dict[str, float]]] = {}
    bests: dict[str, dict[str, tuple[str, float]]] = {}
    for tok in toks:
        med = meds[tok] = {}
        for loader in loaders:
            rows = results[(tok, loader)]
            med[loader] = {
                "ttfb": statistics.median(r["ttfb"] for r in rows),
                "tokens": statistics.median(r["tokens"] for r in rows),
                "per_s": statistics.median(r["tokens"] / r["wall"] for r in rows),
                "cores": statistics.median(r["cpu"] / r["wall"] for r in rows),
                "per_cpu": statistics.median(r["tokens"] / r["cpu"] for r in rows),
            }
        b = bests[tok] = {"per_cpu": best(med, "per_cpu"), "per_s": best(med, "per_s")}
        for loader, m in med.items():
            print(
                f"| {tok} | {loader} | {m['ttfb']:.2f} | {m['tokens']:,.0f} | {m['per_s']:,.0f} "
                f"| {m['cores']:.2f} | {m['per_cpu']:,.0f} | {m['per_cpu'] / b['per_cpu'][1]:.2f} "
                f"| {m['per_s'] / b['per_s'][1]:.2f} |"
            )
    print("\nBest baseline (over all baselines, per tokenizer):")
    for tok, b in bests.items():
        print(
            f"- {tok}: per CPU-s {b['per_cpu'][0]} ({b['per_cpu'][1]:,.0f} tokens/CPU-s); "
            f"wall {b['per_s'][0]} ({b['per_s'][1]:,.0f} tokens/s)"
        )
    print(
        "\nTargets: overlord at least as many tokens per CPU-second, and at least as many "
        "tokens per second (wall), as the best baseline by each (>= 1.000, no slack):"
    )
    for loader in OVERLORD:
        for tok in toks:
            for key, what in (("per_cpu", "tokens/CPU-s"), ("per_s", "tokens/s (wall)")):
                name, figure = bests[tok][key]
                ratio = meds[tok][loader][key] / figure
                print(
                    f"- {loader}, {tok}, {what}: {ratio:.3f}x {name}: "
                    f"{'PASS' if ratio >= 1.0 else 'MISS'}"
                )
    if args.plot:
        plot(meds, repeats, args.cores, args.plot)
        print(f"\nPlot: {args.plot}")
    return 0


def color(name: str, loaders: list[str]) -> Any:
    """Blues for overlord, reds for the DataLoader, oranges for Streaming; darker, more workers."""
    import matplotlib

    if name in OVERLORD:
        return ("tab:blue", "tab:cyan")[OVERLORD.index(name)]
    family = name.rpartition(" W=")[0]
    kin = [n for n in loaders if n.startswith(family + " W=")]
    cmap = matplotlib.colormaps["Reds" if family == TORCH else "Oranges"]
    return cmap(0.35 + 0.55 * kin.index(name) / max(len(kin) - 1, 1))


def plot(meds: dict[str, dict[str, dict[str, float]]], repeats: int, cores: int, path: str) -> None:
    """Bars per tokenizer and loader: tokens per CPU-second and per second, time to first batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    toks = list(meds)
    loaders = list(dict.fromkeys(name for m in meds.values() for name in m))
    width = 0.8 / len(loaders)
    fig, axes = plt.subplots(1, 3, figsize=(20, 6))
    panels = (
        ("per_cpu", "tokens per CPU-second (all processes)", "Throughput per CPU-second"),
        ("per_s", "tokens per second (wall)", "Throughput per second"),
        ("ttfb", "seconds, from the loader's construction", "Time to first batch"),
    )
    for ax, (key, ylabel, title) in zip(axes, panels):
        ratio = key != "ttfb"
        for j, name in enumerate(loaders):
            x = np.arange(len(toks)) + (j - (len(loaders) - 1) / 2) * width
            vals = [meds[t][name][key] if name in meds[t] else np.nan for t in toks]
            bars = ax.bar(x, vals, width, color=color(name, loaders), label=name)
            for b, t, v in zip(bars, toks, vals):
                if np.isnan(v):
                    continue
                text = f"{v / 1e6:.2f}M" if ratio else f"{v:.2f}"
                if ratio:
                    text += f"\n{v / best(meds[t], key)[1]:.2f}x"
                ax.annotate(
                    text,
                    (b.get_x() + b.get_width() / 2, v),
                    textcoords="offset points",
                    xytext=(0, 2),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
        ax.set_xticks(range(len(toks)), [f"tokenizer: {t}" for t in toks])
        ax.set_yscale("log")
        ax.margins(y=0.25)
        lo, hi = ax.get_ylim()
        ticks = [m * 10.0**k for k in range(-3, 9) for m in (1, 2, 5) if lo <= m * 10.0**k <= hi]
        names = [f"{t / 1e6:g}M" if t >= 1e5 else f"{t:g}" for t in ticks]
        ax.set_yticks(ticks, names)
        ax.minorticks_off()
        ax.set_ylim(lo, hi)
        ax.set_ylabel(ylabel)
        ax.set_title(title + (" (labels: value, / best baseline)" if ratio else ""), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(len(loaders), 8))
    fig.suptitle(
        f"Throughput to one consumer: overlord vs torch DataLoader and MosaicML Streaming "
        f"({cores} cores, rows of {MAX_SEQ_LEN}, median of {repeats})",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
