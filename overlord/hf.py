"""``transformers.Trainer`` on an overlord stream, with exact resume.

Needs ``transformers`` (and ``accelerate``, which its Trainer needs). The recipe::

    from overlord.hf import TRAINING_ARGS, hf_trainer_recipe
    from overlord.torch import OverlordIterableDataset

    ds = OverlordIterableDataset.from_plan("plan.yaml")
    args = TrainingArguments("out", max_steps=1000, save_steps=100, **TRAINING_ARGS)
    trainer = Trainer(model=model, args=args, **hf_trainer_recipe(ds))
    trainer.train()  # later: trainer.train(resume_from_checkpoint=True)

:data:`TRAINING_ARGS` are the settings the recipe needs (checked when the Trainer
is built): ``per_device_train_batch_size=1`` (an overlord batch is a whole step
already), ``dataloader_num_workers=0`` (overlord builds batches outside the
trainer), and ``ignore_data_skip=True`` (the Trainer would otherwise skip, on
resume, as many batches as it trained from a stream that already resumes there).

Why a callback: the Trainer reads ahead. Its DataLoader is prepared by
``accelerate``, whose loader fetches the next batch before it yields the current
one (to know which is last), so when the Trainer saves after optimizer step
``k`` the stream has handed out a batch more than the model trained on; a
dataset state taken then skips that batch on resume. :class:`HFStream` records
the overlord state before each batch it hands out, and
:class:`OverlordTrainerCallback` counts the batches the training loop actually
consumed (one ``on_substep_end`` or ``on_step_end`` per micro-batch), so that the
state saved with the checkpoint (in ``trainer_state.json``, under the callback's
name) is the state after the last batch trained. On resume the callback loads
that state into the stream before the Trainer starts reading.

Random state: with ``ignore_data_skip`` the Trainer does not restore its random
generators on a resume within an epoch (it does so only where it skips batches), so a
model with dropout would train on other random draws than the uninterrupted run. The
callback saves Python's, numpy's and torch's generators (CUDA's too, where there is
one) with the overlord state, as JSON, and sets them back just before the first step
trained after a resume: where the Trainer itself would (after it fetched that step's
batches), so the run continues as if it had not stopped.

One process: a Trainer over several processes (``accelerate``/``torchrun``) hands
an ``IterableDataset`` to ``accelerate``, which either reads it on process 0 and
scatters, or gives each process every n-th batch of its own stream; neither is an
overlord DP rank's stream, so the callback refuses ``world_size > 1``.
"""

from __future__ import annotations

import base64
import random
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from overlord.errors import CheckpointError
from overlord.torch import OverlordIterableDataset, hf_collate

TRAINING_ARGS: dict[str, Any] = {
    "per_device_train_batch_size": 1,
    "dataloader_num_workers": 0,
    "ignore_data_skip": True,
}


class HFStream(IterableDataset[dict[str, torch.Tensor]]):
    """An :class:`~overlord.torch.OverlordIterableDataset` that knows what was handed out.

    It yields the dataset's batches and keeps, for each batch handed out and not
    yet reported trained (:meth:`trained`), the overlord state before it.
    """

    def __init__(self, dataset: OverlordIterableDataset):
        super().__init__()
        self.dataset = dataset
        self._ahead: deque[dict[str, Any]] = deque()  # states before batches read, not trained

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The dataset's batches from the first one not trained on."""
        self.rewind()
        return self._batches()

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        it = iter(self.dataset)
        while True:
            before = self.dataset.overlord_state()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._ahead.append(before)
            yield batch

    def trained(self) -> None:
        """The training loop consumed the oldest batch handed out."""
        if not self._ahead:
            raise RuntimeError(
                "a training step was reported for a batch HFStream did not hand out: is "
                "the Trainer's train_dataset this stream (hf_trainer_recipe's)?"
            )
        self._ahead.popleft()

    def state(self) -> dict[str, Any]:
        """The overlord state after the last batch trained (before the first one read ahead)."""
        return self._ahead[0] if self._ahead else self.dataset.overlord_state()

    def load(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; batches read ahead are dropped."""
        self._ahead.clear()
        self.dataset.load_state_dict(state)

    def rewind(self) -> None:
        """Forget the batches read ahead: the stream continues at the first one not trained."""
        if self._ahead:
            self.load(self._ahead[0])

    def __reduce__(self) -> Any:
        return self.dataset.__reduce__()  # refuses, saying why


def _tensor_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _text_tensor(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), np.uint8).copy())


def random_state() -> dict[str, Any]:
    """The generators a training step draws from, as JSON: Python's, numpy's, torch's, CUDA's."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(words), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _tensor_text(torch.random.get_rng_state()),
    }
    if torch.cuda.is_available():
        out["cuda"] = [_tensor_text(t) for t in torch.cuda.random.get_rng_state_all()]
    return out


