"""The ``overlord`` command line: validate, run, plan.

Commands run in-process through ``overlord.ops.cli.main``; one test runs the
installed console script to prove the entry point works.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from conftest import make_corpus
from overlord.ops.cli import main

integration = pytest.mark.integration

ID = re.compile(r"^(?P<file>[^:]+):(?P<row>\d+)(?:#(?P<chunk>\d+))?$")
LONG_DOCS = [{"text": f"long {i} " + "0123456789" * (7 + 5 * i)} for i in range(4)]  # 79..229 B
ALPHA, BETA = 1.0, 0.01


def corpus(root: Path, **overrides: Any) -> Path:
    """Two sources, three JSONL shards (one of documents longer than a row), one Parquet shard."""
    sources = {
        "web": {
            "files": {
                "data/web/part-0.jsonl": 12,
                "data/web/part-1.jsonl": 12,
                "data/web/long.jsonl": LONG_DOCS,
            }
        },
        "code": {"files": {"data/code/part-0.parquet": 14}, "text_field": "content"},
    }
    plan: dict[str, Any] = {
        "mixture": {
            "schedule": [
                {"step": 0, "weights": {"web": 0.7, "code": 0.3}},
                {"step": 6, "weights": {"web": 0.3, "code": 0.7}},
            ]
        },
        "balance": {"cost": {"alpha": ALPHA, "beta": BETA}},
        **overrides,
    }
    return make_corpus(root, sources, **plan)


def read_dump(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_samples(lines: list[dict[str, Any]]) -> dict[int, Counter[tuple[str, str, int]]]:
    """The samples of each step, whichever rank got them."""
    out: dict[int, Counter[tuple[str, str, int]]] = {}
    for line in lines:
        c = out.setdefault(line["step"], Counter())
        c.update((s["source"], s["id"], s["tokens"]) for s in line["samples"])
    return out


def record_text(root: Path, file: str, row: int) -> str:
    if file.endswith(".parquet"):
        return str(pq.read_table(root / file).column("content")[row].as_py())
    return str(json.loads((root / file).read_text().splitlines()[row])["text"])


# ---- validate ----------------------------------------------------------------------------------


def test_validate_valid_plan_prints_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(tmp_path)
    assert main(["validate", str(plan)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.count("\n") == 1
    assert out.startswith(f"{plan}: valid: 2 source(s), 4 rows of 64 tokens per step, dp=2 ")
    assert "balance=kk" in out


def test_validate_invalid_plan_prints_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(
        tmp_path,
        batch={"tokens_per_step": 300},
        mixture={"schedule": [{"step": 0, "weights": {"web": 1.0, "wbe": 1.0}}]},
        tokenizer={"kind": "hf"},
    )
    assert main(["validate", str(plan)]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "has 3 problem(s)" in err
    for path in ("batch.tokens_per_step", "mixture.schedule[0].weights.wbe", "tokenizer.path"):
        assert f"  - {path}: " in err


def test_validate_glob_that_matches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = make_corpus(tmp_path, {"web": {"files": {"data/web/a.jsonl": 2}, "path": "web/*.jsonl"}})
    assert main(["validate", str(plan)]) == 1
    err = capsys.readouterr().err
    assert "sources[0].path: source 'web': 'web/*.jsonl' matches no file" in err


def test_validate_opens_the_first_record_of_each_source_and_the_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sources = {
        "web": {"files": {"data/web/a.jsonl": ['{"body": "x"}']}},
        "code": {"files": {"data/code/a.parquet": [{"content": "x"}]}, "text_field": "body"},
    }
    plan = make_corpus(tmp_path, sources, tokenizer={"kind": "hf", "path": "missing.json"})
    assert main(["validate", str(plan)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{plan}: 3 problem(s) opening the tokenizer and the first record" in err
    assert "  - tokenizer.path missing.json: cannot load the tokenizer file" in err
    assert "  - source 'web', file data/web/a.jsonl, row 0: no field 'text'" in err
    assert "  - source 'code', file data/code/a.parquet: no column 'body'" in err


def test_validate_missing_plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read the plan file" in capsys.readouterr().err


# ---- run ---------------------------------------------------------------------------------------


@integration
def test_run_dump_format(tmp_path: Path) -> None:
    plan = corpus(tmp_path)
    dump = tmp_path / "dump.jsonl"
    assert main(["run", str(plan), "--steps", "5", "--dump", str(dump)]) == 0

    raw = dump.read_text().splitlines()
    lines = [json.loads(x) for x in raw]
    assert [(x["step"], x["rank"]) for x in lines] == [(s, r) for s in range(5) for r in range(2)]
    chunked = 0
    for x in lines:
        assert list(x) == ["step", "rank", "samples", "tokens", "cost"]
        assert isinstance(x["step"], int) and isinstance(x["rank"], int)
        assert isinstance(x["tokens"], int) and isinstance(x["cost"], float)
        assert x["samples"], "every rank gets samples"
        for s in x["samples"]:
            assert list(s) == ["source", "id", "tokens"]
            assert isinstance(s["tokens"], int) and s["tokens"] > 0
            m = ID.match(s["id"])
            assert m, s["id"]
            file, row, chunk = m["file"], int(m["row"]), m["chunk"]
            assert file.startswith(f"data/{s['source']}/")
            doc = len(record_text(tmp_path, file, row).encode()) + 1  # bytes + end of document
            if chunk is None:
                assert s["tokens"] == doc <= 64
            else:
                chunked += 1
                assert doc > 64 and s["tokens"] == min(64, doc - 64 * int(chunk))
        assert x["tokens"] == sum(s["tokens"] for s in x["samples"])
        want = sum(ALPHA * s["tokens"] + BETA * s["tokens"] ** 2 for s in x["samples"])
        assert x["cost"] == pytest.approx(want)
    assert chunked > 0, "the long documents were split into '#k' chunks"

    # the same plan gives the same dump
    again = tmp_path / "again.jsonl"
    assert main(["run", str(plan), "--steps", "5", "--dump", str(again)]) == 0
    assert again.read_text().splitlines() == raw


@integration
def test_run_dp_changes_only_who_gets_a_sample(tmp_path: Path) -> None:
    plan = corpus(tmp_path)
    dumps = {}
    for dp in (1, 2, 4):
        dumps[dp] = tmp_path / f"dp{dp}.jsonl"
        assert (
            main(["run", str(plan), "--steps", "6", "--dp", str(dp), "--dump", str(dumps[dp])]) == 0
        )
    lines = {dp: read_dump(p) for dp, p in dumps.items()}
    for dp, got in lines.items():
        assert [(x["step"], x["rank"]) for x in got] == [
            (s, r) for s in range(6) for r in range(dp)
        ]
    assert step_samples(lines[1]) == step_samples(lines[2]) == step_samples(lines[4])


def test_run_dp_that_does_not_divide_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(tmp_path)
    assert main(["run", str(plan), "--steps", "1", "--dp", "3"]) == 1
    assert "world.dp" in capsys.readouterr().err


@integration
def test_checkpoint_and_resume_continue_the_same_stream(tmp_path: Path) -> None:
    plan = corpus(tmp_path)
    full, a, b, c = (tmp_path / f"{n}.jsonl" for n in ("full", "a", "b", "c"))
    ck = tmp_path / "ck"
    assert main(["run", str(plan), "--steps", "8", "--dump", str(full)]) == 0

    args = ["run", str(plan), "--checkpoint-dir", str(ck)]
    assert main([*args, "--steps", "2", "--checkpoint-every", "1", "--dump", str(a)]) == 0
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000001.json", "step-00000002.json"]
    # beside the checkpoints, each run's journal, kept for `overlord replay`
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["journal"]
    # resumed on another DP size (elastic): the global stream goes on unchanged
    cmd = [*args, "--steps", "5", "--resume", str(ck), "--checkpoint-every", "2", "--dp", "4"]
    assert main([*cmd, "--dump", str(b)]) == 0
    names = ["step-00000001.json", "step-00000002.json", "step-00000004.json", "step-00000005.json"]
    assert sorted(p.name for p in ck.glob("step-*")) == names
    assert sorted(p.name for p in (ck / "journal").iterdir()) == ["run-0000", "run-0001"]
    for name in names:
        state = json.loads((ck / name).read_text())
        assert state["step"] == int(name[5:13])
    assert main(["run", str(plan), "--steps", "8", "--resume", str(ck), "--dump", str(c)]) == 0
    assert len(list(ck.glob("step-*"))) == 4  # no --checkpoint-dir: nothing written
    assert len(list((ck / "journal").iterdir())) == 2  # and no journal kept

    parts = read_dump(a) + read_dump(b) + read_dump(c)
    assert [x["step"] for x in read_dump(b)] == [s for s in range(2, 5) for _ in range(4)]
    assert sorted({x["step"] for x in parts}) == list(range(8))
    assert step_samples(parts) == step_samples(read_dump(full))
    # with the same DP size, each rank gets exactly what it got in the uninterrupted run
    assert read_dump(a) + read_dump(c) == [
        x for x in read_dump(full) if x["step"] in (0, 1, 5, 6, 7)
    ]


@integration
def test_resume_at_or_past_the_last_step_does_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(tmp_path)
    ck = tmp_path / "ck"
    assert main(["run", str(plan), "--steps", "3", "--checkpoint-dir", str(ck)]) == 0
    assert [p.name for p in ck.glob("step-*")] == ["step-00000003.json"]
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "3", "--resume", str(ck)]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_resume_from_a_folder_without_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(tmp_path)
    (tmp_path / "empty").mkdir()
    assert main(["run", str(plan), "--steps", "2", "--resume", str(tmp_path / "empty")]) == 1
    assert "no checkpoint" in capsys.readouterr().err


@integration
def test_resume_into_a_plan_that_reads_sources_differently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(tmp_path)
    ck = tmp_path / "ck"
    assert main(["run", str(plan), "--steps", "2", "--checkpoint-dir", str(ck)]) == 0
    other = corpus(tmp_path, plan_name="other.yaml", seed=99)
    capsys.readouterr()
    assert main(["run", str(other), "--steps", "4", "--resume", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "refused  sources.web: fingerprint" in err and "refused  sources.code" in err


def test_checkpoint_every_needs_a_checkpoint_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(corpus(tmp_path)), "--checkpoint-every", "2"]) == 2
    assert "--checkpoint-every needs --checkpoint-dir" in capsys.readouterr().err


@integration
def test_run_prints_its_summary_to_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(corpus(tmp_path)), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("steps 0..2: ")
    assert "balance (kk)" in out and "web:" in out and "code:" in out


@integration
def test_run_summary_has_a_records_line_per_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    web = [{"text": f"web doc {i}"} for i in range(6)] + [{"text": " "}, '{"body": 1}']
    plan = make_corpus(
        tmp_path,
        {"web": {"files": {"data/web/a.jsonl": web}}, "code": 9},
        on_error="skip",
    )
    assert main(["run", str(plan), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "records per source (each file counted once per loader that read it" in out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if "epoch(s) begun" in ln}
    assert set(lines) == {"web", "code"}
    assert re.search(
        r"web: 8 read, 1 empty \(not samples\), 1 skipped \(bad\), 0 dropped "
        r"\(too long\); [1-9]\d* epoch\(s\) begun$",
        lines["web"],
    )
    assert re.search(r"code: 9 read, 0 empty .*, 0 skipped", lines["code"])


# ---- plan --------------------------------------------------------------------------------------


def plan_table(out: str) -> tuple[list[list[float]], str]:
    """The rows of ``overlord plan`` as numbers (percent signs dropped), and its last line."""
    lines = out.splitlines()
    assert lines[0].split() == ["step", "max/LB", "none/LB", "fill", "web", "code"]
    rows = [[float(x.rstrip("%")) for x in line.split()] for line in lines[1:-1]]
    return rows, lines[-1]


@integration
def test_plan_prints_a_line_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(corpus(tmp_path)), "--steps", "8", "--dp", "4"]) == 0
    rows, last = plan_table(capsys.readouterr().out)
    assert [int(r[0]) for r in rows] == list(range(8))
    for r in rows:
        shares = r[4:]
        assert len(shares) == 2 and sum(shares) == pytest.approx(100, abs=0.2)
    # the last line is the mean of each balance column, and kk beats the baseline on this corpus
    m = re.fullmatch(r"mean max/LB ([\d.]+) \(kk\); without balancing ([\d.]+)", last)
    assert m, last
    assert float(m[1]) == pytest.approx(sum(r[1] for r in rows) / 8, abs=1.5e-4)
    assert float(m[2]) == pytest.approx(sum(r[2] for r in rows) / 8, abs=1.5e-4)
    assert float(m[1]) < float(m[2])
    # with balancing off, the plan's column is the baseline's, and the baseline is unchanged
    off = corpus(
        tmp_path / "off", balance={"method": "none", "cost": {"alpha": ALPHA, "beta": BETA}}
    )
    assert main(["plan", str(off), "--steps", "8", "--dp", "4"]) == 0
    off_rows, _ = plan_table(capsys.readouterr().out)
    assert [r[1] for r in off_rows] == [r[2] for r in off_rows] == [r[2] for r in rows]
    # the curriculum moves from web to code
    web = [r[4] for r in rows]
    assert web[0] > 50 > web[-1]


def test_plan_needs_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", str(corpus(tmp_path))])
    assert e.value.code == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "plan", "demo"])
@pytest.mark.parametrize("steps", ["0", "-3", "two"])
def test_steps_must_be_positive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, steps: str
) -> None:
    args = [command] if command == "demo" else [command, str(corpus(tmp_path))]
    with pytest.raises(SystemExit) as e:
        main([*args, "--steps", steps])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --steps:" in err
    assert ("must be positive" if steps != "two" else "expected a whole number") in err


# ---- connecting to Ray: its flags (the connect itself: tests/test_ray_private.py) --------------


@pytest.mark.parametrize("command", ["serve", "status", "run"])
def test_every_command_that_joins_ray_takes_a_connect_timeout(command: str) -> None:
    from overlord.ops.cli import build_parser

    first = ["serve", "plan.yaml", "--name", "j"] if command == "serve" else [command, "x"]
    args = build_parser().parse_args([*first, "--connect-timeout", "2.5"])
    assert args.connect_timeout == 2.5
    assert build_parser().parse_args(first).connect_timeout is None  # the environment, else 60


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_connect_timeout_must_be_a_positive_number_of_seconds(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["status", "job", "--connect-timeout", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --connect-timeout:" in err
    assert ("expected a number of seconds" if value == "soon" else "must be above 0") in err


def test_an_address_needs_the_ray_runtime(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(corpus(tmp_path)), "--address", "127.0.0.1:6379"]) == 2
    assert "--address needs --runtime ray" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "-2", "never", "nan"])
def test_the_connect_timeout_of_the_environment_is_checked(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    from overlord.errors import LoaderError
    from overlord.runtime.ray_connect import connect_timeout

    monkeypatch.setenv("OVERLORD_CONNECT_TIMEOUT", text)
    with pytest.raises(LoaderError, match=f"OVERLORD_CONNECT_TIMEOUT='{text}' \\(environment\\)"):
        connect_timeout()
    monkeypatch.setenv("OVERLORD_CONNECT_TIMEOUT", "7")
    assert connect_timeout() == 7.0 and connect_timeout(1.5) == 1.5
    monkeypatch.delenv("OVERLORD_CONNECT_TIMEOUT")
    assert connect_timeout() == 60.0


def test_sigterm_stops_a_command_with_status_143(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    import overlord.ops.cli as cli

    def terminated(args: Any) -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once: this is the main thread
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(cli, "_cmd_validate", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["validate", str(corpus(tmp_path))]) == 143
    assert capsys.readouterr().err == "overlord: stopped by SIGTERM\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


# ---- the installed console script --------------------------------------------------------------


def console_script() -> str:
    local = Path(sys.executable).parent / "overlord"
    found = str(local) if local.exists() else shutil.which("overlord")
    assert found, "the overlord console script is not installed (pip install -e .)"
    return found


@integration
def test_console_script_entry_point(tmp_path: Path) -> None:
    exe = console_script()
    plan = corpus(tmp_path)
    ok = subprocess.run([exe, "validate", str(plan)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{plan}: valid: 2 source(s)")

    bad = corpus(tmp_path / "bad", world={"dp": 3})
    no = subprocess.run([exe, "validate", str(bad)], capture_output=True, text=True, timeout=60)
    assert no.returncode == 1
    assert "world.dp" in no.stderr and no.stdout == ""

    ran = subprocess.run(
        [exe, "run", str(plan), "--steps", "3"], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("steps 0..2: ")
    assert "balance (kk)" in ran.stdout and "web:" in ran.stdout and "code:" in ran.stdout


@integration
def test_run_summary_shows_each_autoscaler_size_with_supply_demand_and_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = corpus(tmp_path, autoscale={"cpus": 4, "every": 2})
    assert main(["run", str(plan), "--steps", "8"]) == 0
    out = capsys.readouterr().out
    for name in ("web", "code"):
        sizes = re.findall(
            rf"autoscaler, {name}:\n((?:  step .*\n)+)", out
        )  # the decisions that set or changed its size, one line each
        assert sizes, out
        for line in sizes[0].splitlines():
            m = re.fullmatch(
                r"  step +\d+: (\d+) loader\(s\) x (\d+) thread\(s\), supply ([\d,]+) for demand "
                r"([\d,]+) tokens/s, ([\d.]+) cores",
                line,
            )
            assert m, line
            loaders, threads, cores = int(m[1]), int(m[2]), float(m[5])
            assert loaders >= 1 and 0 <= cores <= loaders * threads


def test_a_served_job_records_its_ray_address_while_it_is_served(monkeypatch):
    # trainers and `overlord status` on this machine find the job's own Ray instance by its
    # name, never the one Ray's address file names; only while the job is served
    from overlord.serve import _address_of, job_address, job_lock

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    name = f"record-{os.getpid()}"
    assert job_address(name) is None and _address_of(name, None) == "auto"
    with job_lock(name) as record:
        assert job_address(name) is None  # Ray not joined yet: nothing recorded
        record("127.0.0.1:6380")
        assert job_address(name) == "127.0.0.1:6380"
        assert _address_of(name, None) == "127.0.0.1:6380"
        assert _address_of(name, "10.0.0.1:6379") == "10.0.0.1:6379"  # an address given wins
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
        assert _address_of(name, None) == "10.0.0.2:6379"
    assert job_address(name) is None  # the serve ended: its record is stale, not used
