"""The device-memory tier of the GPU lookup: the hottest rows in a device array, found by a host directory.

:class:`DeviceCache` holds up to ``capacity`` rows in device memory, ``float32[n, dim]`` at their
natural stride (no padding), so its hits are gathered into a batch's output by the same kernel as
the UVA path, :func:`hpsray.serving.uva.gather_rows`: device to device, every load inside an
aligned 128-byte segment. Which key sits in which device slot is kept on the host by a
:class:`~hpsray.serving.cache.HotCache` whose own rows take no memory (a zero-stride stand-in):
its probe (a hit bumps the entry's 8-bit count) and its admission (a free entry of the key's set,
otherwise the set's counts age by one) decide the device tier too, so the device tier keeps rows
by use exactly as the host tier does.

Per batch (:class:`~hpsray.serving.cuda_lookup.CudaTieredLookup`): :meth:`DeviceCache.probe` the
distinct keys; :meth:`DeviceCache.gather` the hits into the output; once the host tier and the
SSD have filled the other rows, :meth:`DeviceCache.promote` offers the rows gathered there: the
directory admits what it takes and one device-to-device scatter kernel (:func:`copy_rows`) copies
those rows from the output into their device slots. A slot is never rewritten while the batch
reads it: entries hit in this batch have a count of at least 1 and only entries of count 0 are
replaced, and every kernel runs in order on the default stream. Works under numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba as nb
import numpy as np

from hpsray.errors import ServingError
from hpsray.kernels.cuda.common import cuda
from hpsray.serving.cache import WAYS, HotCache
from hpsray.serving.uva import gather_rows, row_bytes_natural

__all__ = ["DEVICE_MEMORY_SHARE", "DeviceCache", "copy_rows", "device_rows_for", "free_device_bytes"]

DEVICE_MEMORY_SHARE = 0.25  # of the device's free memory, the default device tier's ceiling


def free_device_bytes() -> float:
    """Free memory of the current CUDA device (``inf`` in the simulator)."""
    return float(cuda.current_context().get_memory_info()[0])


def device_rows_for(
    n_rows: int, mem_rows: int, device_rows: int | None, dim: int, free_bytes: float | None = None
) -> int:
    """Rows of the device tier: ``device_rows`` (at most ``n_rows``) when given; otherwise the
    smaller of ``mem_rows`` (the host tier's size) and the rows that fit in
    :data:`DEVICE_MEMORY_SHARE` of the device's free memory (``free_bytes``; asked of the device
    when ``None``). An explicit size that does not fit in the free memory is refused."""
    row_bytes = row_bytes_natural(dim)
    free = free_device_bytes() if free_bytes is None else float(free_bytes)
    if device_rows is not None:
        if device_rows < 0:
            raise ValueError(f"device_rows must be >= 0, got {device_rows}")
        rows = min(int(device_rows), n_rows)
        if rows * row_bytes > free:
            raise ServingError(
                f"device_rows {device_rows}: {rows * row_bytes} bytes of device memory, only {int(free)} free"
            )
        return rows
    fit = free * DEVICE_MEMORY_SHARE // row_bytes
    return int(min(mem_rows, n_rows, fit)) if math.isfinite(fit) else int(min(mem_rows, n_rows))


def _no_rows(n: int, dim: int) -> np.ndarray:
    """``float32[n, dim]`` taking no memory (every row is one shared row): the directory's rows."""
    return np.lib.stride_tricks.as_strided(np.zeros(max(dim, 1), np.float32), shape=(n, dim), strides=(0, 4))


@nb.njit(nogil=True, cache=True)
def _locate(ckeys, n_sets, keys, slots):
    """``slots[i]``: the entry holding ``keys[i]``, ``-1`` if none (no count is touched)."""
    for i in range(keys.size):
        k = keys[i]
        base = np.int64((k % np.uint64(n_sets)) * np.uint64(WAYS))
        slots[i] = -1
        for w in range(WAYS):
            if ckeys[base + w] == k:
                slots[i] = base + w
                break


