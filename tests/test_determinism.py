"""The backbone: the global stream is a pure function of plan, seed and data.

Across DP sizes, loader counts, reader threads and restarts (exact and elastic).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from overlord import CheckpointError, Loader, load_plan, validate_plan
from overlord.ops.run import dump_line

pytestmark = pytest.mark.integration

STEPS = 24


def _text(rng: np.random.Generator, n: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "ζeta", "eta\n", "theta"]
    return " ".join(rng.choice(words, size=n))[: n * 4]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(7)
    (root / "web").mkdir()
    (root / "code").mkdir()
    (root / "books").mkdir()
    for f in range(5):
        lines = [json.dumps({"text": _text(rng, int(rng.lognormal(5, 1)) + 1)}) for _ in range(60)]
        data = "\n".join(lines) + "\n"
        if f % 2:
            with gzip.open(root / "web" / f"part-{f}.jsonl.gz", "wt") as fh:
                fh.write(data)
        else:
            (root / "web" / f"part-{f}.jsonl").write_text(data)
    for f in range(3):
        texts = [_text(rng, int(rng.lognormal(6, 1)) + 1) for _ in range(50)]
        pq.write_table(pa.table({"content": texts}), root / "code" / f"c{f}.parquet")
    for f in range(2):  # long documents: split into chunks
        lines = [json.dumps({"text": _text(rng, int(rng.integers(500, 3000)))}) for _ in range(8)]
        (root / "books" / f"b{f}.jsonl").write_text("\n".join(lines) + "\n")
    plan = {
        "seed": 11,
        "sources": [
            {"name": "web", "path": "web/*.jsonl*", "format": "jsonl"},
            {
                "name": "code",
                "path": "code/*.parquet",
                "format": "parquet",
                "text_field": "content",
            },
            {"name": "books", "path": "books/*.jsonl", "format": "jsonl"},
        ],
        "mixture": {
            "schedule": [
                {"step": 0, "weights": {"web": 0.6, "code": 0.3, "books": 0.1}},
                {"step": STEPS, "weights": {"web": 0.2, "code": 0.4, "books": 0.4}},
            ]
        },
        "batch": {"tokens_per_step": 8 * 2048, "max_seq_len": 2048, "lookahead": 8},
        "world": {"dp": 4},
        "balance": {"method": "kk", "cost": {"alpha": 1.0, "beta": 0.002}},
        "loading": {"timeout_s": 20},
    }
    (root / "plan.yaml").write_text(yaml.safe_dump(plan))
    return root / "plan.yaml"


def _variant(path: Path, tmp: Path, name: str, **changes) -> Path:
    data = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[section] = value
    out = path.parent / f"{name}.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def run(plan_path, start=0, stop=STEPS, state=None, dp=None):
    """Consume steps [start, stop) with every rank; returns dump lines and the final state."""
    plan = load_plan(plan_path)
    if dp is not None:
        plan = plan.with_dp(dp)
    lines, batches = [], []
    with Loader(plan, state=state) as loader:
        assert loader.start_step == start
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for _ in range(start, stop):
            for c in clients:
                b = next(c)
                lines.append(dump_line(b))
                batches.append(b)
        state = loader.state_dict()
    return lines, state, batches


def per_step_samples(lines):
    out: dict[int, Counter] = {}
    for line in lines:
        rec = json.loads(line)
        out.setdefault(rec["step"], Counter()).update(s["id"] for s in rec["samples"])
    return out


@pytest.fixture(scope="module")
def reference(corpus):
    return run(corpus)


def test_same_plan_same_dump(corpus, reference):
    again, _, _ = run(corpus)
    assert again == reference[0]


def test_dp_size_never_changes_which_samples_form_a_step(corpus, reference):
    want = per_step_samples(reference[0])
    for dp in (1, 2, 8):
        lines, _, _ = run(corpus, dp=dp)
        assert per_step_samples(lines) == want, f"dp={dp}"


@pytest.mark.parametrize(
    "world",
    [
        {"dp": 2, "cp": 2, "tp": 2},
        {"dp": 4, "cp": 4, "pp": 2, "cp_layout": "zigzag"},
        {"dp": 1, "tp": 2, "pp": 3, "order": "dp-tp-cp-pp"},
        {"dp": 2, "cp": "dynamic", "cp_max": 4, "tokens_per_cp_rank": 256, "tp": 2},
    ],
)
def test_the_mesh_never_changes_which_samples_form_a_step(corpus, reference, world):
    """Every global rank consumes; the DP ranks' samples per step are the reference's."""
    plan = load_plan(corpus)
    data = plan.model_dump(mode="json")
    world = dict(world)
    data["batch"]["cp_layout"] = world.pop("cp_layout", None)
    data["world"] = world
    plan = validate_plan(data, base_dir=plan.base_dir)
    w, lines = plan.world, []
    with Loader(plan) as loader:
        clients = [loader.rank_client(g) for g in range(w.size)]
        for _ in range(STEPS):
            got = [next(c) for c in clients]
            lines += [dump_line(got[w.global_rank(dp=d)]) for d in range(w.dp)]
    assert per_step_samples(lines) == per_step_samples(reference[0])


def test_dynamic_cp_gives_each_dp_rank_the_samples_cp1_gives_it(corpus):
    """Per step and per DP rank, where rows are dealt without costs (``balance: none``);
    with a balancer the DP ranks' share follows the CP-aware cost, as with static CP."""
    base = load_plan(corpus).model_dump(mode="json")
    base["balance"]["method"] = "none"
    got = {}
    for name, world in (("cp1", {"dp": 2}),
                        ("dynamic", {"dp": 2, "cp": "dynamic", "cp_max": 4,
                                     "tokens_per_cp_rank": 256})):  # fmt: skip
        plan = validate_plan({**base, "world": world}, base_dir=load_plan(corpus).base_dir)
        w, lines = plan.world, []
        with Loader(plan) as loader:
            clients = [loader.rank_client(g) for g in range(w.size)]
            for _ in range(8):
                batches = [next(c) for c in clients]
                lines += [json.loads(dump_line(batches[w.global_rank(dp=d)])) for d in range(w.dp)]
        got[name] = [(x["step"], x["rank"], x["samples"]) for x in lines]  # the cost is CP's
    assert got["dynamic"] == got["cp1"]


