"""Shared-memory slots: the buffers a data process writes batches into, and trainers map.

The data process owns a :class:`SlotPool`: named POSIX shared-memory segments
(``multiprocessing.shared_memory``), each a *slot* that holds one batch's
arrays at a time. A slot is reused once every trainer that received it has
let go of it, and a new one is made only while none is free and large
enough, so the pool settles at the few slots in flight (the steps built
ahead, the one each trainer holds) and memory stays bounded by what is ahead
plus what trainers keep.

A trainer holds a :class:`SlotViews`: it maps a slot by name once (the
segment stays mapped while a batch of it lives) and hands out numpy views on
it, without a copy. Each delivery gets an *owner* array that every view of
it references; when the last view is gone (the trainer dropped the batch,
its tensors included), the owner's finalizer records the slot as free, and
the trainer tells the data process with its next message. So a slot is never
written while a trainer still reads it, and a trainer that keeps batches
keeps their memory, as a copy would.

Arrays in a slot are described by a *layout*: ``[name, dtype, shape,
offset]`` per array, JSON-able, so that what crosses the process boundary is
plain data (nothing pickled).

>>> pool = SlotPool("doctest")
>>> slot = pool.acquire(needed({"a": np.arange(6, dtype=np.int32).reshape(2, 3)}))
>>> layout = slot.write({"a": np.arange(6, dtype=np.int32).reshape(2, 3)})
>>> views = SlotViews()
>>> got, owner = views.arrays(slot.name, slot.size, layout)
>>> got["a"].tolist()
[[0, 1, 2], [3, 4, 5]]
>>> pool.close()
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import sys
import threading
import uuid
from collections import deque
from multiprocessing import shared_memory
from typing import Any

import numpy as np

ALIGN = 64  # every array starts on a cache line
GRAIN = 1 << 20  # slots are made in whole MiB, so that a slightly larger batch still fits
Layout = list[list[Any]]  # [name, dtype, shape, offset] per array


def needed(arrays: dict[str, np.ndarray]) -> int:
    """Bytes a slot needs for ``arrays`` (each aligned to :data:`ALIGN`)."""
    return sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays.values())


class Slot:
    """One shared-memory segment of the pool, written by the data process."""

    def __init__(self, index: int, name: str, size: int):
        self.index = index
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.name = self._shm.name  # without the leading '/' that POSIX adds
        self.size = size
        buf = self._shm.buf
        assert buf is not None
        self._bytes: np.ndarray | None = np.frombuffer(buf, dtype=np.uint8)

    def write(self, arrays: dict[str, np.ndarray]) -> Layout:
        """Copy ``arrays`` into the slot; their layout, for :meth:`SlotViews.arrays`."""
        assert self._bytes is not None, "a closed slot"
        layout: Layout = []
        offset = 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            end = offset + a.nbytes
            target = self._bytes[offset:end].view(a.dtype).reshape(a.shape)
            np.copyto(target, a)
            layout.append([name, a.dtype.str, list(a.shape), offset])
            offset += -(-a.nbytes // ALIGN) * ALIGN
        return layout

    def close(self) -> None:
        """Unmap and unlink the segment (mapped views elsewhere stay valid until unmapped)."""
        self._bytes = None
        with contextlib.suppress(BufferError):  # a view of ours alive: it goes with the process
            self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()


class SlotPool:
    """The data process's slots: acquire one for a batch, release it when every holder let go.

    ``prefix`` names the segments (``overlord-PREFIX-...``), so that a leak is
    recognizable in ``/dev/shm``. Not thread-safe by itself: the data process
    calls it under its own lock.
    """

    def __init__(self, prefix: str):
        self.prefix = f"overlord-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.slots: list[Slot] = []
        self._free: list[int] = []
        self._holders: dict[int, int] = {}  # slot index -> trainers that still hold it
        self.closed = False

    def acquire(self, nbytes: int) -> Slot:
        """A free slot of at least ``nbytes`` (the smallest that fits), or a new one."""
        if self.closed:
            raise RuntimeError("the slot pool is closed: the data process is ending")
        fits = [i for i in self._free if self.slots[i].size >= nbytes]
        if fits:
            i = min(fits, key=lambda i: self.slots[i].size)
            self._free.remove(i)
            return self.slots[i]
        size = max(GRAIN, -(-nbytes // GRAIN) * GRAIN)
        slot = Slot(len(self.slots), f"{self.prefix}-{len(self.slots)}", size)
        self.slots.append(slot)
        return slot

    def hold(self, slot: Slot, holders: int) -> None:
        """``slot`` was sent to ``holders`` trainers: free once each released it."""
        self._holders[slot.index] = holders
        if holders == 0:
            self.release(slot.index)

    def release(self, index: int) -> None:
        """One holder of slot ``index`` let go of it; the last one frees it."""
        left = self._holders.get(index, 0) - 1
        if left > 0:
            self._holders[index] = left
            return
        self._holders.pop(index, None)
        if 0 <= index < len(self.slots) and index not in self._free:
            self._free.append(index)

    @property
    def nbytes(self) -> int:
        """Bytes of every slot made."""
        return sum(s.size for s in self.slots)

    def close(self) -> None:
        """Unlink every slot; no slot is made after this."""
        self.closed = True
        for slot in self.slots:
            slot.close()
        self.slots, self._free = [], []


class SlotViews:
    """A trainer's side: slots mapped by name, numpy views on them, releases recorded.

    :meth:`arrays` gives a delivery's arrays and their owner; once nothing
    references the owner any more (every view and tensor of it gone), its
    slot index is queued, and :meth:`released` hands the queue over (for the
    trainer's next message). Mapping is read-write and shared: views of one
    slot given to several trainers (tensor-parallel peers) are the same
    memory, so a write into one is seen by all.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._released: deque[int] = deque()
        self._lock = threading.Lock()

    def _map(self, name: str, size: int) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is None:
            if len(self._maps) > 64:  # slots the data process replaced; live views keep theirs
                self._maps.clear()
            mm = self._maps[name] = _open(name, size)
        return mm

    def arrays(
        self, name: str, size: int, layout: Layout, index: int | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Views on slot ``name`` by ``layout``, and their owner (``index`` queued when it goes)."""
        owner = np.frombuffer(self._map(name, size), dtype=np.uint8, count=size)
        got: dict[str, np.ndarray] = {}
        for field, dtype, shape, offset in layout:
            dt = np.dtype(dtype)
            count = math.prod(shape) * dt.itemsize  # numpy's prod costs 20x more on a short list
            got[field] = owner[offset : offset + count].view(dt).reshape(shape)
        if index is not None:
            _finalize(owner, self._released, index)
        return got, owner

    def released(self) -> list[int]:
        """The slot indices let go of since the last call."""
        out = []
        with self._lock:
            while self._released:
                out.append(self._released.popleft())
        return out


def _finalize(owner: np.ndarray, queue: deque[int], index: int) -> None:
    import weakref

    # deque.append is atomic: the finalizer may run on any thread that drops the last view
    weakref.finalize(owner, queue.append, index)


def _open(name: str, size: int) -> mmap.mmap:
    """Map the segment ``name`` without registering it with a resource tracker.

    On Linux the segment is a file of ``/dev/shm``; opening it directly keeps
    the trainer from starting Python's resource tracker, which would unlink
    the data process's segments when the trainer exits.
    """
    path = f"/dev/shm/{name}"
    if sys.platform.startswith("linux") and os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)
    shm = shared_memory.SharedMemory(name=name)  # elsewhere: the standard library's way
    from multiprocessing import resource_tracker

    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm._mmap  # type: ignore[attr-defined]