def set_random_state(saved: dict[str, Any]) -> None:
    """Set the generators back to what :func:`random_state` returned."""
    version, words, gauss = saved["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(_text_tensor(saved["torch"]))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all([_text_tensor(t) for t in saved["cuda"]])


class OverlordTrainerCallback(TrainerCallback, ExportableState):
    """Saves the state of the batches trained with each checkpoint, and resumes from it.

    The state goes into the checkpoint's ``trainer_state.json``
    (``stateful_callbacks["OverlordTrainerCallback"]["attributes"]["overlord_state"]``).
    """

    def __init__(self, stream: HFStream):
        self.stream = stream
        self._random: dict[str, Any] | None = None  # set back before the next step trained

    def state(self) -> dict[str, Any]:
        """What the Trainer writes into ``trainer_state.json`` when it checkpoints.

        The random state is taken when the Trainer saves its own (``rng_state.pth``), in the
        same call: the two are the same.
        """
        attributes = {"overlord_state": self.stream.state(), "random_state": random_state()}
        return {"args": {}, "attributes": attributes}

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Check the Trainer's settings against what the recipe needs, all at once."""
        problems = [
            f"{name}: expected {want!r}, found {getattr(args, name)!r}"
            for name, want in TRAINING_ARGS.items()
            if getattr(args, name) != want
        ]
        if args.restore_callback_states_from_checkpoint:
            problems.append(
                "restore_callback_states_from_checkpoint: expected False, found True (the "
                "Trainer would rebuild this callback without its stream; it restores itself)"
            )
        if args.world_size > 1:
            problems.append(
                f"world_size: expected 1, found {args.world_size} (accelerate would shard or "
                "scatter the stream; one overlord DP rank per Trainer process is not supported)"
            )
        if problems:
            raise ValueError(
                "transformers.Trainer is not set up for an overlord stream:\n  "
                + "\n  ".join(problems)
                + "\nPass TrainingArguments(..., **overlord.hf.TRAINING_ARGS)."
            )

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """On resume (``global_step > 0``): continue the stream from the checkpoint's state."""
        if state.global_step == 0:
            self.stream.rewind()
            return
        by_name: Any = state.stateful_callbacks  # a dict by name once built (typed as a list)
        saved = by_name.get(type(self).__name__)
        if not isinstance(saved, dict) or "overlord_state" not in saved.get("attributes", {}):
            raise CheckpointError(
                f"the checkpoint of step {state.global_step} holds no overlord state "
                f"(trainer_state.json has no stateful_callbacks['{type(self).__name__}']): "
                "it was not written by a Trainer with hf_trainer_recipe's callback. Resume "
                "from a checkpoint that was, or load the stream's state yourself."
            )
        self.stream.load(saved["attributes"]["overlord_state"])
        self._random = saved["attributes"].get("random_state")  # older checkpoints: none

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The first step after a resume: the generators as they were when it was saved."""
        if self._random is not None:
            set_random_state(self._random)
            self._random = None

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A micro-batch (not the last of an accumulation) was trained."""
        self.stream.trained()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The last micro-batch of an optimizer step was trained."""
        self.stream.trained()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The stream continues after the last batch trained, not after the one read ahead."""
        self.stream.rewind()


def hf_trainer_recipe(dataset: OverlordIterableDataset) -> dict[str, Any]:
    """``train_dataset``, ``data_collator`` and ``callbacks`` for ``transformers.Trainer``.

    Use with ``TrainingArguments(..., **TRAINING_ARGS)`` and a ``max_steps``
    (the stream has no length). See the module docstring for how it resumes.
    """
    stream = HFStream(dataset)
    return {
        "train_dataset": stream,
        "data_collator": hf_collate,
        "callbacks": [OverlordTrainerCallback(stream)],
    }
