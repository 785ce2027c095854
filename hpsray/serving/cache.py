"""The hot-row cache in host memory: set-associative, frequency-aged admission, in numba.

``capacity`` rows in sets of ``WAYS``. A key maps to one set (``key % n_sets``; keys are already
64-bit mixes). A hit bumps the entry's 8-bit count. A miss is admitted into the set's entry of
count 0 if there is one; otherwise every count of the set goes down by one (aging), so a key
must be seen again before it displaces a row that was hot: GDRec's hot rows in DRAM, kept by use.
One writer at a time (a replica runs one batch at a time).
"""

from __future__ import annotations

from collections.abc import Callable

import numba as nb
import numpy as np

from hpsray.kernels.hashing import EMPTY_KEY

__all__ = ["HotCache", "WAYS"]

WAYS = 4


@nb.njit(nogil=True, cache=True)
def _probe(ckeys, counts, n_sets, keys, slots):
    hits = 0
    for i in range(keys.size):
        k = keys[i]
        base = (k % np.uint64(n_sets)) * np.uint64(WAYS)
        slots[i] = -1
        for w in range(WAYS):
            s = np.int64(base) + w
            if ckeys[s] == k:
                slots[i] = s
                if counts[s] < 255:
                    counts[s] += 1
                hits += 1
                break
    return hits


@nb.njit(nogil=True, cache=True)
def _gather(crows, slots, out, dim):
    for i in range(slots.size):
        s = slots[i]
        if s >= 0:
            for j in range(dim):
                out[i, j] = crows[s, j]


@nb.njit(nogil=True, cache=True)
def _admit(ckeys, counts, crows, n_sets, keys, rows, dim):
    admitted = 0
    for i in range(keys.size):
        k = keys[i]
        base = np.int64((k % np.uint64(n_sets)) * np.uint64(WAYS))
        victim = -1
        for w in range(WAYS):
            if counts[base + w] == 0:
                victim = base + w
                break
        if victim < 0:
            for w in range(WAYS):
                counts[base + w] -= 1
            continue
        ckeys[victim] = k
        counts[victim] = 1
        for j in range(dim):
            crows[victim, j] = rows[i, j]
        admitted += 1
    return admitted


class HotCache:
    """Up to ``capacity`` rows of ``dim`` weights by key; see the module docstring.

    ``rows`` may be supplied (e.g. pinned host memory mapped into a GPU, :mod:`hpsray.serving.uva`):
    float32[n_sets * WAYS, >= dim], C-contiguous.
    """

    def __init__(self, capacity: int, dim: int, rows: np.ndarray | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.n_sets = max(1, -(-capacity // WAYS)) if capacity else 0
        n = self.n_sets * WAYS
        self.dim = dim
        self.keys = np.full(n, EMPTY_KEY, np.uint64)
        self.counts = np.zeros(n, np.uint8)
        self.rows = rows if rows is not None else np.zeros((n, dim), np.float32)
        if self.rows.shape[0] < n or self.rows.shape[1] < dim:
            raise ValueError(f"rows must be float32[{n}, >= {dim}], got {self.rows.shape}")
        self.hits = 0
        self.lookups = 0

    @property
    def capacity(self) -> int:
        return self.n_sets * WAYS

    def probe(self, keys: np.ndarray) -> np.ndarray:
        """``int64[n]``: each (distinct) key's cache slot, ``-1`` on a miss; counts the hits."""
        slots = np.empty(keys.size, np.int64)
        if self.n_sets:
            self.hits += _probe(self.keys, self.counts, self.n_sets, keys, slots)
        else:
            slots[:] = -1
        self.lookups += keys.size
        return slots

    def gather(self, slots: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = row of slots[i]`` where ``slots[i] >= 0`` (others untouched)."""
        _gather(self.rows, slots, out, self.dim)

    def carry(self, old: HotCache, read_rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> int:
        """Take over ``old``'s keys (a cache of an earlier model, maybe still in use by another
        thread), with their rows as they are now: ``read_rows(keys) -> (found bool[n],
        float32[n, dim])`` gives them (from the new model's store). Keys it does not find are
        dropped. Same geometry: the entries stay in their slots, counts kept; otherwise the keys
        are admitted afresh. Returns the entries carried."""
        if not self.n_sets or not old.n_sets or old.dim != self.dim:
            return 0
        keys, counts = old.keys.copy(), old.counts.copy()  # a snapshot; its rows are re-read below
        slots = np.flatnonzero(keys != EMPTY_KEY)
        found, rows = read_rows(keys[slots])
        slots, rows = slots[found], rows[found]
        if old.n_sets == self.n_sets:
            self.keys[slots] = keys[slots]
            self.counts[slots] = counts[slots]
            self.rows[slots, : self.dim] = rows
            return int(slots.size)
        order = np.argsort(counts[slots], kind="stable")[::-1]  # the hottest first
        return self.admit(keys[slots][order], np.ascontiguousarray(rows[order]))

    def admit(self, keys: np.ndarray, rows: np.ndarray) -> int:
        """Offer missed rows to the cache; returns how many were taken in."""
        if not self.n_sets or not keys.size:
            return 0
        return _admit(self.keys, self.counts, self.rows, self.n_sets, keys, rows, self.dim)
