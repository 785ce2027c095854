"""Turning raw categorical values into ``uint64`` keys (docs/architecture.md: Keys and partitioning).

A key is a 64-bit mix of (slot id, value), so equal raw values in different slots give
different keys. The reserved empty marker never comes out.
"""

from __future__ import annotations

import numpy as np

from hpsray.kernels.hashing import EMPTY_KEY, mix64_array

_SLOT_SALT = np.uint64(0x5851F42D4C957F2D)


def slot_salt(slot: int | np.ndarray) -> np.ndarray:
    """The per-slot salt that is mixed into every value of that slot."""
    return mix64_array(np.asarray(slot, dtype=np.uint64) * _SLOT_SALT + np.uint64(1))


def hash_keys(slot: int | np.ndarray, values: np.ndarray) -> np.ndarray:
    """Keys for integer values (``uint64`` or int64 hashes of strings) of one or many slots.

    ``slot`` is a scalar slot id or an array broadcastable to ``values``.
    """
    v = np.asarray(values).astype(np.uint64, copy=False)
    keys = np.asarray(mix64_array(v ^ slot_salt(slot)))
    if keys.ndim == 0:
        return np.where(keys == EMPTY_KEY, EMPTY_KEY - np.uint64(1), keys)
    keys[keys == EMPTY_KEY] = EMPTY_KEY - np.uint64(1)
    return keys
