"""64-bit mixers shared by every layer (key hashing, partitioning, hash-table buckets).

Each function is a ``register_jitable``: the same source runs in plain Python, in numba
``njit`` code and in ``numba.cuda`` kernels, so CPU, GPU and the reference agree bit for bit.
All arithmetic stays in ``uint64``; mixing in a Python ``int`` literal would make numba
promote to float64, hence the ``np.uint64`` constants.
"""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)
"""The one key value that is reserved as the empty-bucket marker (docs/architecture.md: Keys and partitioning)."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_TABLE_SALT = np.uint64(0x2545F4914F6CDD1D)
_INIT_SALT = np.uint64(0xD6E8FEB86659FD93)


@register_jitable
def mix64(x):
    """SplitMix64 finaliser: a bijective, well-avalanched 64-bit mix."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@register_jitable
def bucket_hash(key):
    """Bucket hash for hash tables; salted so its bits are independent of the
    partitioning hash (a node's keys would otherwise crowd a fraction of the buckets)."""
    return mix64(key ^ _TABLE_SALT)


@register_jitable
def uniform_at(key, element, seed):
    """Deterministic uniform float in [-1, 1) for (key, element, seed)."""
    h = mix64(mix64(key ^ _INIT_SALT) + np.uint64(element) + mix64(np.uint64(seed)))
    # top 24 bits -> exactly representable float32 in [0, 1)
    return np.float32((h >> np.uint64(40)) * (1.0 / 16777216.0) * 2.0 - 1.0)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """Vectorised :func:`mix64` over a ``uint64`` array (numpy, or CuPy for device arrays,
    computed on the device; wrapping arithmetic)."""
    with np.errstate(over="ignore"):  # wrapping multiplication is the point
        z = x.astype(np.uint64, copy=False) if hasattr(x, "__cuda_array_interface__") else np.asarray(x, np.uint64)
        z = z + _GOLDEN
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)
