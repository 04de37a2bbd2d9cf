"""Shared-memory slots: the buffers a data process writes batches into, and trainers map.

The data process owns a :class:`SlotPool`: named POSIX shared-memory segments
(``multiprocessing.shared_memory``), each a *slot* that holds one batch's
arrays at a time. A slot is reused once every trainer that received it has
let go of it, and a new one is made only while none is free and large
enough, so the pool settles at the few slots in flight (the steps built
ahead, the one each trainer holds) and memory stays bounded by what is ahead
plus what trainers keep.

A batch is packed straight into a slot where it can be: the data process's packs
take their output block from the pool (:meth:`SlotPool.pack_block`), and
:meth:`SlotPool.place` lays the batch out where it lies, its other arrays
written after the block; a batch made otherwise is copied into a free slot.

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

    def write(self, arrays: dict[str, np.ndarray], offset: int = 0) -> Layout:
        """Copy ``arrays`` into the slot from byte ``offset``; their layout (:class:`SlotViews`)."""
        assert self._bytes is not None, "a closed slot"
        layout: Layout = []
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            end = offset + a.nbytes
            target = self._bytes[offset:end].view(a.dtype).reshape(a.shape)
            np.copyto(target, a)
            layout.append([name, a.dtype.str, list(a.shape), offset])
            offset += -(-a.nbytes // ALIGN) * ALIGN
        return layout

    def buffer(self) -> memoryview:
        """The segment's memory."""
        buf = self._shm.buf
        assert buf is not None, "a closed slot"
        return buf

    def close(self) -> None:
        """Unlink the segment, and unmap it once no view of it is left here.

        Views elsewhere stay valid until they are unmapped; views here (a batch packed
        into the slot, still referenced) keep the mapping until they go.
        """
        self._bytes = None
        try:
            self._shm.close()
        except BufferError:  # views of it live on: they hold the mapping, which goes with them
            # (the standard library's finalizer would try again, and fail, under them)
            self._shm._buf = self._shm._mmap = None  # type: ignore[attr-defined]
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
        # slots packed into (:meth:`pack_block`): slot index -> its int32 buffer, and the
        # bytes of its last block; the id of each buffer -> its slot
        self._packed: dict[int, np.ndarray] = {}
        self._block_bytes: dict[int, int] = {}
        self._address: dict[int, int] = {}  # where each one's buffer starts
        self._of_buffer: dict[int, int] = {}
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
        return self._new_slot(nbytes)

    def pack_block(self, shape: tuple[int, ...]) -> np.ndarray:
        """An int32 block of ``shape`` in a slot, for a pack to write a batch straight into.

        The batch's arrays are then views of the slot: :meth:`place` finds them there,
        and the batch reaches trainers without a copy. A slot packed into is used again
        once no trainer holds it and nothing in this process references its buffer (its
        reference count, as :class:`overlord.blocks.KeptBlocks` counts); the room after
        the block takes the batch's other arrays. A closed pool gives a block of the heap.
        """
        size = 4 * math.prod(shape)
        if self.closed:
            return np.empty(shape, dtype=np.int32)
        best = None
        for index in self._packed:
            room = self.slots[index].size
            # referenced by the dict and getrefcount's argument only: no view of it is left
            free = index not in self._holders and sys.getrefcount(self._packed[index]) == 2
            if free and room >= size + _tail(size) and (best is None or room < best[1]):
                best = (index, room)
        if best is None:
            slot = self._new_slot(size + _tail(size))
            # its base is the segment's buffer, not an array: every view of it has it as base
            flat = np.frombuffer(slot.buffer(), dtype=np.int32)
            self._packed[slot.index] = flat
            self._address[slot.index] = flat.ctypes.data
            self._of_buffer[id(flat)] = slot.index
            index = slot.index
        else:
            index = best[0]
        self._block_bytes[index] = size
        return self._packed[index][: size // 4].reshape(shape)

    def place(
        self, arrays: dict[str, np.ndarray], tails: dict[int, int]
    ) -> tuple[Slot, Layout] | None:
        """The slot a pack wrote ``arrays`` into (:meth:`pack_block`), and their layout there.

        The arrays that lie in it (C-contiguous views of its block) are not copied; the
        others are written after its block, from ``tails[index]`` (where the step's
        batches of that slot have written so far: several ranks' batches can be views of
        one block). None: they lie in no such slot, or the rest does not fit after it.
        """
        first = next(iter(arrays.values()), None)
        index = None if first is None else self._of_buffer.get(id(first.base))
        if index is None or index not in self._packed:
            return None
        slot, flat, at = self.slots[index], self._packed[index], self._address[index]
        layout: Layout = []
        rest = {}
        for name, a in arrays.items():
            if a.base is flat and a.flags.c_contiguous:
                layout.append([name, a.dtype.str, list(a.shape), a.ctypes.data - at])
            else:
                rest[name] = a
        start = tails.get(index, -(-self._block_bytes[index] // ALIGN) * ALIGN)
        if start + needed(rest) > slot.size:
            return None
        tails[index] = start + needed(rest)
        return slot, layout + slot.write(rest, start)

    def _new_slot(self, nbytes: int) -> Slot:
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
        # a slot packed into is not free for a copy: its block may still be referenced here
        if 0 <= index < len(self.slots) and index not in self._free and index not in self._packed:
            self._free.append(index)

    @property
    def nbytes(self) -> int:
        """Bytes of every slot made."""
        return sum(s.size for s in self.slots)

    def close(self) -> None:
        """Unlink every slot; no slot is made after this."""
        self.closed = True
        self._packed.clear()
        self._of_buffer.clear()
        for slot in self.slots:
            slot.close()
        self.slots, self._free = [], []


def _tail(block_bytes: int) -> int:
    """Room a slot packed into keeps after its block, for the batch's other arrays."""
    return max(64 << 10, block_bytes // 8)


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
