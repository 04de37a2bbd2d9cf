"""A step's tokens placed from the loaders' answers: the compiled loop and numpy's way agree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord.batch import gather as gather_mod
from overlord.errors import LoaderError


def _answers(lengths: np.ndarray, loaders: int, seed: int, masked: bool):
    """The step's items dealt to ``loaders`` loaders, each answering in an order of its own."""
    rng = np.random.default_rng(seed)
    starts = np.concatenate(([0], np.cumsum(lengths)))
    tokens = rng.integers(0, 50_000, int(starts[-1])).astype(np.int32)
    mask = rng.integers(0, 2, len(tokens)).astype(np.uint8)
    owner = rng.integers(0, loaders, len(lengths))
    answers = []
    for k in range(loaders):
        mine = np.flatnonzero(owner == k)
        if rng.random() < 0.5:
            mine = rng.permutation(mine)
        if not len(mine):
            continue
        got = {
            "tokens": np.concatenate([tokens[starts[j] : starts[j + 1]] for j in mine]),
            "lengths": lengths[mine].astype(np.int32),
        }
        if masked:
            got["mask"] = np.concatenate([mask[starts[j] : starts[j + 1]] for j in mine])
        answers.append((mine.astype(np.int64), got))
    return tokens, mask, answers


def _gather_numpy(answers, lengths):
    """:func:`gather` as it runs where numba does not import."""
    saved = gather_mod._kernel
    gather_mod._kernel = lambda: None
    try:
        return gather_mod.gather(answers, lengths)
    finally:
        gather_mod._kernel = saved


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), max_size=40),
    loaders=st.integers(1, 6),
    masked=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_both_ways_place_every_item_where_the_plan_has_it(lengths, loaders, masked, seed):
    """The compiled loop (where numba imports) and numpy's way give the plan's tokens and mask."""
    lengths = np.array(lengths, dtype=np.int64)
    tokens, mask, answers = _answers(lengths, loaders, seed, masked)
    for placed, placed_mask, kept in (
        gather_mod.gather(answers, lengths),
        _gather_numpy(answers, lengths),
    ):
        assert placed.dtype == np.int32 and placed.tolist() == tokens.tolist()
        if masked and answers:
            assert placed_mask is not None and placed_mask.tolist() == mask.tolist()
        else:
            assert placed_mask is None
        assert [m.tolist() for m, _ in kept] == [m.tolist() for m, _ in answers]


@pytest.mark.parametrize("compiled", [True, False])
def test_an_answer_that_is_not_the_plans_items_is_refused(compiled, monkeypatch):
    if compiled:
        pytest.importorskip("numba")
    else:
        monkeypatch.setattr(gather_mod, "_kernel", lambda: None)
    lengths = np.array([1, 2], dtype=np.int64)
    wrong_length = {"tokens": np.array([7, 8], np.int32), "lengths": np.array([2], np.int32)}
    with pytest.raises(LoaderError, match="item 0 of the step with 2 tokens where the plan has 1"):
        gather_mod.gather([(np.array([0]), wrong_length)], lengths)
    short = {"tokens": np.array([7, 8], np.int32), "lengths": np.array([1, 2], np.int32)}
    with pytest.raises(LoaderError, match="2 tokens where its lengths count 3"):
        gather_mod.gather([(np.array([0, 1]), short)], lengths)
    with pytest.raises(LoaderError, match="for item 2, which the step's 2 items do not have"):
        gather_mod.gather([(np.array([2]), wrong_length)], lengths)


def test_one_answer_of_every_item_in_the_plans_order_is_the_steps_tokens_as_they_are():
    lengths = np.array([2, 0, 3], dtype=np.int64)
    got = {"tokens": np.arange(5, dtype=np.int32), "lengths": lengths.astype(np.int32)}
    placed, mask, _ = gather_mod.gather([(np.arange(3), got)], lengths)
    assert placed is got["tokens"] and mask is None
    # out of the plan's order, or with more tokens than its items: placed item by item
    for mine, tokens in ((np.array([0, 2, 1]), np.arange(5)), (np.arange(3), np.arange(6))):
        other = {"tokens": tokens.astype(np.int32), "lengths": lengths[mine].astype(np.int32)}
        placed, _, _ = gather_mod.gather([(mine, other)], lengths)
        assert placed is not other["tokens"] and placed.tolist() == [0, 1, 2, 3, 4]
