"""Distinct keys of a batch, ascending, and the check that keys already are."""

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


def is_sorted_distinct(keys: np.ndarray) -> bool:
    """Whether ``keys`` are strictly ascending (so distinct): what readers send and what a
    mini-batch's keys are; one pass, no sort."""
    return keys.size < 2 or bool(np.all(keys[1:] > keys[:-1]))
