"""Errors that name their cause: a tokenizer file, a missing extra, a misspelled option."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import overlord
from overlord.errors import LoaderError, PlanError

BATCH = {"tokens_per_step": 64, "max_seq_len": 32}


def test_a_missing_tokenizer_file_is_named(tmp_path: Path) -> None:
    from overlord.sources.tokenizers import HFTokenizer

    pytest.importorskip("tokenizers")
    missing = tmp_path / "no-such-tokenizer.json"
    with pytest.raises(PlanError, match="tokenizer.path: cannot load the tokenizer file") as e:
        HFTokenizer(str(missing))
    assert str(missing) in str(e.value)


def test_a_report_without_matplotlib_names_the_extra(monkeypatch) -> None:
    from overlord.ops.report import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(LoaderError, match=r"pip install 'overlord-data\[demo\]'"):
        pyplot()


def test_a_misspelled_storage_option_is_named_before_any_request() -> None:
    pytest.importorskip("s3fs")
    source = {
        "name": "web",
        "path": "s3://bucket/web/*.jsonl",
        "format": "jsonl",
        # an endpoint where nothing listens: a request would be retried, then fail elsewhere
        "storage_options": {"endpoint": "http://127.0.0.1:9", "anon": True},
    }
    with pytest.raises(PlanError, match=r"did you mean 'endpoint_url'\?") as e:
        overlord.validate_plan({"sources": [source], "batch": BATCH}, check_files=True)
    assert "source 'web'" in str(e.value) and "'endpoint'" in str(e.value)


def test_storage_options_a_filesystem_passes_on_are_not_refused() -> None:
    from overlord.sources.files import unknown_options

    pytest.importorskip("s3fs")
    assert unknown_options("s3", {"profile": "dev", "region_name": "eu-west-1"}) is None
    assert unknown_options("s3", {"endpoint_url": "http://x", "anon": True}) is None
    assert unknown_options("s3", {"secert": "x"}) == (
        "s3:// takes no option 'secert' (did you mean 'secret'?)"
    )


@pytest.mark.integration
def test_a_report_that_cannot_be_written_keeps_the_runs_summary(tmp_path, overlord_cli) -> None:
    from conftest import make_corpus

    plan = make_corpus(tmp_path / "corpus")
    blocked = tmp_path / "report"
    blocked.write_text("a file where the report's folder would go")
    out = overlord_cli("run", str(plan), "--steps", "3", "--report", str(blocked), timeout=120)
    assert out.returncode == 1, out.stderr
    assert "steps 0..2:" in out.stdout and "balance (" in out.stdout  # the summary, printed
    assert f"cannot write the report to {blocked}" in out.stderr
