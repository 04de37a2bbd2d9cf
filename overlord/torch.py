"""PyTorch adapter: batches as tensors, and an ``IterableDataset`` of one DP rank's batches.

Needs PyTorch (``pip install 'overlord-data[torch]'``); the rest of overlord does not import it.

Tensors (:func:`to_torch`): ``position_ids``, ``segment_ids`` and ``cu_seqlens``
stay int32 and share the batch's memory (``torch.from_numpy``, no copy; varlen
attention kernels take int32 ``cu_seqlens``). ``input_ids`` and ``labels`` become
int64, a copy, because ``cross_entropy`` wants long targets and most model code
indexes embeddings with long ids. Batches that come from the Ray runtime live in
Ray's object store, which is read-only: do not write into the shared int32
tensors in place.

Dataset (:class:`OverlordIterableDataset`)::

    ds = OverlordIterableDataset.from_job("my-job", rank=dp_rank)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    for batch in loader:  # {"input_ids": ..., "labels": ..., ...}
        ...

overlord already builds batches outside the trainer, so ``num_workers`` stays 0
(anything else is refused) and ``batch_size=None`` (a batch is one step of one
rank). Iterating again continues the stream where it stopped: it is a stream of
steps, not an epoch.

State: ``state_dict()`` is ``{"overlord": "<JSON of the job's state>"}``, the state
of what this rank received (never of what was built ahead), as of this rank's
position. A single string leaf has the same shape at every step and on every
plan, which is what ``torch.distributed.checkpoint`` needs (it loads in place
into the structure ``state_dict()`` returns on the fresh object, and saves a
string as a plain object, no pickle of overlord data). The state is the same on
every DP rank at a synchronous checkpoint and does not depend on the DP size, so
one key serves every rank and an elastic resume. torchdata's
``StatefulDataLoader`` calls the dataset's ``state_dict()`` from its own and, on
resume, ``load_state_dict()`` before it calls ``iter()`` on the dataset again,
which is the order this class expects. ``load_state_dict`` also takes the plain
state dict that :func:`overlord.state.checkpoint.load` returns.

HuggingFace (:func:`hf_inputs`, :func:`hf_collate`): the inputs a ``transformers``
causal LM takes, with labels unshifted for the model's own shift. The
``transformers.Trainer`` recipe (which needs ``transformers``) is in :mod:`overlord.hf`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from overlord.batch import Batch
from overlord.batch.rows import IGNORE_INDEX
from overlord.dist.broadcast import broadcast_batch as broadcast_batch  # for mesh groups over nodes
from overlord.errors import CheckpointError, LoaderError
from overlord.loader import Loader
from overlord.plan.spec import Plan
from overlord.streams import RankStream, open_stream

STATE_KEY = "overlord"
LONG_KEYS = frozenset({"input_ids", "labels"})  # int64 (a copy); the other arrays stay int32


def _share(array: Any) -> torch.Tensor:
    if array.flags.writeable:
        return torch.from_numpy(array)
    # Ray's object store hands out read-only arrays; sharing them is the point (the
    # module docstring says not to write into them), so torch's warning is noise here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def to_torch(
    batch: Batch, pin_memory: bool = False, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """The batch's arrays as tensors, by name (see the module docstring for dtypes).

    ``pin_memory`` pins the host tensors for fast, asynchronous copies to a GPU; it
    is ignored, without a warning, where CUDA is not available, so that one script
    runs on CPU-only machines too. ``device`` moves every tensor there
    (``non_blocking`` when pinned).
    """
    pin = pin_memory and torch.cuda.is_available()
    out: dict[str, torch.Tensor] = {}
    for name, array in batch.arrays().items():
        if name in LONG_KEYS:
            # one copy into (pinned) int64 memory, by numpy: torch's copy_ took longer on the
            # trainer's thread (its wait in next() went from 1.3-1.6 ms to 1.0-1.1 ms, 32K
            # tokens a step, 2 cores); most of what is left is the new pages' first touch
            if pin:
                t = torch.empty(array.shape, dtype=torch.int64, pin_memory=True)
                np.copyto(t.numpy(), array, casting="safe")
            else:
                t = torch.from_numpy(array.astype(np.int64))
        else:
            t = _share(array)
            if pin:
                t = t.pin_memory()
        if device is not None:
            t = t.to(device, non_blocking=pin)
        out[name] = t
    for name in ("pixel_values", "image_grid"):  # a plan with images
        array = getattr(batch, name)
        if array is not None:
            t = _share(array)
            out[name] = t.to(device, non_blocking=pin) if device is not None else t
    return out


def hf_inputs(batch: Batch | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` and ``position_ids`` as a ``transformers`` causal LM takes them.

    ``batch`` is a :class:`~overlord.Batch` or the dict :func:`to_torch` returns.
    overlord's ``labels`` are already shifted (``labels[t]`` is the token after
    ``t``); a HuggingFace causal LM shifts its ``labels`` itself (``logits[t]``
    against ``labels[t + 1]``). So the labels here are overlord's moved one
    position right: ``-100`` at each row's first position, and wherever the token
    before is a document's last token or padding, so that the model's shift never
    crosses a document. ``model(**hf_inputs(batch), use_cache=False).loss`` is the
    cross-entropy of the model's logits against overlord's ``labels``. All three
    are int64, on the batch's device.

    Attention across the documents of a packed row: pass ``use_cache=False`` (the
    collator :func:`hf_collate` does) and no ``attention_mask``. Models whose mask
    comes from ``transformers.masking_utils`` (GPT-2, Llama, Qwen, ... in
    transformers 5) then read the documents off ``position_ids`` (a new document
    wherever the position does not go up by one) and mask attention between them;
    FlashAttention-2 (``attn_implementation="flash_attention_2"``) does the same
    with varlen kernels. With a cache (``use_cache`` left to the config's
    ``True``), or in a model that builds its own mask, every token attends to the
    earlier documents of its row, without a warning. The loss is what the logits
    make of overlord's labels either way.

    >>> import numpy as np
    >>> from overlord.batch.rows import pack
    >>> b = pack(np.array([1, 2, 3, 4, 5]), np.array([2, 3]), np.array([0, 0]), 1, 6, 0)
    >>> b["labels"].tolist(), hf_inputs(b)["labels"].tolist()
    ([[2, -100, 4, 5, -100, -100]], [[-100, 2, -100, 4, 5, -100]])
    """
    arrays = batch.arrays() if isinstance(batch, Batch) else batch
    input_ids, labels, position_ids = (
        torch.as_tensor(arrays[k]).long() for k in ("input_ids", "labels", "position_ids")
    )
    if labels.ndim != 2 or labels.shape != input_ids.shape:
        raise ValueError(
            f"expected labels of the shape of input_ids, (rows, seq_len) = "
            f"{tuple(input_ids.shape)}, found {tuple(labels.shape)}"
        )
    if (labels[:, -1] != IGNORE_INDEX).any():
        # overlord never labels a row's last token (packing ends a document there or
        # pads); a label there has no position to move to, and would be lost silently
        raise ValueError(
            "labels at a row's last position must be -100 (found a token): after the "
            "model's shift they would be dropped. These are not overlord's packed labels."
        )
    hf_labels = torch.full_like(labels, IGNORE_INDEX)
    hf_labels[:, 1:] = labels[:, :-1]
    return {"input_ids": input_ids, "labels": hf_labels, "position_ids": position_ids}


