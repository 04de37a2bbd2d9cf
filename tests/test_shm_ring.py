"""Slots packed into: a batch written straight into shared memory, sent as it lies.

A data process's pack takes its output block from a slot (``SlotPool.pack_block``);
``place`` then finds the batch's arrays there and lays them out without a copy, the other
arrays written after the block. A slot is packed into again only once no trainer holds it
and nothing in the process references its block.
"""

from __future__ import annotations

import numpy as np

from overlord.runtime.shm_ring import SlotPool, SlotViews


def _batch(block: np.ndarray, rows: slice) -> dict[str, np.ndarray]:
    return {
        "input_ids": block[0][rows],
        "labels": block[1][rows],
        "cu_seqlens": np.array([0, 3, 8], dtype=np.int32),  # not in the block: written after it
    }


def test_a_packed_batch_is_laid_out_where_it_lies_and_read_back_by_a_trainer() -> None:
    pool = SlotPool("test-packed")
    try:
        block = pool.pack_block((4, 6, 8))
        block[:] = np.arange(block.size, dtype=np.int32).reshape(block.shape)
        tails: dict[int, int] = {}
        first, second = _batch(block, slice(0, 3)), _batch(block, slice(3, 6))  # two ranks
        placed = [pool.place(b, tails) for b in (first, second)]
        assert placed[0] is not None and placed[1] is not None
        (slot, layout), (slot2, layout2) = placed[0], placed[1]
        assert slot is slot2  # both ranks' rows are views of one block: one slot
        offsets = {name: offset for name, _, _, offset in layout}
        assert offsets["input_ids"] == 0 and offsets["labels"] == 6 * 8 * 4  # where they lie
        assert offsets["cu_seqlens"] >= 4 * 6 * 8 * 4  # after the block
        assert {n: o for n, _, _, o in layout2}["cu_seqlens"] > offsets["cu_seqlens"]
        views = SlotViews()
        for batch, lay in ((first, layout), (second, layout2)):
            got, _ = views.arrays(slot.name, slot.size, lay)
            for name, want in batch.items():
                assert np.array_equal(got[name], want), name
        copied = {"input_ids": block[0].copy()}  # not a view of a slot: the copy path's
        assert pool.place(copied, tails) is None
    finally:
        pool.close()


def test_a_slot_is_packed_into_again_only_when_nobody_holds_or_references_it() -> None:
    pool = SlotPool("test-reuse")
    try:
        block = pool.pack_block((4, 2, 8))
        slot, _ = pool.place(_batch(block, slice(0, 2)), {}) or (None, None)
        assert slot is not None
        pool.hold(slot, 1)  # sent to one trainer
        other = pool.pack_block((4, 2, 8))
        apart = not np.shares_memory(other, block)
        assert apart  # referenced here and held: a new slot
        del block
        third = pool.pack_block((4, 2, 8))
        apart = not np.shares_memory(third, other)
        assert apart  # still held by its trainer
        pool.release(slot.index)  # the trainer let go of it
        fourth = pool.pack_block((4, 2, 8))
        index = {pool.place({"x": fourth[0]}, {})[0].index}  # type: ignore[index]
        assert index == {slot.index}  # free of both: packed into again
        assert slot.index not in pool._free  # and never handed to the copy path
    finally:
        pool.close()


def test_a_closed_pool_packs_into_the_heap() -> None:
    pool = SlotPool("test-closed")
    pool.close()
    block = pool.pack_block((4, 2, 8))
    assert block.shape == (4, 2, 8) and pool.place({"x": block[0]}, {}) is None
