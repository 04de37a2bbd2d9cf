"""Loops compiled with numba on first use, where numba imports (the ``fast`` extra).

A module keeps its loop as plain Python (it imports with numpy alone) and
asks :func:`compiled_once` for the function that compiles it the first time
it is called: the compiled loop, or None without numba, so that the caller
runs its numpy or Python way instead. Compiling takes about a second; numba
caches it (``cache=True``: beside the module, else in the user's cache
directory) and a later process loads it in a fraction of that.

The loops keep the GIL: a daemon thread inside one when the process exits
must not take the GIL back from C++ frames (that ends in ``std::terminate``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np


def compiled_once(
    loop: Callable[..., Any], helpers: tuple[str, ...] = ()
) -> Callable[[], Callable[..., Any] | None]:
    """A function that returns ``loop`` compiled (None where numba does not import).

    ``helpers``: names of functions of ``loop``'s module that it calls, compiled
    first and put in the module's place of the Python ones.
    """
    lock = threading.Lock()
    done: list[Callable[..., Any] | None] = []

    def kernel() -> Callable[..., Any] | None:
        if not done:  # once compiled, no lock
            with lock:
                if not done:
                    done.append(_compile(loop, helpers))
        return done[0]

    return kernel


def _compile(loop: Callable[..., Any], helpers: tuple[str, ...]) -> Callable[..., Any] | None:
    try:
        import numba
    except ImportError:
        return None
    jit = numba.njit(cache=True)
    module = loop.__globals__
    for name in helpers:
        module[name] = jit(module[name])
    compiled: Callable[..., Any] = jit(loop)
    return compiled


def copy_ranges(
    out: np.ndarray, at: np.ndarray, src: np.ndarray, start: np.ndarray, length: np.ndarray
) -> None:
    """Copy ``src[start[i] : start[i] + length[i]]`` to ``out[at[i]:]``, for every ``i``.

    Each value is cast to ``out``'s dtype as it is placed (file ids of any integer
    dtype into int32, say). Compiled: nothing checks the ranges.
    """
    for i in range(len(at)):
        a, s, n = at[i], start[i], length[i]
        out[a : a + n] = src[s : s + n]


# copy_ranges compiled (None where numba does not import)
copy_kernel = compiled_once(copy_ranges)
