"""Deterministic per-key initial values of new rows.

A new row's weight ``j`` is ``scale * u(key, j, seed)`` with ``u`` a hash-derived uniform in
[-1, 1); every state element starts at ``state_value``. The value depends only on the key, so a
key starts the same way on any node, device or tier, and in the reference trainer. With tables
of several row layouts (``RowInit.tables``) a key's table (its top byte) gives its ``dim``,
width and ``state_value``, and a row wider than its table's is zero past the table's width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit
from numba.extending import register_jitable

from hpsray.kernels.hashing import uniform_at
from hpsray.kernels.optim import SparseOptimizer


@dataclass(frozen=True)
class RowInit:
    """How new rows are filled: ``dim`` uniform weights, then state values; ``tables`` (tables
    of several layouts; empty: one): per table, by its index in the keys' top byte, its
    ``(dim, width, state_value)``, which replace ``dim`` and ``state_value``."""

    dim: int = 0
    scale: float = 0.01
    seed: int = 0
    state_value: float = 0.0
    tables: tuple[tuple[int, int, float], ...] = ()

    @staticmethod
    def for_optimizer(dim: int, optimizer: SparseOptimizer, scale: float = 0.01, seed: int = 0) -> RowInit:
        return RowInit(dim=dim, scale=scale, seed=seed, state_value=optimizer.state_init())


@register_jitable
def init_row(row, key, dim, width, scale, seed, state_value):
    """Fill ``row`` (float32[width]) with the initial value of ``key``."""
    for j in range(dim):
        row[j] = uniform_at(key, j, seed) * scale
    for j in range(dim, width):
        row[j] = state_value


def initial_rows(keys: np.ndarray, width: int, init: RowInit) -> np.ndarray:
    """Initial rows of ``keys`` (``float32[n, width]``), bit-equal to what the hash tables give
    the keys they insert (the same :func:`init_row`, the same float32 arithmetic)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    out = np.empty((keys.size, width), dtype=np.float32)
    scale, seed = np.float32(init.scale), np.uint64(init.seed)
    if not init.tables:
        _fill_initial(out, keys, init.dim, scale, seed, np.float32(init.state_value))
        return out
    by_tag = np.zeros((256, 2), np.int64)  # a tag of no table: a row of zeros
    states = np.zeros(256, np.float32)
    for t, (dim, w, state) in enumerate(init.tables):
        if w > width:
            raise ValueError(f"initial_rows: table {t}'s rows have {w} floats, the rows asked for {width}")
        by_tag[t] = dim, w
        states[t] = state
    _fill_tables(out, keys, by_tag, states, scale, seed)
    return out


@njit(cache=True, nogil=True)
def _fill_initial(out, keys, dim, scale, seed, state_value):
    # one thread: MEM-PS calls this beside the trainer's threads
    width = out.shape[1]
    for i in range(keys.size):
        init_row(out[i], keys[i], dim, width, scale, seed, state_value)


@njit(cache=True, nogil=True)
def _fill_tables(out, keys, by_tag, states, scale, seed):
    """:func:`_fill_initial` with each key's ``(dim, width)`` and state value by its top byte."""
    width = out.shape[1]
    for i in range(keys.size):
        t = keys[i] >> np.uint64(56)
        w = by_tag[t, 1]
        init_row(out[i], keys[i], by_tag[t, 0], w, scale, seed, states[t])
        for j in range(w, width):
            out[i, j] = 0.0
