"""The PyTorch adapter: tensors, the IterableDataset in a DataLoader, and its state."""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.roundtrip import Part, check_save_restore

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from overlord import CheckpointError, Loader, LoaderError  # noqa: E402
from overlord.batch import Batch  # noqa: E402
from overlord.batch.rows import pack  # noqa: E402
from overlord.torch import OverlordIterableDataset, to_torch  # noqa: E402

DP1 = {"world": {"dp": 1}, "batch": {"tokens_per_step": 128}}


def make_batch(writeable: bool = True) -> Batch:
    arrays = pack(np.arange(1, 8), np.array([3, 4]), np.array([0, 1]), 2, 4, pad_id=0)
    for a in arrays.values():
        a.setflags(write=writeable)
    return Batch(step=0, rank=0, **arrays, samples=[], cost=0.0)


def plain_stream(plan: Path, steps: int) -> list[np.ndarray]:
    with Loader(plan) as loader:
        client = loader.client(0)
        return [next(client).input_ids for _ in range(steps)]


def ids(batches: list[dict[str, Any]]) -> list[np.ndarray]:
    return [b["input_ids"].numpy() for b in batches]


def take(ds: OverlordIterableDataset, steps: int) -> list[dict[str, Any]]:
    it = iter(DataLoader(ds, batch_size=None, num_workers=0))
    return [next(it) for _ in range(steps)]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def plan(tmp_path: Path, make_corpus: Any) -> Path:
    return make_corpus(tmp_path, **DP1)


# ---- to_torch ------------------------------------------------------------------------------


@pytest.mark.parametrize("writeable", [True, False], ids=["writeable", "read-only"])
def test_to_torch_dtypes_shapes_and_zero_copy(writeable: bool) -> None:
    batch = make_batch(writeable)  # read-only: as batches from Ray's object store are
    t = to_torch(batch)
    assert set(t) == {"input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens"}
    for name, array in batch.arrays().items():
        assert tuple(t[name].shape) == array.shape
        np.testing.assert_array_equal(t[name].numpy(), array)
    assert t["input_ids"].dtype == t["labels"].dtype == torch.int64
    for name in ("position_ids", "segment_ids", "cu_seqlens"):
        assert t[name].dtype == torch.int32
        assert np.shares_memory(t[name].numpy(), batch.arrays()[name])  # zero-copy
    assert not np.shares_memory(t["input_ids"].numpy(), batch.input_ids)


def test_to_torch_pin_memory_is_ignored_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: pinning happens")
    t = to_torch(make_batch(), pin_memory=True, device="cpu")  # warnings are errors here
    assert not any(v.is_pinned() for v in t.values())
    assert all(v.device.type == "cpu" for v in t.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_torch_pins_and_moves() -> None:
    host = to_torch(make_batch(), pin_memory=True)
    assert all(v.is_pinned() for v in host.values())
    dev = to_torch(make_batch(), pin_memory=True, device="cuda")
    assert all(v.device.type == "cuda" for v in dev.values())


# ---- the dataset ---------------------------------------------------------------------------


@pytest.mark.integration
def test_dataset_in_a_dataloader_gives_the_client_stream(plan: Path) -> None:
    with OverlordIterableDataset.from_plan(plan, stop_step=6) as ds:
        got = list(DataLoader(ds, batch_size=None, num_workers=0))
        assert ds.step == 6
        assert list(DataLoader(ds, batch_size=None)) == []  # the stream ended at stop_step
    assert_same(ids(got), plain_stream(plan, 6))
    assert got[0]["labels"].dtype == torch.int64


@pytest.mark.integration
@pytest.mark.parametrize("via", ["load_state_dict", "from_plan"])
def test_state_round_trip_through_json_resumes_exactly(plan: Path, via: str) -> None:
    want = plain_stream(plan, 7)
    with OverlordIterableDataset.from_plan(plan) as ds:
        head = take(ds, 3)
        sd = ds.state_dict()
    assert list(sd) == ["overlord"] and isinstance(sd["overlord"], str)
    sd = json.loads(json.dumps(sd))  # what any checkpoint format keeps
    if via == "from_plan":
        resumed = OverlordIterableDataset.from_plan(plan, state=sd)
    else:
        resumed = OverlordIterableDataset.from_plan(plan)
        iter(resumed)  # as StatefulDataLoader does: an iterator exists before the state arrives
        resumed.load_state_dict(sd)
    with resumed:
        assert resumed.step == 3
        assert resumed.state_dict() == sd  # before iterating: what it will start from
        tail = take(resumed, 4)
    assert_same(ids(head + tail), want)


@pytest.mark.integration
# dcp.save and dcp.load without a process group say that they run in one process
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torch_distributed_checkpoint_saves_and_resumes_the_stream(
    plan: Path, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    want = plain_stream(plan, 5)
    with OverlordIterableDataset.from_plan(plan) as ds:
        assert isinstance(ds, Stateful)
        take(ds, 3)
        dcp.save({"data": ds}, checkpoint_id=tmp_path / "dcp")
    with OverlordIterableDataset.from_plan(plan) as resumed:
        dcp.load({"data": resumed}, checkpoint_id=tmp_path / "dcp")  # in place, then loads
        assert resumed.step == 3
        assert_same(ids(take(resumed, 2)), want[3:])


@pytest.mark.integration
def test_load_state_dict_after_iterating_restarts_from_that_state(plan: Path) -> None:
    want = plain_stream(plan, 5)
    with OverlordIterableDataset.from_plan(plan) as ds:
        take(ds, 2)
        sd = ds.state_dict()
        take(ds, 2)
        ds.load_state_dict(sd)
        assert_same(ids(take(ds, 3)), want[2:5])


@pytest.mark.integration
def test_load_state_dict_takes_a_plain_overlord_checkpoint(plan: Path) -> None:
    with OverlordIterableDataset.from_plan(plan) as ds:
        take(ds, 2)
        state = ds.overlord_state()
    assert state["step"] == 2 and json.loads(ds.state_dict()["overlord"]) == state
    with OverlordIterableDataset.from_plan(plan) as again:
        again.load_state_dict(state)
        assert again.step == 2


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"overlord": "{not json"}, "not valid JSON"),
        ({"overlord": 3}, "must be a JSON string"),
        ({"something": "else"}, "expected"),
    ],
)
def test_bad_state_is_a_clear_error(plan: Path, bad: dict[str, Any], match: str) -> None:
    with (
        OverlordIterableDataset.from_plan(plan) as ds,
        pytest.raises(CheckpointError, match=match),
    ):
        ds.load_state_dict(bad)


