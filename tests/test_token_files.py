"""Pre-tokenized sources: flat token files and Megatron's indexed datasets, as written.

The files are written by independent writers: numpy (``np.save``, ``tofile``) for flat token
arrays, and megatron-core's own ``IndexedDatasetBuilder`` for ``.idx`` + ``.bin`` pairs, with
a second writer written here from the format's description (checked byte for byte against
megatron-core's). What the trainers receive is compared with the documents as written.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from support.memory import peak_kib
from support.runs import sample_tokens

import overlord
from overlord.errors import LoaderError, PlanError, SourceError
from overlord.sources.probe import check_sources

EOS = 2


def documents(seed: int, n: int, vocab: int = 50_000, longest: int = 300) -> list[np.ndarray]:
    """``n`` documents of random ids, each ending with EOS (ids 3.. so that EOS is only there)."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(3, vocab, rng.integers(1, longest)), EOS) for _ in range(n)]


def plan_for(root: Path, source: dict[str, Any], **over: Any) -> Path:
    data: dict[str, Any] = {
        "seed": 11,
        "sources": [{"name": "tok", **source}],
        "batch": {"tokens_per_step": 2048, "max_seq_len": 256},
        "world": {"dp": 2},
        "shuffle": {"block_bytes": 4096, "window_blocks": 3},
        "loading": {"timeout_s": 30},
    }
    data.update(over)
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def delivered(plan: Any, steps: int) -> list[Any]:
    with overlord.Loader(plan) as loader:
        clients = [loader.client(r) for r in range(loader.plan.world.dp)]
        return [next(c) for _ in range(steps) for c in clients]


def check_against(batches: list[Any], want: dict[str, list[int]], cap: int) -> int:
    """Every sample equals its document as written (a chunk of it for a long one)."""
    seen = 0
    for batch in batches:
        for sid, got in sample_tokens(batch).items():
            doc, _, chunk = sid.partition("#")
            ids = want[doc]
            k = int(chunk) if chunk else 0
            assert got == ids[k * cap : (k + 1) * cap], sid
            seen += 1
    return seen


# ---- flat token files -------------------------------------------------------------------


def test_npy_and_raw_files_deliver_their_documents_exactly(tmp_path: Path) -> None:
    docs = documents(1, 300)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "a.npy", np.concatenate(docs[:150]).astype(np.uint16))
    np.concatenate(docs[150:]).astype(np.uint16).tofile(tmp_path / "data" / "b.bin")
    want = {f"data/a.npy:{i}": d.tolist() for i, d in enumerate(docs[:150])}
    want |= {f"data/b.bin:{i}": d.tolist() for i, d in enumerate(docs[150:])}
    src = {"path": ["data/*.npy", "data/*.bin"], "format": "tokens", "dtype": "uint16"}
    plan = overlord.load_plan(plan_for(tmp_path, {**src, "eos_id": EOS}))
    batches = delivered(plan, 12)
    assert check_against(batches, want, 256) > 100
    firsts = {s.id for b in batches for s in b.samples if "#" not in s.id}
    assert len(firsts) == sum(1 for b in batches for s in b.samples if "#" not in s.id)


def test_the_eos_belongs_to_its_document_and_a_trailing_run_is_the_last(tmp_path: Path) -> None:
    ids = np.array([5, 6, EOS, EOS, 7, EOS, 8, 9, 10], np.int32)  # an eos alone: empty
    (tmp_path / "t.npy").write_bytes(b"")
    np.save(tmp_path / "t.npy", ids)
    src = {"path": "t.npy", "format": "tokens", "eos_id": EOS}
    plan = overlord.load_plan(
        plan_for(tmp_path, src, world={"dp": 1}, batch={"tokens_per_step": 64, "max_seq_len": 64})
    )
    (batch,) = delivered(plan, 1)
    got = sample_tokens(batch)
    assert got == {"t.npy:0": [5, 6, EOS], "t.npy:2": [7, EOS], "t.npy:3": [8, 9, 10]}


def test_documents_far_longer_than_a_block_are_read_whole(tmp_path: Path) -> None:
    # a block's last document is read on past the block, in chunks that grow: documents of
    # up to 20,000 ids over blocks of 2,048, and blocks where no document starts
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(3, 60_000, int(n)), EOS) for n in rng.integers(1, 20_000, 24)]
    np.save(tmp_path / "long.npy", np.concatenate(docs).astype(np.uint16))
    want = {f"long.npy:{i}": d.tolist() for i, d in enumerate(docs)}
    src = {"path": "long.npy", "format": "tokens", "eos_id": EOS}
    batch = {"tokens_per_step": 32_768, "max_seq_len": 4096}
    plan = overlord.load_plan(plan_for(tmp_path, src, batch=batch, world={"dp": 1}))
    batches = delivered(plan, 8)
    assert check_against(batches, want, 4096) > 40
    assert {sid.partition("#")[0] for b in batches for sid in sample_tokens(b)} == set(want)