def test_loader_count_and_threads_never_change_the_stream(corpus, reference, tmp_path):
    data = yaml.safe_load(corpus.read_text())
    for s in data["sources"]:
        s["loaders"] = 3 if s["name"] != "books" else 2
    data["loading"]["threads"] = 3
    variant = corpus.parent / "many-loaders.yaml"
    variant.write_text(yaml.safe_dump(data))
    lines, _, _ = run(variant)
    assert lines == reference[0]  # byte for byte, rank assignment included


@pytest.mark.parametrize("cut", [1, 7, 13, STEPS - 1])
def test_exact_resume(corpus, reference, cut):
    first, state, _ = run(corpus, stop=cut)
    state = json.loads(json.dumps(state))  # a checkpoint goes through JSON
    assert state["step"] == cut
    rest, _, _ = run(corpus, start=cut, state=state)
    assert first + rest == reference[0]


@pytest.mark.parametrize(("cut", "dp"), [(5, 2), (10, 8), (17, 1)])
def test_elastic_resume_keeps_the_global_stream(corpus, reference, cut, dp):
    first, state, _ = run(corpus, stop=cut)
    rest, _, _ = run(corpus, start=cut, state=state, dp=dp)
    assert per_step_samples(first + rest) == per_step_samples(reference[0])


def test_resume_twice_in_a_row(corpus, reference):
    a, s1, _ = run(corpus, stop=4)
    b, s2, _ = run(corpus, start=4, stop=9, state=s1, dp=2)
    c, _, _ = run(corpus, start=9, state=s2)
    assert per_step_samples(a + b + c) == per_step_samples(reference[0])
    assert c == [x for x in reference[0] if json.loads(x)["step"] >= 9]