@cuda.jit
def _copy_kernel(src, src_rows, dst, dst_rows, dim):
    i = cuda.grid(1)
    if i < src_rows.size * dim:
        r = i // dim
        j = i % dim
        dst[dst_rows[r], j] = src[src_rows[r], j]


def copy_rows(src: Any, src_rows: Any, dst: Any, dst_rows: Any, dim: int) -> None:
    """``dst[dst_rows[i], :dim] = src[src_rows[i], :dim]`` on the device, one thread per weight
    (consecutive threads write consecutive words of a row). ``src``/``dst``: device float32 arrays
    of at least ``dim`` columns; ``src_rows``/``dst_rows``: int64 device arrays of equal length."""
    m = int(src_rows.shape[0])
    if m:
        threads = m * dim
        _copy_kernel[-(-threads // 256), 256](src, src_rows, dst, dst_rows, dim)


def _dev(a: np.ndarray) -> Any:
    return cuda.to_device(np.ascontiguousarray(a, np.int64))


class DeviceCache:
    """Up to ``capacity`` rows of ``dim`` weights in device memory; see the module docstring."""

    def __init__(self, capacity: int, dim: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.dim = dim
        n = -(-capacity // WAYS) * WAYS
        self.directory = HotCache(capacity, dim, rows=_no_rows(n, dim))
        self.rows = cuda.device_array((max(1, n), dim), np.float32)
        self.promoted = 0

    @property
    def capacity(self) -> int:
        return self.directory.capacity

    @property
    def hits(self) -> int:
        return self.directory.hits

    @property
    def lookups(self) -> int:
        return self.directory.lookups

    def probe(self, keys: np.ndarray) -> np.ndarray:
        """``int64[n]``: each distinct key's device slot, ``-1`` on a miss; counts the hits."""
        return self.directory.probe(keys)

    def gather(self, slots: np.ndarray, out_rows: np.ndarray, out: Any) -> None:
        """``out[out_rows[i]] = device row slots[i]`` (device to device, the aligned warp gather)."""
        if slots.size:
            gather_rows(self.rows, _dev(slots), _dev(out_rows), out, self.dim)

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        """``int64[n]``: where each key sits, ``-1`` where it does not (counts untouched)."""
        slots = np.full(keys.size, -1, np.int64)
        if self.directory.n_sets and keys.size:
            _locate(self.directory.keys, self.directory.n_sets, np.ascontiguousarray(keys, np.uint64), slots)
        return slots

    def promote(self, keys: np.ndarray, out: Any, out_rows: np.ndarray) -> int:
        """Offer rows of this batch's output (``out[out_rows[i]]`` holds ``keys[i]``'s row; keys
        distinct, none in this cache) for admission; the ones taken are copied into their device
        slots by one scatter kernel. Returns how many were taken."""
        if not self.directory.n_sets or not keys.size:
            return 0
        keys = np.ascontiguousarray(keys, np.uint64)
        self.directory.admit(keys, _no_rows(keys.size, self.dim))
        slots = self.slots_of(keys)
        taken = np.flatnonzero(slots >= 0)
        if taken.size:
            copy_rows(out, _dev(out_rows[taken]), self.rows, _dev(slots[taken]), self.dim)
        self.promoted += int(taken.size)
        return int(taken.size)

    def carry(self, old: DeviceCache, read_rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> int:
        """Take over ``old``'s keys (the device tier of the model served before) with their rows
        as ``read_rows(keys) -> (found, float32[n, dim])`` gives them now (:meth:`HotCache.carry`:
        same slots and counts when the geometry is unchanged, otherwise admitted hottest first);
        the rows are uploaded into their slots. Returns the entries carried."""
        got: list[tuple[np.ndarray, np.ndarray]] = []

        def read(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            found, rows = read_rows(keys)
            got.append((keys[found], rows[found]))
            return found, rows

        carried = self.directory.carry(old.directory, read)
        if carried and got:
            keys, rows = got[0]
            slots = self.slots_of(keys)
            taken = np.flatnonzero(slots >= 0)
            if taken.size:
                src = cuda.to_device(np.ascontiguousarray(rows[taken], np.float32))
                copy_rows(src, _dev(np.arange(taken.size)), self.rows, _dev(slots[taken]), self.dim)
        return carried