def test_big_endian_and_uint32_files_read_as_written(tmp_path: Path) -> None:
    docs = documents(2, 40, vocab=3_000_000)
    np.save(tmp_path / "a.npy", np.concatenate(docs).astype(">u4"))
    want = {f"a.npy:{i}": d.tolist() for i, d in enumerate(docs)}
    plan = overlord.load_plan(
        plan_for(tmp_path, {"path": "a.npy", "format": "tokens", "eos_id": EOS})
    )
    assert check_against(delivered(plan, 3), want, 256) > 10


def test_the_stream_of_a_token_source_is_the_same_for_any_dp_and_loader_count(
    tmp_path: Path,
) -> None:
    docs = documents(3, 400)
    (tmp_path / "data").mkdir()
    for k in range(4):
        np.save(tmp_path / "data" / f"p{k}.npy", np.concatenate(docs[k::4]).astype(np.uint16))
    src = {"path": "data/*.npy", "format": "tokens", "eos_id": EOS}

    def steps(dp: int, loaders: int) -> list[list[str]]:
        plan = overlord.load_plan(plan_for(tmp_path, {**src, "loaders": loaders}, world={"dp": dp}))
        batches = delivered(plan, 6)
        return [
            sorted(s.id for b in batches[i * dp : (i + 1) * dp] for s in b.samples)
            for i in range(6)
        ]

    assert steps(1, 1) == steps(2, 2) == steps(4, 3)


def test_a_token_source_resumes_exactly(tmp_path: Path) -> None:
    docs = documents(4, 300)
    np.save(tmp_path / "a.npy", np.concatenate(docs).astype(np.int32))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(f'{{"text": "words of line {i} " }}\n' for i in range(200)))
    sources = [
        {"name": "tok", "path": "a.npy", "format": "tokens", "eos_id": EOS},
        {"name": "web", "path": "text.jsonl", "format": "jsonl"},
    ]
    path = plan_for(tmp_path, {}, sources=sources)
    plan = overlord.load_plan(path)
    with overlord.Loader(plan) as loader:
        clients = [loader.client(r) for r in range(2)]
        first = [next(c) for _ in range(3) for c in clients]
        state = loader.state_dict()
        rest = [next(c) for _ in range(3) for c in clients]
    with overlord.Loader(plan, state=state) as loader:
        clients = [loader.client(r) for r in range(2)]
        again = [next(c) for _ in range(3) for c in clients]
    assert {s.source for b in first for s in b.samples} == {"tok", "web"}
    assert [[s.id for s in b.samples] for b in again] == [[s.id for s in b.samples] for b in rest]
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(again, rest))


# ---- Megatron's indexed datasets -----------------------------------------------------------


def megatron_by_description(prefix: Path, docs: list[list[np.ndarray]], dtype: Any) -> None:
    """``prefix.bin`` and ``prefix.idx`` written from the format's description (not overlord's)."""
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}
    lengths, pointers, doc_index, at = [], [], [0], 0
    with open(f"{prefix}.bin", "wb") as f:
        for doc in docs:
            for seq in doc:
                data = np.asarray(seq, dtype).tobytes()
                f.write(data)
                lengths.append(len(seq))
                pointers.append(at)
                at += len(data)
            doc_index.append(len(lengths))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", codes[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, np.int32).tobytes())
        f.write(np.asarray(pointers, np.int64).tobytes())
        f.write(np.asarray(doc_index, np.int64).tobytes())


def megatron_core_builder() -> Any:
    with warnings.catch_warnings():  # it warns that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    return indexed.IndexedDatasetBuilder


