"""A step's planned items' tokens back to back, in the plan's order, from the loaders' answers.

Each loader answers a take with its items' tokens back to back (and their
lengths) in the order it was asked; the step's items of one loader are
scattered over the plan's order, among the other sources' items. Where numba
imports (the ``fast`` extra), one compiled loop per answer copies each item
to its place by a slice; without numba, numpy copies each run of items that
lie next to each other in the plan's order. The tokens are the same.

With many sources an answer holds a few items, so what a copy costs is the
calls around it: the compiled loop is one call per answer where numpy's way
is about ten.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from overlord.batch.rows import scratch
from overlord.errors import LoaderError
from overlord.plan.compiled import compiled_once


def _place(
    out: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    mine: np.ndarray,
    got_lengths: np.ndarray,
    got: np.ndarray,
) -> int:
    """Copy answered item ``k`` (``got_lengths[k]`` of ``got``) to ``out[starts[mine[k]]:]``.

    -1, or the first ``k`` that is not an item of the plan, whose length is not the plan's,
    or whose tokens the answer lacks (nothing after it is copied).
    """
    g = 0
    for k in range(len(mine)):
        j = mine[k]
        if j < 0 or j >= len(lengths):  # compiled indexing checks no bounds: this does
            return k
        n = got_lengths[k]
        if n != lengths[j] or g + n > len(got):
            return k
        at = starts[j]
        out[at : at + n] = got[g : g + n]
        g += n
    return -1


_kernel = compiled_once(_place)


def gather(
    answers: Iterable[tuple[np.ndarray, dict[str, np.ndarray]]], lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None, list[tuple[np.ndarray, dict[str, np.ndarray]]]]:
    """The tokens of items ``lengths`` (int64, the plan's order), placed from ``answers``.

    ``answers`` are ``(mine, got)``: the plan's indexes of a loader's items, in
    the order asked, and its answer (``tokens`` int32 back to back,
    ``lengths``, and a chat source's ``mask``). Returns the tokens, their loss
    mask (uint8, 1: a label to keep; None when no answer had one, so that a
    text plan allocates none: the other sources' tokens are all kept) and the
    answers as a list, for what else the caller reads of them (images). An answer
    that holds every item, in the plan's order, gives its tokens as they are
    (read-only, perhaps): the caller reads them once, to pack the rows.

    >>> tokens, mask, _ = gather(
    ...     [(np.array([2, 0]), {"tokens": np.array([7, 8, 9], np.int32),
    ...                          "lengths": np.array([1, 2], np.int32)}),
    ...      (np.array([1]), {"tokens": np.array([5], np.int32),
    ...                       "lengths": np.array([1], np.int32)})],
    ...     np.array([2, 1, 1]))
    >>> tokens.tolist(), mask
    ([8, 9, 5, 7], None)
    """
    kept = list(answers)
    if len(kept) == 1 and _whole(*kept[0], lengths):  # one loader's answer is the step itself
        return kept[0][1]["tokens"], None, kept
    n = len(lengths)
    starts = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(lengths[:-1], out=starts[1:])
    tokens = scratch(int(lengths.sum()))  # packed into rows, then dropped
    mask: np.ndarray | None = None
    place = _kernel()
    for mine, got in kept:
        if "mask" in got and mask is None:
            mask = np.ones(len(tokens), dtype=np.uint8)
        if place is not None:
            _placed(place, tokens, starts, lengths, mine, got, "tokens")
            if "mask" in got:
                assert mask is not None
                _placed(place, mask, starts, lengths, mine, got, "mask")
        else:
            _place_runs(tokens, mask, starts, lengths, mine, got)
    return tokens, mask, kept


def _whole(mine: np.ndarray, got: dict[str, np.ndarray], lengths: np.ndarray) -> bool:
    """Whether answer ``got`` is every item of ``lengths``, in the plan's order, and no more.

    Its tokens are then the step's as they are (one loader served the whole step, as a
    plan of one source with one loader has it): copying them would give the same array.
    """
    n = len(lengths)
    return (
        len(mine) == n
        and "mask" not in got
        and len(got["tokens"]) == int(lengths.sum())
        and bool((mine == np.arange(n)).all())
        and np.array_equal(got["lengths"], lengths)
    )


def _placed(
    place: object,
    out: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    mine: np.ndarray,
    got: dict[str, np.ndarray],
    field: str,
) -> None:
    bad = place(out, starts, lengths, mine, got["lengths"], got[field])  # type: ignore[operator]
    if bad >= 0:
        _refuse(mine, got, lengths, bad)


def _place_runs(
    tokens: np.ndarray,
    mask: np.ndarray | None,
    starts: np.ndarray,
    lengths: np.ndarray,
    mine: np.ndarray,
    got: dict[str, np.ndarray],
) -> None:
    """:func:`_place` with numpy: a run of items next to each other in the plan is one slice."""
    if not len(mine):
        return
    if (mine < 0).any() or (mine >= len(lengths)).any():
        _refuse(mine, got, lengths, int(np.flatnonzero((mine < 0) | (mine >= len(lengths)))[0]))
    got_lengths = np.asarray(got["lengths"], dtype=np.int64)
    wrong = np.flatnonzero(got_lengths != lengths[mine])
    if len(wrong) or int(got_lengths.sum()) > len(got["tokens"]):
        _refuse(mine, got, lengths, int(wrong[0]) if len(wrong) else len(mine) - 1)
    got_starts = np.zeros(len(mine) + 1, dtype=np.int64)
    np.cumsum(got_lengths, out=got_starts[1:])
    cuts = np.flatnonzero(np.diff(mine) != 1) + 1
    run_lo, run_hi = np.append(0, cuts), np.append(cuts, len(mine))
    runs = list(zip(
        mine[run_lo].tolist(), got_starts[run_lo].tolist(), got_starts[run_hi].tolist()
    ))  # fmt: skip
    for j, g0, g1 in runs:
        at = int(starts[j])
        tokens[at : at + g1 - g0] = got["tokens"][g0:g1]
    if "mask" in got:
        assert mask is not None
        for j, g0, g1 in runs:
            at = int(starts[j])
            mask[at : at + g1 - g0] = got["mask"][g0:g1]


def _refuse(mine: np.ndarray, got: dict[str, np.ndarray], lengths: np.ndarray, k: int) -> None:
    j, have = int(mine[k]), int(got["lengths"][k])
    if not 0 <= j < len(lengths):
        why = f"for item {j}, which the step's {len(lengths)} items do not have"
    elif have != int(lengths[j]):
        why = f"item {j} of the step with {have} tokens where the plan has {int(lengths[j])}"
    else:
        counted = int(np.asarray(got["lengths"], dtype=np.int64).sum())
        why = f"{len(got['tokens'])} tokens where its lengths count {counted}"
    raise LoaderError(f"a loader answered {why}: its payload is not the items it was asked for")
