"""The stream opener: which kind of stream a trainer process gets, and each kind's contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from overlord import CheckpointError, Loader, LoaderError, RankStream, load_plan, validate_plan
from overlord.ops.run import dump_line
from overlord.streams import EmbeddedStream, StreamKind, open_stream, stream_kind


def plan_of(world: dict[str, Any]) -> Any:
    return validate_plan(
        {
            "sources": [{"name": "a", "path": "a/*", "format": "jsonl"}],
            "batch": {"tokens_per_step": 64, "max_seq_len": 16},
            "world": world,
        }
    )


def test_the_launcher_and_the_plan_decide_the_kind() -> None:
    dp4, alone = plan_of({"dp": 4}), plan_of({"dp": 1})
    torchrun = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert stream_kind(dp4, env={}) is StreamKind.EMBEDDED
    assert stream_kind(dp4, env=torchrun) is StreamKind.NODE
    # a world of one process runs its own Loader in each torchrun process
    assert stream_kind(alone, env=torchrun) is StreamKind.EMBEDDED
    # roles that are Ray actors, or a Loader asked for alone, are this process's own
    assert stream_kind(dp4, "ray", env=torchrun) is StreamKind.EMBEDDED
    assert stream_kind(dp4, node=False, env=torchrun) is StreamKind.EMBEDDED
    # SLURM alone may span nodes: node mode is torchrun's (or asked for)
    assert stream_kind(dp4, env={"SLURM_NTASKS": "4"}) is StreamKind.EMBEDDED
    assert stream_kind(dp4, node=True, env=torchrun) is StreamKind.NODE


def test_node_mode_refuses_a_plan_of_another_world() -> None:
    mesh = plan_of({"dp": 1, "cp": 2, "tp": 2})
    with pytest.raises(LoaderError, match=r"set world.dp to 2"):
        stream_kind(mesh, env={"WORLD_SIZE": "8", "RANK": "0"})
    with pytest.raises(ValueError, match=r"not a multiple of cp\*tp\*pp=4"):
        stream_kind(mesh, env={"WORLD_SIZE": "6", "RANK": "0"})


def test_in_node_mode_each_process_opens_its_own_rank_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    dp4, mesh = plan_of({"dp": 4}), plan_of({"dp": 1, "cp": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"this process is DP rank 1: .*client\(1\)"):
        open_stream(dp4, 2, loader=Loader)
    with pytest.raises(ValueError, match=r"\(this process: rank_client\(1\)\)"):
        open_stream(mesh, 1, loader=Loader)
    with pytest.raises(ValueError, match="this process is global rank 1"):
        open_stream(mesh, global_rank=3, loader=Loader)


def test_open_stream_takes_a_plan_or_a_job() -> None:
    plan = plan_of({"dp": 1})
    with pytest.raises(ValueError, match="a plan or a job=, not both"):
        open_stream(plan, 0, job="j", loader=Loader)
    with pytest.raises(ValueError, match="one of the two"):
        open_stream(None, 0)
    with pytest.raises(TypeError, match="loader="):
        open_stream(plan, 0)
    with pytest.raises(ValueError, match="outside the plan's world"):
        open_stream(plan, 1, loader=Loader)


def test_an_embedded_stream_starts_late_restarts_on_load_and_remembers_on_close(
    job_plan: Path,
) -> None:
    with Loader(job_plan) as loader:
        client = loader.client(0, stop_step=6)
        assert isinstance(client, RankStream)
        want = [dump_line(b) for b in client]
    stream = open_stream(job_plan, loader=Loader, stop_step=6)
    assert isinstance(stream, EmbeddedStream) and isinstance(stream, RankStream)
    assert stream.step == 0 and stream._loader is None  # nothing runs before the first batch
    got = [dump_line(next(stream)) for _ in range(3)]
    after3 = stream.state_dict()
    got.append(dump_line(next(stream)))
    stream.load_state_dict(after3)  # back to step 3: a new Loader from that state
    assert stream.step == 3
    got[3:] = [dump_line(next(stream)) for _ in range(2)]
    stream.close()  # remembers step 5
    assert stream.step == 5 and stream.state_dict()["step"] == 5
    got.append(dump_line(next(stream)))
    with pytest.raises(StopIteration):
        next(stream)
    stream.close()
    assert got == want


def test_a_running_client_accepts_only_the_state_of_its_position(job_plan: Path) -> None:
    with Loader(job_plan) as loader:
        client = loader.client(0)
        next(client)
        here = client.state_dict()
        client.load_state_dict(here)  # where it is: nothing to do
        next(client)
        with pytest.raises(CheckpointError, match=r"expected 1 \(checkpoint\), found 2"):
            client.load_state_dict(here)
        web = {**here["sources"]["web"], "fingerprint": "0" * 16}  # read another way
        other = {**here, "fingerprint": "0" * 16, "sources": {**here["sources"], "web": web}}
        with pytest.raises(CheckpointError, match="stream fingerprint"):
            client.load_state_dict(other)
        client.close()


def test_a_plain_loader_is_not_in_node_mode(job_plan: Path) -> None:
    with Loader(load_plan(job_plan)) as loader:
        assert not loader.node
