"""Object-store sources: a plan on S3 streams exactly what it streams on local copies.

The S3 server is moto's, started by the test on 127.0.0.1 (nothing leaves the
machine). Faults are injected where s3fs fetches a byte range, the request a
throttled or reset connection fails.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import make_corpus
from overlord import load_plan
from overlord.errors import OverlordError
from overlord.ops.run import run_plan
from overlord.plan.spec import Plan, validate_plan
from overlord.sources.probe import check_source

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

pytestmark = [
    pytest.mark.integration,
    # moto and botocore warn about their own deprecations; the test's warnings stay errors
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

BUCKET = "overlord-test"
STEPS = 14


@pytest.fixture(scope="module")
def endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def corpus(tmp_path: Path, endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """A plan on local files, the same plan on S3 copies of them, and the bucket's prefix."""
    for var, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # never ask a metadata service for credentials
    }.items():
        monkeypatch.setenv(var, value)
    root = tmp_path / "local"
    path = make_corpus(
        root,
        sources={
            "web": {
                "files": {
                    "data/web/part-0.jsonl": 40,
                    "data/web/part-1.jsonl.gz": 30,
                    "data/web/part-2.jsonl": 25,
                },
                "loaders": 2,
            },
            "code": {"files": {"data/code/part-0.parquet": 1}, "text_field": "content"},
        },
        shuffle={"block_bytes": 512, "window_blocks": 2},
        batch={"tokens_per_step": 512, "max_seq_len": 64},
    )
    # Parquet in several row groups, so that blocks are read by range at any place
    rows = [{"content": f"code row {i} " + "xyz" * (i % 7)} for i in range(60)]
    pq.write_table(pa.Table.from_pylist(rows), root / "data/code/part-0.parquet", row_group_size=8)
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    prefix = f"s3://{BUCKET}/{tmp_path.name}/"
    for f in sorted((root / "data").rglob("*")):
        if f.is_file():
            fs.put_file(str(f), prefix + str(f.relative_to(root)))
    local = load_plan(path)
    data = local.model_dump(mode="json")
    for s in data["sources"]:
        s["path"] = prefix + s["path"]
        s["storage_options"] = options
    remote = validate_plan(data, base_dir=local.base_dir)
    return local, remote, prefix


def dump(plan: Plan, steps: int = STEPS) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out = io.StringIO()
    summary = run_plan(plan, steps, dump=out, progress=False)
    return [json.loads(line) for line in out.getvalue().splitlines()], summary


def unmapped(lines: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """The dump with every URL id turned into the local one (its path in the plan's folder)."""
    for line in lines:
        for s in line["samples"]:
            assert s["id"].startswith(prefix), s["id"]
            s["id"] = s["id"][len(prefix) :]
    return lines


def test_a_plan_on_s3_streams_what_it_streams_on_local_copies(corpus):
    local, remote, prefix = corpus
    # how to reach the data is not which data: the fingerprints are the local plan's
    assert remote.source_fingerprint("web") != local.source_fingerprint("web")  # paths differ
    without = validate_plan(
        {
            **remote.model_dump(mode="json"),
            "sources": [
                {**s, "storage_options": {}} for s in remote.model_dump(mode="json")["sources"]
            ],
        },
        base_dir=remote.base_dir,
    )
    assert without.stream_fingerprint() == remote.stream_fingerprint()
    assert without.source_fingerprint("code") == remote.source_fingerprint("code")
    assert [check_source(remote, s) for s in remote.sources] == [[], []]  # overlord validate
    want, _ = dump(local)
    got, summary = dump(remote)
    ids = [s["id"] for line in got for s in line["samples"]]
    assert any(i.startswith(f"{prefix}data/web/part-1.jsonl.gz:") for i in ids)
    assert any(i.startswith(f"{prefix}data/code/part-0.parquet:") for i in ids)
    assert unmapped(got, prefix) == want
    assert summary["read_retries"] == 0


def test_transient_errors_are_retried_with_nothing_lost_or_repeated(corpus, monkeypatch):
    local, remote, prefix = corpus
    want, _ = dump(local)
    fetch = s3fs.core.S3File._fetch_range
    calls: dict[str, int] = {}
    injected: list[str] = []

    def flaky(self: Any, start: int, end: int) -> bytes:
        # each file's first two range requests fail, and every fourth after them
        n = calls[self.path] = calls.get(self.path, -1) + 1
        if n < 2 or n % 4 == 3:
            injected.append(self.path)
            raise OSError(f"injected: connection reset reading {self.path} [{start}, {end})")
        return fetch(self, start, end)

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", flaky)
    got, summary = dump(remote)
    assert unmapped(got, prefix) == want
    assert len({p.rsplit("/", 1)[-1] for p in injected}) == 4  # every file failed
    assert summary["read_retries"] == len(injected)


def test_an_error_that_does_not_go_away_names_the_url(corpus, monkeypatch):
    _, remote, prefix = corpus
    data = remote.model_dump(mode="json")
    data["loading"]["retries"] = 2

    def down(self: Any, start: int, end: int) -> bytes:
        raise OSError("injected: service unavailable")

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", down)
    with pytest.raises(OverlordError, match=f"{prefix}data/.*after 2 retries"):
        dump(validate_plan(data, base_dir=remote.base_dir), 2)