@pytest.mark.integration
def test_state_of_another_plan_is_refused(plan: Path, tmp_path: Path, make_corpus: Any) -> None:
    other = make_corpus(tmp_path / "other", seed=99, **DP1)
    with OverlordIterableDataset.from_plan(other) as ds:
        take(ds, 1)
        sd = ds.state_dict()
    with (
        OverlordIterableDataset.from_plan(plan) as ds,
        pytest.raises(CheckpointError, match="fingerprint"),
    ):
        ds.load_state_dict(sd)


def test_rank_outside_the_plan_is_refused(plan: Path) -> None:
    with pytest.raises(ValueError, match="outside the plan's world"):
        OverlordIterableDataset.from_plan(plan, rank=1)


@pytest.mark.integration
def test_num_workers_above_zero_is_refused(plan: Path) -> None:
    ds = OverlordIterableDataset.from_plan(plan)  # nothing started yet: safe to fork
    batches = iter(DataLoader(ds, batch_size=None, num_workers=1))
    try:
        with pytest.raises(LoaderError, match=r"DataLoader worker(.|\n)*num_workers=0"):
            next(batches)
    finally:
        # the error's traceback holds the iterator in a reference cycle; left to the garbage
        # collector, its clean-up waits out a 5 s timeout for the worker to exit
        getattr(batches, "_shutdown_workers", lambda: None)()


def test_the_dataset_cannot_be_pickled(plan: Path) -> None:
    # what DataLoader workers started by spawn or forkserver would need
    ds = OverlordIterableDataset.from_plan(plan)
    with pytest.raises(TypeError, match="num_workers=0"):
        pickle.dumps(ds)


@pytest.mark.ray
@pytest.mark.integration
def test_from_job_reads_a_served_job_and_checks_its_position(plan: Path, ray_session: Any) -> None:
    want = plain_stream(plan, 4)
    job = f"test-torch-{uuid.uuid4().hex[:8]}"
    with Loader(plan, runtime="ray", job=job):
        ds = OverlordIterableDataset.from_job(job, rank=0)
        got = take(ds, 2)  # read-only arrays from Ray's object store: no warning
        sd = ds.state_dict()
        ds.load_state_dict(sd)  # the job is at that position: nothing to do
        got += take(ds, 2)
        with pytest.raises(CheckpointError, match=r"expected 2 \(checkpoint\), found 4"):
            ds.load_state_dict(sd)
        ds.close()  # the job keeps running: it is not the dataset's
        assert ds.step == 4
    assert_same(ids(got), want)


@pytest.mark.integration
def test_the_pytorch_dataset_resumes_from_its_state(plan: Path) -> None:
    job_plan = plan
    from overlord.torch import OverlordIterableDataset

    def make(state: dict[str, Any] | None) -> tuple[Any, Any]:
        ds = OverlordIterableDataset.from_plan(job_plan, state=state)
        return ds, iter(ds)

    check_save_restore(
        Part(
            make,
            lambda p: next(p[1])["input_ids"].tolist(),
            lambda p: p[0].state_dict(),
            lambda p: p[0].close(),
        ),
        7,
    )
