"""HuggingFace: hf_inputs against a transformers causal LM, and Trainer with exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from overlord import Loader  # noqa: E402
from overlord.batch import Batch  # noqa: E402
from overlord.batch.rows import pack  # noqa: E402
from overlord.torch import OverlordIterableDataset, hf_collate, hf_inputs, to_torch  # noqa: E402

VOCAB = 258  # the bytes tokenizer's


def tiny_gpt2(attn: str = "sdpa", seed: int = 0, dropout: float = 0.0) -> Any:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=64,
        vocab_size=VOCAB,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        attn_implementation=attn,
    )
    return transformers.GPT2LMHeadModel(config)


def packed_batch() -> Batch:
    """Two rows of 16: several documents per row, one of length 1, and padding."""
    rng = np.random.default_rng(7)
    lengths = np.array([5, 1, 7, 4, 6, 3])
    rows = np.array([0, 0, 0, 1, 1, 1])
    tokens = rng.integers(1, VOCAB, int(lengths.sum()))
    arrays = pack(tokens, lengths, rows, rows=2, seq_len=16, pad_id=0)
    return Batch(step=0, rank=0, **arrays, samples=[], cost=0.0)


# ---- hf_inputs -----------------------------------------------------------------------------


def test_hf_inputs_moves_labels_one_right_and_never_across_documents() -> None:
    batch = packed_batch()
    hf = hf_inputs(batch)
    assert set(hf) == {"input_ids", "labels", "position_ids"}
    for name in hf:
        assert hf[name].dtype == torch.int64
        assert tuple(hf[name].shape) == (2, 16)
    np.testing.assert_array_equal(hf["input_ids"].numpy(), batch.input_ids)
    np.testing.assert_array_equal(hf["position_ids"].numpy(), batch.position_ids)
    labels = hf["labels"].numpy()
    assert (labels[:, 0] == -100).all()
    np.testing.assert_array_equal(labels[:, 1:], batch.labels[:, :-1])
    # what the model's shift scores: logits[t] against labels[t + 1]
    seg = batch.segment_ids
    rows, cols = np.nonzero(labels[:, 1:] != -100)
    assert len(rows) == int((batch.labels != -100).sum()) > 0
    assert (seg[rows, cols] == seg[rows, cols + 1]).all()  # same document ...
    assert (seg[rows, cols] > 0).all()  # ... and not padding
    assert (labels[rows, cols + 1] == batch.input_ids[rows, cols + 1]).all()  # the next token
    # a position whose predecessor ends a document or is padding is not scored
    ends = (seg[:, :-1] != seg[:, 1:]) | (seg[:, :-1] == 0)
    assert ends.any()
    assert (labels[:, 1:][ends] == -100).all()


def test_hf_inputs_takes_to_torch_dicts_and_refuses_labels_it_would_drop() -> None:
    batch = packed_batch()
    a, b = hf_inputs(batch), hf_inputs(to_torch(batch))
    for name in a:
        assert torch.equal(a[name], b[name])
    bad = to_torch(batch)
    bad["labels"][0, -1] = 5
    with pytest.raises(ValueError, match="last position"):
        hf_inputs(bad)


def test_hf_collate_unwraps_one_batch_and_turns_the_cache_off() -> None:
    batch = packed_batch()
    out = hf_collate([to_torch(batch)])
    assert out.pop("use_cache") is False
    assert torch.equal(out["labels"], hf_inputs(batch)["labels"])
    with pytest.raises(ValueError, match="per_device_train_batch_size=1"):
        hf_collate([to_torch(batch), to_torch(batch)])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_loss_is_cross_entropy_on_overlord_labels(attn: str) -> None:
    batch = packed_batch()
    model = tiny_gpt2(attn).eval()
    with torch.no_grad():  # sharp logits: a random model's are near uniform, every loss ~log(V)
        model.transformer.ln_f.weight.mul_(30)
    hf = hf_inputs(batch)
    with torch.no_grad():
        loss = model(**hf, use_cache=False).loss
        logits = model(hf["input_ids"], position_ids=hf["position_ids"], use_cache=False).logits
        wrong = model(hf["input_ids"], position_ids=hf["position_ids"], use_cache=False,
                      labels=torch.from_numpy(batch.labels).long()).loss  # fmt: skip
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), torch.from_numpy(batch.labels).long().reshape(-1)
    )
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    # overlord's labels given straight to the model are shifted twice: another loss
    assert abs(wrong.item() - expected.item()) > 1.0


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_documents_attend_only_to_themselves_with_use_cache_false(attn: str) -> None:
    batch = packed_batch()
    model = tiny_gpt2(attn).eval()
    hf = hf_inputs(batch)
    seg = batch.segment_ids
    cols = np.flatnonzero(seg[0] == 3)  # the third document of row 0, after two others
    alone_ids = hf["input_ids"][:1, cols]
    alone_pos = torch.arange(len(cols)).unsqueeze(0)
    with torch.no_grad():
        alone = model(alone_ids, position_ids=alone_pos, use_cache=False).logits[0]
        packed = model(**hf, use_cache=False).logits[0, cols]
        cached = model(**hf).logits[0, cols]  # use_cache from the config: True
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # with a cache the mask is plain causal: the document sees the ones before it
    assert (cached - alone).abs().max().item() > 1e-3


# ---- Trainer -------------------------------------------------------------------------------


@pytest.fixture
def plan(tmp_path: Path, make_corpus: Any) -> Path:
    return make_corpus(
        tmp_path / "corpus",
        world={"dp": 1},
        batch={"tokens_per_step": 128, "max_seq_len": 32},
    )


def reference_steps(plan: Path, steps: int) -> list[np.ndarray]:
    with Loader(plan) as loader:
        client = loader.client(0)
        return [next(client).input_ids.astype(np.int64) for _ in range(steps)]


class Recorder:
    """The overlord step of every batch the model is run on, by its input_ids."""

    def __init__(self, model: Any, reference: list[np.ndarray]):
        self.reference = reference
        self.steps: list[int] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        assert kwargs.get("use_cache") is False
        ids = kwargs["input_ids"].numpy()
        found = [s for s, ref in enumerate(self.reference) if np.array_equal(ref, ids)]
        assert len(found) == 1, "a batch that is not one step of the stream"
        self.steps.append(found[0])


def make_trainer(
    out: Path,
    plan: Path,
    reference: list[np.ndarray],
    max_steps: int,
    accum: int,
    dropout: float = 0.0,
    **extra: Any,
) -> tuple[Any, Recorder, OverlordIterableDataset]:
    hf = pytest.importorskip("overlord.hf", exc_type=ImportError)  # Trainer needs accelerate
    model = tiny_gpt2(dropout=dropout)
    recorder = Recorder(model, reference)
    ds = OverlordIterableDataset.from_plan(plan)
    args = transformers.TrainingArguments(
        str(out),
        max_steps=max_steps,
        gradient_accumulation_steps=accum,
        save_steps=2,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
        **{**hf.TRAINING_ARGS, **extra},
    )
    trainer = transformers.Trainer(model=model, args=args, **hf.hf_trainer_recipe(ds))
    return trainer, recorder, ds


@pytest.mark.integration
@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_trains_every_step_once_and_resumes_exactly(
    tmp_path: Path, plan: Path, accum: int
) -> None:
    max_steps = 4  # optimizer steps; a checkpoint every 2
    batches = max_steps * accum
    reference = reference_steps(plan, batches + 2)

    trainer, first, ds = make_trainer(tmp_path / "a", plan, reference, max_steps, accum)
    with ds:
        trainer.train()
    assert first.steps == list(range(batches))
    # accelerate read one batch ahead of the model; the dataset continues where it trained
    assert ds.step == batches

    ckpt = tmp_path / "a" / "checkpoint-2"
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["OverlordTrainerCallback"]["attributes"]["overlord_state"]
    assert state["step"] == 2 * accum  # the batches trained, not the one read ahead

    trainer2, second, ds2 = make_trainer(tmp_path / "b", plan, reference, max_steps, accum)
    with ds2:
        trainer2.train(resume_from_checkpoint=str(ckpt))
    assert first.steps[: 2 * accum] + second.steps == list(range(batches))
    for p, q in zip(trainer.model.parameters(), trainer2.model.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.integration
def test_a_model_with_dropout_resumes_bit_exactly(tmp_path: Path, plan: Path) -> None:
    """The random draws after a resume are the uninterrupted run's: the same weights."""
    reference = reference_steps(plan, 6)
    trainer, _, ds = make_trainer(tmp_path / "a", plan, reference, 4, 1, dropout=0.1)
    with ds:
        trainer.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    trainer2, _, ds2 = make_trainer(tmp_path / "b", plan, reference, 4, 1, dropout=0.1)
    with ds2:
        trainer2.train(resume_from_checkpoint=str(ckpt))
    for p, q in zip(trainer.model.parameters(), trainer2.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.integration
def test_trainer_without_the_recipe_settings_is_refused(tmp_path: Path, plan: Path) -> None:
    with pytest.raises(ValueError) as e:
        make_trainer(
            tmp_path, plan, [], 2, 1, ignore_data_skip=False, per_device_train_batch_size=2
        )
    assert "ignore_data_skip: expected True, found False" in str(e.value)
    assert "per_device_train_batch_size: expected 1, found 2" in str(e.value)
