"""Deterministic per-key initial values of new rows.

A new row's weight ``j`` is ``scale * u(key, j, seed)`` with ``u`` a hash-derived uniform in
[-1, 1); every state element starts at ``state_value``. The value depends only on the key, so a
key starts the same way on any node, device or tier, and in the reference trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba.extending import register_jitable

from hpsray.kernels.hashing import uniform_at
from hpsray.kernels.optim import SparseOptimizer


@dataclass(frozen=True)
class RowInit:
    """How new rows are filled: ``dim`` uniform weights, then state values."""

    dim: int = 0
    scale: float = 0.01
    seed: int = 0
    state_value: float = 0.0

    @staticmethod
    def for_optimizer(dim: int, optimizer: SparseOptimizer, scale: float = 0.01, seed: int = 0) -> "RowInit":
        return RowInit(dim=dim, scale=scale, seed=seed, state_value=optimizer.state_init())


@register_jitable
def init_row(row, key, dim, width, scale, seed, state_value):
    """Fill ``row`` (float32[width]) with the initial value of ``key``."""
    for j in range(dim):
        row[j] = uniform_at(key, j, seed) * scale
    for j in range(dim, width):
        row[j] = state_value


def initial_rows(keys: np.ndarray, width: int, init: RowInit) -> np.ndarray:
    """Initial rows of ``keys`` (vectorised numpy; for references and tests)."""
    from hpsray.kernels.hashing import _INIT_SALT, mix64_array

    keys = np.asarray(keys, dtype=np.uint64)
    out = np.full((keys.size, width), np.float32(init.state_value), dtype=np.float32)
    if init.dim:
        j = np.arange(init.dim, dtype=np.uint64)
        h = mix64_array(mix64_array(keys ^ _INIT_SALT)[:, None] + j[None, :] + mix64_array(np.uint64(init.seed)))
        u = ((h >> np.uint64(40)) * (1.0 / 16777216.0) * 2.0 - 1.0).astype(np.float32)
        out[:, : init.dim] = u * np.float32(init.scale)
    return out