def megatron_docs(seed: int, n: int) -> list[list[np.ndarray]]:
    """Documents of one to three sequences each."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(3, 60_000, rng.integers(1, 120)) for _ in range(rng.integers(1, 4))]
        for _ in range(n)
    ]


def test_our_description_writes_what_megatron_core_writes(tmp_path: Path) -> None:
    builder_class = megatron_core_builder()
    docs = megatron_docs(5, 30)
    builder = builder_class(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.concatenate(doc), [len(s) for s in doc])
    builder.finalize(str(tmp_path / "mc.idx"))
    megatron_by_description(tmp_path / "ours", docs, np.uint16)
    for ext in ("idx", "bin"):
        assert (tmp_path / f"mc.{ext}").read_bytes() == (tmp_path / f"ours.{ext}").read_bytes()


def test_megatron_core_datasets_deliver_their_documents_exactly(tmp_path: Path) -> None:
    builder_class = megatron_core_builder()
    (tmp_path / "data").mkdir()
    want: dict[str, list[int]] = {}
    for k, (dtype, seed) in enumerate([(np.uint16, 6), (np.int32, 7)]):
        docs = megatron_docs(seed, 80)
        builder = builder_class(str(tmp_path / "data" / f"part{k}.bin"), dtype=dtype)
        for doc in docs:
            builder.add_document(np.concatenate(doc), [len(s) for s in doc])
        builder.finalize(str(tmp_path / "data" / f"part{k}.idx"))
        want |= {
            f"data/part{k}.idx:{d}": np.concatenate(doc).tolist() for d, doc in enumerate(docs)
        }
    plan = overlord.load_plan(plan_for(tmp_path, {"path": "data/*.idx", "format": "megatron"}))
    batches = delivered(plan, 10)
    assert check_against(batches, want, 256) > 60


def test_a_megatron_document_of_no_sequence_is_empty_not_a_sample(tmp_path: Path) -> None:
    docs = [[np.array([5, 6, 7])], [], [np.array([8, 9])]]
    megatron_by_description(tmp_path / "d", docs, np.int32)
    plan = overlord.load_plan(
        plan_for(
            tmp_path,
            {"path": "d.idx", "format": "megatron"},
            world={"dp": 1},
            batch={"tokens_per_step": 64, "max_seq_len": 64},
        )
    )
    (batch,) = delivered(plan, 1)
    assert sample_tokens(batch) == {"d.idx:0": [5, 6, 7], "d.idx:2": [8, 9]}


# ---- bad files --------------------------------------------------------------------------


def failure(plan: Any) -> str:
    with pytest.raises((SourceError, LoaderError)) as e:
        delivered(plan, 1)
    return str(e.value)


def test_bad_token_files_are_named(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "raw.bin")
    plan = overlord.load_plan(
        plan_for(tmp_path, {"path": "raw.bin", "format": "tokens", "eos_id": EOS})
    )
    assert "raw.bin" in (msg := failure(plan)) and "needs the source's dtype" in msg

    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.int32))
    plan = overlord.load_plan(
        plan_for(tmp_path, {"path": "a.npy", "format": "tokens", "eos_id": EOS, "dtype": "uint16"})
    )
    assert "the plan's dtype is uint16 but the .npy header says int32" in failure(plan)

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    plan = overlord.load_plan(
        plan_for(
            tmp_path, {"path": "odd.bin", "format": "tokens", "eos_id": EOS, "dtype": "uint16"}
        )
    )
    assert "3 bytes of ids are not a whole number of uint16 ids" in failure(plan)


def test_bad_megatron_pairs_are_named(tmp_path: Path) -> None:
    megatron_by_description(tmp_path / "m", megatron_docs(8, 10), np.uint16)
    data = (tmp_path / "m.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(data[:-10])
    plan = overlord.load_plan(plan_for(tmp_path, {"path": "m.idx", "format": "megatron"}))
    assert "the .bin file is truncated" in (msg := failure(plan)) and "m.idx" in msg
    (tmp_path / "m.bin").unlink()
    assert "its .bin file is missing: m.bin" in failure(plan)


def test_plan_rules_for_token_sources() -> None:
    base = {"batch": {"tokens_per_step": 64, "max_seq_len": 32}}
    with pytest.raises(PlanError) as e:
        overlord.validate_plan(
            {
                "sources": [{"name": "t", "path": "x", "format": "tokens", "transform": "m:f"}],
                **base,
            }
        )
    problems = dict(e.value.problems)
    assert problems["sources[0].eos_id"] == "format tokens needs the id that ends a document"
    assert "a transform works on text" in problems["sources[0].transform"]
    with pytest.raises(PlanError, match=r"sources\[0\]\.eos_id: applies to format tokens only"):
        overlord.validate_plan(
            {"sources": [{"name": "t", "path": "x", "format": "jsonl", "eos_id": 1}], **base}
        )


def test_text_sources_keep_their_fingerprint() -> None:
    """A plan of text sources hashes as it did before token sources existed (checkpoints load)."""
    plan = overlord.validate_plan(
        {
            "sources": [{"name": "t", "path": "x", "format": "jsonl"}],
            "batch": {"tokens_per_step": 64, "max_seq_len": 32},
        }
    )
    assert plan.source_fingerprint("t") == "632ce0f1f01fd959"  # as before token sources
    assert plan.stream_fingerprint() == "a130aa19d8c6c8ee"
    assert plan.stream_fingerprint() == "a130aa19d8c6c8ee"  # kept: made once per plan
    reseeded = plan.model_copy(update={"seed": 2})  # a copy hashes what it holds, not the kept
    assert reseeded.stream_fingerprint() == reseeded._hash_of_stream() != "a130aa19d8c6c8ee"
    assert plan.with_dp(2).stream_fingerprint() == "a130aa19d8c6c8ee"


def test_validate_names_eos_dtype_and_vocabulary_problems(tmp_path: Path) -> None:
    np.save(tmp_path / "noeos.npy", np.full(1_100_000, 7, np.uint16))
    src = {"name": "tok", "path": "noeos.npy", "format": "tokens", "eos_id": EOS}
    plan = overlord.validate_plan(
        {"sources": [src], "batch": {"tokens_per_step": 64, "max_seq_len": 32}}, base_dir=tmp_path
    )
    (problem,) = check_sources(plan)
    assert "noeos.npy" in problem.place and "is eos_id 2 the id that ends" in problem.reason

    np.save(tmp_path / "big.npy", np.array([5, 300, EOS], np.uint16))
    src = {"name": "tok", "path": "big.npy", "format": "tokens", "eos_id": EOS}
    plan = overlord.validate_plan(
        {
            "sources": [src],
            "tokenizer": {"kind": "bytes"},
            "batch": {"tokens_per_step": 64, "max_seq_len": 32},
        },
        base_dir=tmp_path,
    )
    (problem,) = check_sources(plan)
    assert "row 0" in problem.place and "id 300 is outside the tokenizer's vocabulary" in (
        problem.reason
    )
    plan = overlord.validate_plan(
        {"sources": [src], "batch": {"tokens_per_step": 64, "max_seq_len": 32}}, base_dir=tmp_path
    )
    assert check_sources(plan) == []  # no tokenizer named: no vocabulary to hold ids to


# ---- memory ---------------------------------------------------------------------------------


def token_file_peak(root: Path, mib: int) -> int:
    """The peak RSS of a process that trains 40 steps from a token file of ``mib`` MiB."""
    root.mkdir()
    doc = np.append(np.arange(3, 1003, dtype=np.uint16), np.uint16(EOS))
    per = 1 << 19  # ids written at once: 1 MiB
    with open(root / "big.bin", "wb") as f:
        chunk = np.tile(doc, per // len(doc) + 1)[:per]
        for _ in range(mib):
            chunk.tofile(f)
    assert (root / "big.bin").stat().st_size == mib << 20
    src = {"path": "big.bin", "format": "tokens", "eos_id": EOS, "dtype": "uint16"}
    shuffle = {"block_bytes": 1 << 20, "window_blocks": 2}
    plan = plan_for(root, src, world={"dp": 1}, shuffle=shuffle)
    return peak_kib(plan, 40)


@pytest.mark.integration
def test_memory_does_not_follow_the_size_of_a_token_file(tmp_path: Path) -> None:
    """A 512 MiB token file costs a loader what a 16 MiB one does (its blocks, not the file)."""
    small, large = token_file_peak(tmp_path / "small", 16), token_file_peak(tmp_path / "large", 512)
    assert large - small < 48 * 1024, f"peak {small} KiB at 16 MiB, {large} KiB at 512 MiB"


def test_an_id_int32_cannot_hold_is_named(tmp_path: Path) -> None:
    np.save(tmp_path / "wide.npy", np.array([5, 2**31, EOS], np.uint32))
    src = {"path": "wide.npy", "format": "tokens", "eos_id": EOS}
    plan = overlord.load_plan(plan_for(tmp_path, src))
    assert "an id above 2147483647" in (msg := failure(plan)) and "wide.npy" in msg


# ---- a window gathered from its blocks' ids ---------------------------------------------


def windows_of(plan: Any, pos: int) -> list[Any]:
    from overlord.sources.files import resolve_files
    from overlord.sources.shard import shard_windows

    spec = plan.sources[0]
    return list(shard_windows(plan, spec, resolve_files(spec, plan.base_dir), 0, pos))


def window_view(w: Any) -> tuple[Any, ...]:
    texts = [p.texts.to_pylist() for p in w.pieces]
    return (w.rows.tolist(), w.offsets.tolist(), w.cut, texts, w.records, w.empty, w.number)


def test_reads_of_ids_are_the_files_bytes_and_a_short_file_is_named(tmp_path: Path) -> None:
    from overlord.errors import SourceError
    from overlord.sources.files import Shard
    from overlord.sources.token_files import KEPT_READ_BYTES, _Ranges

    data = np.random.default_rng(2).integers(0, 256, 3 * KEPT_READ_BYTES, np.uint8).tobytes()
    (tmp_path / "t.bin").write_bytes(data)
    ranges = _Ranges("tok", Shard(str(tmp_path / "t.bin"), "t.bin"))
    held = ranges.read_ids(5, 5 + 2 * KEPT_READ_BYTES)  # into a kept block
    for lo, hi in [(0, 10), (7, 7 + KEPT_READ_BYTES), (KEPT_READ_BYTES, len(data))]:
        assert ranges.read_ids(lo, hi).tobytes() == data[lo:hi]  # short ones: the heap's
    assert held.tobytes() == data[5 : 5 + 2 * KEPT_READ_BYTES]  # not written by later reads
    with pytest.raises(SourceError, match=f"ends at byte {len(data)}.*truncated"):
        ranges.read_ids(KEPT_READ_BYTES, len(data) + 1)


def test_a_windows_block_is_used_again_only_once_its_pieces_are_gone(tmp_path: Path) -> None:
    pytest.importorskip("numba")
    from overlord.sources.files import resolve_files
    from overlord.sources.shard import shard_windows
    from overlord.sources.token_window import _WINDOW_IDS

    rng = np.random.default_rng(4)
    docs = [np.append(rng.integers(3, 60_000, int(n)), EOS) for n in rng.integers(1, 400, 1500)]
    np.save(tmp_path / "t.npy", np.concatenate(docs).astype(np.uint16))
    src = {"path": "t.npy", "format": "tokens", "eos_id": EOS}
    plan = overlord.load_plan(
        plan_for(tmp_path, src, shuffle={"block_bytes": 16384, "window_blocks": 2})
    )
    spec = plan.sources[0]
    windows = shard_windows(plan, spec, resolve_files(spec, plan.base_dir), 0, 0)

    def start(w: Any) -> int:  # where its first piece's ids lie: the start of its block
        return int(w.pieces[0].texts.buffers()[2].address)

    def kept(address: int) -> bool:  # in one of the blocks kept to be used again
        return any(b.ctypes.data <= address < b.ctypes.data + b.nbytes for b in _WINDOW_IDS._flat)

    first = next(windows)
    held, at = first.pieces[0], start(first)  # a piece held: its block must not be written
    want = held.texts.to_pylist()
    del first
    starts = []
    for w in windows:  # each window dropped before the next is made
        starts.append(start(w))
        assert kept(starts[-1])  # every window placed in a kept block
    assert len(starts) > 4 and at not in starts
    assert len(set(starts)) < len(starts)  # the blocks of the windows that went, used again
    assert held.texts.to_pylist() == want


@pytest.mark.parametrize("kind", ["npy-uint16", "raw-uint32", "npy-int32", "megatron"])
def test_a_gathered_window_is_the_window_the_text_way_makes(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(9)
    # short documents, eos alone (empty), and documents over several blocks
    lengths = rng.choice([1, 2, 40, 300, 9_000], size=160, p=[0.1, 0.1, 0.4, 0.35, 0.05])
    docs = [np.append(rng.integers(3, 60_000, int(n) - 1), EOS) for n in lengths]
    if kind == "megatron":
        seqs = [[d[: len(d) // 2], d[len(d) // 2 :]] for d in docs] + [[]]  # and one of none
        megatron_by_description(tmp_path / "m", seqs, np.uint16)
        src: dict[str, Any] = {"path": "m.idx", "format": "megatron"}
    else:
        suffix, dtype = kind.split("-")
        ids = np.concatenate(docs).astype(dtype)
        if suffix == "npy":
            np.save(tmp_path / "t.npy", ids)
        else:
            ids.tofile(tmp_path / "t.bin")
        src = {"path": f"t.{suffix if suffix == 'npy' else 'bin'}", "format": "tokens"}
        src |= {"eos_id": EOS, **({"dtype": dtype} if suffix == "raw" else {})}
    plan = overlord.load_plan(
        plan_for(tmp_path, src, shuffle={"block_bytes": 2048, "window_blocks": 3})
    )
    gathered = windows_of(plan, 0)
    monkeypatch.setattr("overlord.sources.shard.gathers", lambda dtype: False)
    text_way = windows_of(plan, 0)
    assert len(gathered) == len(text_way) > 3
    # empty: a flat file's eos alone, the megatron document of no sequence
    assert sum(w.empty for w in gathered) == (1 if kind == "megatron" else (lengths == 1).sum())
    assert any(len(w.cut) > 1 for w in gathered)
    for got, want in zip(gathered, text_way):
        assert window_view(got) == window_view(want)