def test_state_is_as_of_the_last_step_every_rank_consumed(corpus):
    plan = load_plan(corpus)
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(plan.world.dp)]
        for c in clients:
            next(c)
        next(clients[0])  # rank 0 is one step ahead
        state = loader.state_dict()
    assert state["step"] == 1
    assert len(json.dumps(state)) < 4096


def test_payloads_are_the_records_they_name(corpus, reference):
    """Every sample's tokens in the batch are the bytes of the record its id names."""
    base = corpus.parent
    records: dict[str, list[str]] = {}

    def record(file: str, row: int) -> str:
        if file not in records:
            path = base / file
            if file.endswith(".parquet"):
                records[file] = pq.read_table(path).column("content").to_pylist()
            else:
                opener = gzip.open if file.endswith(".gz") else open
                with opener(path, "rt") as fh:
                    records[file] = [json.loads(x)["text"] for x in fh.read().splitlines()]
        return records[file][row]

    cap = load_plan(corpus).batch.max_seq_len
    for b in reference[2][:12]:
        used = Counter()
        for row in range(b.input_ids.shape[0]):
            flat = b.input_ids[row]
            offset = 0
            for s in [s for s in b.samples if s.row == row]:
                file, _, rest = s.id.partition(":")
                r, _, k = rest.partition("#")
                want = list(record(file, int(r)).encode()) + [256]
                if k:
                    want = want[int(k) * cap : (int(k) + 1) * cap]
                assert flat[offset : offset + s.tokens].tolist() == want
                offset += s.tokens
                used[row] += s.tokens
        assert all(v <= cap for v in used.values())


def test_mixture_follows_the_schedule(corpus, reference):
    lines = reference[0]
    tokens: dict[int, Counter] = {}
    for line in lines:
        rec = json.loads(line)
        for s in rec["samples"]:
            tokens.setdefault(rec["step"], Counter())[s["source"]] += s["tokens"]
    early = sum((tokens[s] for s in range(0, 8)), Counter())
    late = sum((tokens[s] for s in range(STEPS - 8, STEPS)), Counter())
    share = lambda c, k: c[k] / sum(c.values())  # noqa: E731
    assert share(early, "web") > share(late, "web") + 0.2
    assert share(late, "books") > share(early, "books") + 0.15


def test_resume_into_a_plan_that_reads_a_source_differently_fails(corpus, tmp_path):
    _, state, _ = run(corpus, stop=2)
    other = _variant(corpus, tmp_path, "reseeded", seed=12)
    with pytest.raises(CheckpointError, match="fingerprint"):
        Loader(load_plan(other), state=state)


def test_a_source_added_on_resume_starts_from_its_beginning(corpus):
    _, state, _ = run(corpus, stop=3)
    data = yaml.safe_load(corpus.read_text())
    data["sources"].append({"name": "more", "path": "web/part-0.jsonl", "format": "jsonl"})
    for point in data["mixture"]["schedule"]:
        point["weights"]["more"] = 0.2
    grown = corpus.parent / "grown.yaml"
    grown.write_text(yaml.safe_dump(data))
    lines, _, _ = run(grown, start=3, stop=6, state=state)
    sources = {s["source"] for line in lines for s in json.loads(line)["samples"]}
    assert "more" in sources


def test_a_state_taken_before_reading_anything_resumes_where_it_was(corpus, reference):
    """Resume, checkpoint at once (nothing read yet), resume again: no sample replayed."""
    _, state, _ = run(corpus, stop=5)
    with Loader(load_plan(corpus), state=state) as loader:
        again = loader.state_dict()
    assert again["sources"] == state["sources"]
    rest, _, _ = run(corpus, start=5, state=again)
    assert rest == [x for x in reference[0] if json.loads(x)["step"] >= 5]
