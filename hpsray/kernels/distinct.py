"""Distinct keys of a batch, ascending, the check that keys already are, and membership in such keys."""

from __future__ import annotations

import numpy as np
from numba import njit

from hpsray.kernels.table import readonly


def distinct_sorted(keys: np.ndarray) -> np.ndarray:
    """The distinct values of ``keys``, ascending: ``np.unique(keys)`` computed by a sort and a
    neighbour comparison: numpy 2.x sends a plain ``np.unique`` of integers through a much slower
    hash path (docs/benchmarks.md, "Notes from the code")."""
    s = np.sort(np.asarray(keys).ravel())
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


MERGE_MIN = 4096  # values from which ascending uint64 values are merged, not searched


def in_sorted(values: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """``bool[len(values)]``: which of ``values`` occur in the ascending array ``sorted_keys``
    (a binary search per value; ``np.isin`` sorts both sides first). Ascending ``uint64``
    values (a batch's keys against another batch's) are merged in one pass instead
    (:func:`_merge_in`), from :data:`MERGE_MIN` of them on."""
    if not sorted_keys.size or not values.size:
        return np.zeros(values.size, bool)
    if (
        values.size >= MERGE_MIN
        and values.dtype == sorted_keys.dtype == np.uint64
        and values.ndim == sorted_keys.ndim == 1
        and bool(np.all(values[1:] >= values[:-1]))
    ):
        out = np.empty(values.size, bool)
        _merge_in(readonly(values), readonly(sorted_keys), out)
        return out
    at = np.minimum(np.searchsorted(sorted_keys, values), sorted_keys.size - 1)
    return np.asarray(sorted_keys[at] == values)


@njit(cache=True, nogil=True)
def _merge_in(values, sorted_keys, out):
    """``out[i]``: whether ascending ``values[i]`` is in ascending ``sorted_keys``."""
    j, n = 0, sorted_keys.size
    for i in range(values.size):
        v = values[i]
        while j < n and sorted_keys[j] < v:
            j += 1
        out[i] = j < n and sorted_keys[j] == v


def warm_in_sorted() -> None:
    """Compile :func:`in_sorted`'s merge before the clock (a stage's warm-up)."""
    keys = np.arange(MERGE_MIN, dtype=np.uint64)
    in_sorted(keys, keys[::3])


def is_sorted_distinct(keys: np.ndarray) -> bool:
    """Whether ``keys`` are strictly ascending (so distinct): what readers send and what a
    mini-batch's keys are; one pass, no sort."""
    return keys.size < 2 or bool(np.all(keys[1:] > keys[:-1]))