def hf_collate(features: Sequence[Batch | Mapping[str, Any]]) -> dict[str, Any]:
    """A ``data_collator`` for ``transformers.Trainer``: one overlord batch -> :func:`hf_inputs`.

    An overlord batch is a whole step already, so the Trainer's DataLoader must
    hand over one at a time (``per_device_train_batch_size=1``); ``features`` is
    that one-element list. Adds ``use_cache=False`` so that the model masks
    attention between packed documents (see :func:`hf_inputs`).
    """
    if len(features) != 1:
        raise ValueError(
            f"hf_collate got {len(features)} overlord batches, expected 1: each is a whole "
            "step of packed rows already. Set per_device_train_batch_size=1 (see "
            "overlord.hf.TRAINING_ARGS)."
        )
    return {**hf_inputs(features[0]), "use_cache": False}


def decode_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The overlord state inside ``state_dict``: ``{"overlord": JSON}`` or the plain state."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"expected a mapping {{'{STATE_KEY}': <JSON string>}}, found "
            f"{type(state_dict).__name__}"
        )
    if STATE_KEY not in state_dict:
        if "version" in state_dict and "sources" in state_dict:
            return dict(state_dict)  # what overlord.state.checkpoint.load returns
        raise CheckpointError(
            f"expected {{'{STATE_KEY}': <JSON string>}} (what state_dict() returns) or an "
            f"overlord checkpoint, found keys {sorted(map(str, state_dict))}"
        )
    blob = state_dict[STATE_KEY]
    if not isinstance(blob, (str, bytes)):
        raise CheckpointError(
            f"state_dict['{STATE_KEY}'] must be a JSON string, found {type(blob).__name__}"
        )
    try:
        state = json.loads(blob)  # bytes too: UTF-8
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointError(f"state_dict['{STATE_KEY}'] is not valid JSON: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"state_dict['{STATE_KEY}'] must hold a JSON object")
    return state


def encode_state(state: dict[str, Any]) -> dict[str, Any]:
    """``{"overlord": JSON}``: the form :meth:`OverlordIterableDataset.state_dict` returns."""
    return {STATE_KEY: json.dumps(state, sort_keys=True, separators=(",", ":"))}


class OverlordIterableDataset(IterableDataset[dict[str, torch.Tensor]]):
    """One DP rank's batches as :func:`to_torch` dicts; build it with a ``from_*`` method.

    Use it in ``DataLoader(ds, batch_size=None, num_workers=0)``, or iterate it
    directly. See the module docstring for the state it saves.
    """

    def __init__(
        self, stream: RankStream, pin_memory: bool = False, device: torch.device | str | None = None
    ):
        super().__init__()
        self._stream = stream
        self.pin_memory = pin_memory
        self.device = device

    @classmethod
    def from_plan(
        cls,
        plan: Plan | str | Path,
        rank: int | None = None,
        state: Mapping[str, Any] | None = None,
        stop_step: int | None = None,
        pin_memory: bool = False,
        device: torch.device | str | None = None,
        runtime: str | None = None,
    ) -> OverlordIterableDataset:
        """Batches of ``rank`` from an embedded Loader (:func:`overlord.streams.open_stream`).

        Under ``torchrun`` on one node (``WORLD_SIZE`` > 1 and a world of
        more than one process) the node's roles run in one data process that
        rank 0 starts, and every rank takes its batches from shared memory
        (:mod:`overlord.dist.data_process`; with ``runtime="inline"`` rank 0
        runs the only Loader and sends every other rank its batches over a
        gloo group, :mod:`overlord.dist.node`): each source is read once per
        node, no Ray needed, and the rank is this process's
        ``torch.distributed`` rank (its global rank in a mesh: its CP slice,
        its stage's fields); ``rank``, if given, must be it. Otherwise the
        Loader is this process's own and ``rank`` a DP rank (default 0): for a
        world of one process, and for tests (it serves every DP rank in one
        process, which must then consume every rank's batch of a step before it
        runs ahead; one rank alone stops with an error after a few steps when
        dp > 1). Several nodes: serve the plan (``overlord serve``) and use
        :meth:`from_job`. The Loader starts on first use; ``state`` (or
        :meth:`load_state_dict` before that) resumes the stream exactly.
        ``runtime="process"`` runs the roles in a data process beside this one
        (under torchrun, one for the node, the default there) and takes
        batches from shared memory (:mod:`overlord.dist.data_process`).
        """
        start = decode_state(state) if state is not None else None
        stream = open_stream(
            plan, rank, state=start, stop_step=stop_step, loader=Loader, runtime=runtime
        )
        return cls(stream, pin_memory, device)

    @classmethod
    def from_job(
        cls,
        job: str,
        rank: int | None = None,
        address: str | None = None,
        stop_step: int | None = None,
        pin_memory: bool = False,
        device: torch.device | str | None = None,
        *,
        global_rank: int | None = None,
    ) -> OverlordIterableDataset:
        """Batches of DP rank ``rank`` of the running job ``job`` (:func:`overlord.connect`).

        In a device mesh (``cp``, ``tp`` or ``pp`` above 1) pass ``global_rank``
        (the process's ``RANK``) instead: its CP slice and pipeline stage's fields.
        The job holds the stream's state: it resumes when it is started from a
        checkpoint, and :meth:`load_state_dict` only checks that it did.
        """
        stream = open_stream(
            job=job, rank=rank, address=address, stop_step=stop_step, global_rank=global_rank
        )
        return cls(stream, pin_memory, device)

    @property
    def step(self) -> int:
        """The step of the next batch this rank will receive."""
        return self._stream.step

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The batches from the current position on, until the stream's ``stop_step``."""
        info = get_worker_info()
        if info is not None:
            raise LoaderError(
                f"OverlordIterableDataset is being iterated in DataLoader worker {info.id} of "
                f"{info.num_workers}: expected num_workers=0, because overlord builds batches "
                "outside the trainer already and every worker would receive the same rank's "
                "stream. Use DataLoader(ds, batch_size=None, num_workers=0)."
            )
        return self._batches()

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            try:
                batch = next(self._stream)
            except StopIteration:
                return
            yield to_torch(batch, self.pin_memory, self.device)

    def report(
        self, step: int, seconds: float, loss_by_source: Mapping[str, float] | None = None
    ) -> None:
        """Tell the planner this rank trained ``step`` in ``seconds`` (its own compute time).

        ``loss_by_source``: optionally the mean loss per source (the batch's
        ``source`` names). One way, off the trainer's thread; see
        :meth:`overlord.roles.client.Client.report`.
        """
        losses = None if loss_by_source is None else dict(loss_by_source)
        self._stream.report(step, seconds, losses)

    def overlord_state(self) -> dict[str, Any]:
        """The plain overlord state (for :func:`overlord.checkpoint.save`, ``serve --resume``)."""
        return self._stream.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """``{"overlord": JSON}``: the stream's state as of this rank's position."""
        return encode_state(self._stream.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s output (or an overlord checkpoint dict).

        From a plan: the Loader restarts from that state, so iteration continues
        exactly there. From a job: raises :class:`~overlord.CheckpointError`
        unless the job is at that state's step (the job is resumed when it starts).
        """
        self._stream.load_state_dict(decode_state(state_dict))

    def close(self) -> None:
        """Stop the embedded Loader, if any (a served job keeps running).

        A dataset from a plan remembers its position: used again, it starts a
        new Loader from there.
        """
        self._stream.close()

    def __enter__(self) -> OverlordIterableDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        # DataLoader workers started by spawn or forkserver receive the dataset pickled
        raise TypeError(
            "OverlordIterableDataset cannot be sent to another process (DataLoader with "
            "num_workers>0, or pickle): overlord builds batches outside the trainer already. "
            "Use DataLoader(ds, batch_size=None, num_workers=0), or create one dataset per "
            "trainer process with from_job()."
        )
