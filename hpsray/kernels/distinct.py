"""Distinct keys of a batch, ascending, the check that keys already are, and membership in such keys."""

from __future__ import annotations

import numpy as np


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


def in_sorted(values: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """``bool[len(values)]``: which of ``values`` occur in the ascending array ``sorted_keys``
    (a binary search per value; ``np.isin`` sorts both sides first)."""
    if not sorted_keys.size or not values.size:
        return np.zeros(values.size, bool)
    at = np.minimum(np.searchsorted(sorted_keys, values), sorted_keys.size - 1)
    return np.asarray(sorted_keys[at] == values)


def is_sorted_distinct(keys: np.ndarray) -> bool:
    """Whether ``keys`` are strictly ascending (so distinct): what readers send and what a
    mini-batch's keys are; one pass, no sort."""
    return keys.size < 2 or bool(np.all(keys[1:] > keys[:-1]))
