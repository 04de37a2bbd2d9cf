"""An object-store endpoint that cannot be reached is named once, with every source using it.

The endpoint is a closed port on 127.0.0.1: nothing leaves the machine. No listing is
made for the sources behind it (each would fail in turn, after its retries and its
client library's own).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

import overlord
from overlord.errors import PlanError, SourceError
from overlord.sources.catalog import job_files
from overlord.sources.probe import check_sources
from overlord.sources.remote import endpoint_of, unreachable_endpoints

pytest.importorskip("s3fs")


@pytest.fixture
def closed() -> Iterator[str]:
    """An endpoint on a port nothing listens on (bound, so no one else takes it, not listening)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture
def listening() -> Iterator[str]:
    """An endpoint that accepts connections."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture
def no_listing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails any listing of a URL, recording it: none should be made behind a dead endpoint."""
    made: list[str] = []

    def listing(url: str, *a: Any, **kw: Any) -> Any:
        made.append(url)
        raise AssertionError(f"listed {url}")

    monkeypatch.setattr(fsspec, "get_fs_token_paths", listing)
    return made


def plan_data(endpoints: dict[str, str]) -> dict[str, Any]:
    return {
        "seed": 1,
        "sources": [
            {
                "name": name,
                "path": f"s3://bucket/{name}/*.jsonl",
                "format": "jsonl",
                "storage_options": {"endpoint_url": ep, "key": "k", "secret": "s"},
            }
            for name, ep in endpoints.items()
        ],
        "batch": {"tokens_per_step": 512, "max_seq_len": 64},
        "world": {"dp": 1},
        "loading": {"timeout_s": 5},
    }


def test_the_plan_check_names_the_endpoint_with_all_its_sources(
    tmp_path: Path, closed: str, no_listing: list[str]
) -> None:
    data = plan_data({"web": closed, "code": closed, "math": closed})
    with pytest.raises(PlanError) as e:
        overlord.validate_plan(data, base_dir=tmp_path, check_files=True)
    (problem,) = e.value.problems
    assert problem[0] == "sources[0].storage_options"
    assert f"endpoint {closed} cannot be reached" in problem[1]
    assert "'web', 'code', 'math'" in problem[1]
    assert no_listing == []


def test_validate_names_it_once(tmp_path: Path, closed: str, no_listing: list[str]) -> None:
    plan = overlord.validate_plan(plan_data({"web": closed, "code": closed}), base_dir=tmp_path)
    (problem,) = check_sources(plan)
    assert closed in problem.reason and "'web', 'code'" in problem.reason
    assert no_listing == []


def test_a_job_names_it_before_listing(tmp_path: Path, closed: str, no_listing: list[str]) -> None:
    sources = [("web", ["s3://b/web/*.jsonl"]), ("code", ["s3://b/code/*.jsonl"])]
    options = {n: {"endpoint_url": closed} for n, _ in sources}
    with pytest.raises(SourceError, match=f"endpoint {closed} cannot be reached.*'web', 'code'"):
        job_files(sources, str(tmp_path), None, options, timeout_s=5)
    assert no_listing == []


def test_only_the_endpoints_that_are_down_are_named(closed: str, listening: str) -> None:
    assert unreachable_endpoints([listening, closed, closed], 5).keys() == {closed}


def test_a_connection_that_never_opens_gives_up_at_the_timeout() -> None:
    # 192.0.2.0/24 is reserved for documentation: a connection there never opens (or the
    # network says at once that it cannot), so the wait is the timeout at most
    (why,) = unreachable_endpoints(["http://192.0.2.1:9000"], 0.2).values()
    assert why


def test_where_a_url_goes() -> None:
    assert endpoint_of("s3://b/x", {"endpoint_url": "http://h:9"}) == "http://h:9"
    assert endpoint_of("s3://b/x", {"client_kwargs": {"endpoint_url": "http://h:9"}}) == (
        "http://h:9"
    )
    assert endpoint_of("https://host.example/data/a.jsonl", None) == "https://host.example"
    assert endpoint_of("s3://b/x", {}) is None  # S3 finds its endpoint by region
    assert endpoint_of("data/a.jsonl", {"endpoint_url": "http://h:9"}) is None  # a local path
