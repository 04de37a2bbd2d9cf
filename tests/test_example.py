"""examples/train_tiny_gpt.py: trains under torchrun (node mode or --ray), checkpoints, resumes."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from overlord.batch.rows import pack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny_gpt.py"
STEP = re.compile(r"^step (\d+) loss (\S+) data (\w+)$", re.M)
SUMMARY = re.compile(r"^loss first (\S+) last (\S+)", re.M)
# Measured on the default model and corpus: the mean loss of steps 0-4 is about 4.97 and
# that of steps 25-29 about 3.02, each the same on every run (CPU, fixed seeds).
MIN_DROP = 1.0


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(*args: str, timeout: float = 240) -> tuple[str, dict[int, tuple[float, str]]]:
    """Run the example on 2 processes; its output and ``{step: (loss, data digest)}``."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.Popen(
        [*cmd, str(EXAMPLE), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that a hang is stopped with every process it started
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the example ran past {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    steps = {int(s): (float(loss), data) for s, loss, data in STEP.findall(out)}
    return out, steps


# what a user may import: the package and its top-level public modules
PUBLIC = {"overlord", "overlord.torch", "overlord.hf", "overlord.checkpoint", "overlord.errors",
          "overlord.world", "overlord.serve", "overlord.streams"}  # fmt: skip


def test_examples_import_only_the_public_surface() -> None:
    import ast

    for path in sorted((ROOT / "examples").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )  # fmt: skip
            for name in names:
                if name.split(".")[0] == "overlord":
                    assert name in PUBLIC, f"{path.name}:{node.lineno} imports {name}"


def test_document_causal_mask_follows_cu_seqlens() -> None:
    mask_of = load_example().document_causal_mask
    lengths, rows = np.array([2, 3, 1, 4]), np.array([0, 0, 1, 1])
    arrays = pack(np.arange(10), lengths, rows, 2, 6, pad_id=0)
    mask = mask_of(torch.from_numpy(arrays["cu_seqlens"]), 2, 6)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    seg = torch.from_numpy(arrays["segment_ids"])  # 0 is padding: a segment of its own too
    want = (seg[:, :, None] == seg[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask[:, 0], want)
    assert mask[:, 0].diagonal(dim1=1, dim2=2).all()  # no row without a key: no NaN


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[int, Any]]:
    """20 steps on dp=2 (no CP), checkpointing every 10: the folder, the output, the steps."""
    tmp_path = tmp_path_factory.mktemp("example")
    ckpt, data = tmp_path / "ckpt", tmp_path / "data"
    common: list[Any] = ["--data-dir", data, "--checkpoint-dir", ckpt, "--checkpoint-every", 10]
    out, first = torchrun(*map(str, [*common, "--steps", 20]))
    return tmp_path, out, first


@pytest.mark.integration
def test_trains_checkpoints_and_resumes(first_run: tuple[Path, str, dict[int, Any]]) -> None:
    tmp_path, out, first = first_run
    ckpt, data = tmp_path / "ckpt", tmp_path / "data"
    common: list[Any] = ["--data-dir", data, "--checkpoint-dir", ckpt, "--checkpoint-every", 10]
    assert sorted(first) == list(range(20)), out
    assert (ckpt / "step-00000010" / "step-00000010.json").is_file()
    assert (ckpt / "step-00000020" / "trainer.pt").is_file()

    resumed_ckpt = tmp_path / "ckpt-resumed"
    args = [*common[:2], "--checkpoint-dir", resumed_ckpt, "--steps", 30]
    out, resumed = torchrun(*map(str, [*args, "--resume", ckpt / "step-00000010"]))
    assert "resumed from step 10" in out, out
    assert sorted(resumed) == list(range(10, 30)), out
    for step in range(10, 20):
        # the same data (every rank's tokens) and the same model and optimizer state:
        # the same loss, step for step
        assert resumed[step][1] == first[step][1], (step, out)
        assert resumed[step][0] == pytest.approx(first[step][0], abs=1e-3), (step, out)
    assert (resumed_ckpt / "step-00000030" / "trainer.pt").is_file()

    start = sum(first[s][0] for s in range(5)) / 5
    end = sum(resumed[s][0] for s in range(25, 30)) / 5
    assert end < start - MIN_DROP, (start, end)
    summary = SUMMARY.search(out)
    assert summary is not None and float(summary.group(2)) == pytest.approx(end, abs=1e-3)


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["zigzag", "per_document"])
def test_cp_losses_equal_those_without_cp(
    first_run: tuple[Path, str, dict[int, Any]], layout: str
) -> None:
    """dp=1 x cp=2 against dp=2 x cp=1: the loss is the mean over every token of the step,
    so neither how DP ranks split a step nor how CP ranks cut a row may change it."""
    tmp_path, _, reference = first_run
    args = ["--data-dir", tmp_path / "data", "--steps", 10, "--cp", 2, "--cp-layout", layout]
    out, sliced = torchrun(*map(str, args))
    assert f"dp 1 x cp 2 ({layout})" in out, out
    assert sorted(sliced) == list(range(10)), out
    for step in range(10):
        assert sliced[step][0] == pytest.approx(reference[step][0], rel=1e-4), (step, out)


@pytest.mark.integration
def test_dynamic_cp_losses_equal_those_without_cp(
    first_run: tuple[Path, str, dict[int, Any]],
) -> None:
    """dp=1 x cp: dynamic (cp_max 2, 64 tokens per CP rank: the corpus's paragraphs of
    65-256 bytes are cut over both ranks, shorter ones stay whole) against dp=2 x cp=1."""
    tmp_path, _, reference = first_run
    args = ["--data-dir", tmp_path / "data", "--steps", 10, "--cp", "dynamic",
            "--cp-max", 2, "--tokens-per-cp-rank", 64]  # fmt: skip
    out, sliced = torchrun(*map(str, args))
    assert "dp 1 x cp 2 (dynamic, cp_max 2, 64 tokens per CP rank)" in out, out
    assert sorted(sliced) == list(range(10)), out
    for step in range(10):
        assert sliced[step][0] == pytest.approx(reference[step][0], rel=1e-4), (step, out)


@pytest.mark.ray
@pytest.mark.integration
def test_with_ray_a_job_resumes_the_node_mode_checkpoint_with_the_same_losses(
    first_run: tuple[Path, str, dict[int, Any]],
) -> None:
    """``--ray``: a job on Ray started from node mode's checkpoint of step 10; every rank
    connects to it and trains steps 10-19 on the same data, to the same losses."""
    tmp_path, _, first = first_run
    args = ["--data-dir", tmp_path / "data", "--steps", 20, "--ray",
            "--resume", tmp_path / "ckpt" / "step-00000010"]  # fmt: skip
    out, resumed = torchrun(*map(str, args))
    assert "a job on Ray: dp 2 x cp 1" in out and "resumed from step 10" in out, out
    assert sorted(resumed) == list(range(10, 20)), out
    for step in range(10, 20):
        assert resumed[step][1] == first[step][1], (step, out)
        assert resumed[step][0] == pytest.approx(first[step][0], abs=1e-3), (step, out)


def test_dynamic_cp_mask_of_gathered_slices_is_the_unsliced_mask() -> None:
    """Documents of degree 1, 2 and 4 over 4 ranks: the mask over the gathered slices,
    keyed by unsliced document, is the cp=1 mask at their positions."""
    from overlord.batch import Batch
    from overlord.batch.cp_dynamic import dynamic_slices
    from overlord.plan.cost import CostModel

    ex = load_example()
    lengths, rows = np.array([5, 3, 1, 9, 2, 12]), np.array([0, 0, 0, 1, 1, 2])
    arrays = pack(np.arange(32), lengths, rows, 3, 12, pad_id=0)
    whole = ex.document_causal_mask(torch.from_numpy(arrays["cu_seqlens"]), 3, 12)[:, 0]
    slices = dynamic_slices(Batch(0, 0, samples=[], cost=0.0, **arrays), 4, 3, CostModel(1, 0), 0)
    assert {d for s in slices for _, d in s.cp_groups.tolist()} == {1, 2, 4}
    seg = torch.cat([torch.from_numpy(s.segment_ids) for s in slices], dim=1)
    pos = torch.cat([torch.from_numpy(s.global_positions) for s in slices], dim=1)
    keys = ex.document_keys(seg, pos, 12)
    width = pos.shape[1] // 4
    for i in range(4):
        mask = ex.cp_causal_mask(keys, pos, i, 4)[0, 0]
        for a, ga in enumerate(pos[0, i * width : (i + 1) * width].tolist()):
            for b, gb in enumerate(pos[0].tolist()):
                if ga >= 0 and gb >= 0:
                    want = ga // 12 == gb // 12 and bool(whole[ga // 12, ga % 12, gb % 12])
                    assert bool(mask[a, b]) == want, (i, a, b)
            assert mask[a].any()  # no query without a key: no NaN


def test_cp_mask_of_gathered_slices_is_the_unsliced_mask() -> None:
    """In one process: the CP mask over gathered slices equals the cp=1 mask at their positions."""
    from overlord.batch import Batch
    from overlord.batch.cp import cp_slices
    from overlord.world import CPLayout

    ex = load_example()
    lengths, rows = np.array([5, 3, 1, 7, 2]), np.array([0, 0, 0, 1, 1])
    arrays = pack(np.arange(18), lengths, rows, 2, 12, pad_id=0)
    whole = ex.document_causal_mask(torch.from_numpy(arrays["cu_seqlens"]), 2, 12)[:, 0]
    for layout in CPLayout:
        slices = cp_slices(Batch(0, 0, samples=[], cost=0.0, **arrays), 3, layout, 0)
        seg = torch.cat([torch.from_numpy(s.segment_ids) for s in slices], dim=1)
        pos = torch.cat([torch.from_numpy(s.global_positions) for s in slices], dim=1)
        for i in range(3):
            mask = ex.cp_causal_mask(seg, pos, i, 3)[:, 0]
            q = pos[:, i * (pos.shape[1] // 3) : (i + 1) * (pos.shape[1] // 3)]
            for r in range(2):
                for a, ga in enumerate(q[r].tolist()):
                    for b, gb in enumerate(pos[r].tolist()):
                        if ga >= 0 and gb >= 0:
                            want = bool(whole[r, ga % 12, gb % 12])
                            assert bool(mask[r, a, b]) == want, (layout, i, r, a, b)
                    assert mask[r, a].any()  # no query without a key: no NaN
