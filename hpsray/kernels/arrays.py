"""The array module of a device: NumPy on the CPU, CuPy on CUDA, and array code written once for both.

Code that works on keys and rows around the kernels takes ``xp`` (``numpy`` or ``cupy``) and
calls only functions the two share, so the CPU tests run the very lines a GPU runs. Device
arrays cross between numba.cuda, CuPy and torch without copies through
``__cuda_array_interface__``; :func:`to_host` is the one place a device array comes back.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, TypeAlias

import numpy as np

__all__ = ["DeviceArray", "array_module", "is_device_array", "to_host", "distinct_inverse"]

DeviceArray: TypeAlias = Any
"""A CUDA device array: a numba device array, a CuPy array or a torch CUDA tensor. They share no
static type, only the ``__cuda_array_interface__`` protocol, so for mypy it is ``Any``; the name
says where a device array may stand."""


def array_module(device: str) -> ModuleType:
    """``numpy`` for ``"cpu"``, ``cupy`` for ``"cuda"`` (a clear error when CuPy is missing)."""
    if device == "cpu":
        return np
    if device == "cuda":
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError(
                f"device='cuda' needs CuPy for the arrays around the kernels: pip install 'hpsray[gpu]' ({exc})"
            ) from exc
        return cupy
    raise ValueError(f"unknown device {device!r}; choose 'cpu' or 'cuda'")


def is_device_array(x: Any) -> bool:
    """True for arrays in device memory (CuPy, numba.cuda, torch CUDA tensors)."""
    return hasattr(x, "__cuda_array_interface__")


def to_host(x: Any) -> np.ndarray:
    """``x`` as a numpy array (a device-to-host copy for device arrays; numpy passes through)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get") and hasattr(x, "__cuda_array_interface__"):  # CuPy
        return x.get()
    if hasattr(x, "copy_to_host"):  # numba.cuda
        return x.copy_to_host()
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def distinct_inverse(xp: ModuleType, keys: Any) -> tuple[Any, Any]:
    """``(distinct, inverse)``: the sorted distinct values of 1-D ``keys`` and, per key, the
    index of its value in ``distinct`` (``distinct[inverse] == keys``), both in ``xp``.

    One sort and a neighbour compare: the same lines on NumPy and CuPy (on the GPU the sort
    is CuPy's radix sort; on the CPU it beats ``np.unique(return_inverse=True)`` of numpy 2.4).
    """
    n = keys.shape[0]
    if n == 0:
        return keys[:0], xp.zeros(0, dtype=xp.int64)
    order = xp.argsort(keys)
    ordered = keys[order]
    head = xp.empty(n, dtype=bool)
    head[0] = True
    xp.not_equal(ordered[1:], ordered[:-1], out=head[1:])
    ids = xp.cumsum(head, dtype=xp.int64) - 1
    inverse = xp.empty(n, dtype=xp.int64)
    inverse[order] = ids
    return ordered[head], inverse
