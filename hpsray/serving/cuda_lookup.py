"""The GPU lookup: hot rows in mapped pinned host memory (UVA gathers), the rest from SSD to device.

Per batch of distinct keys: the host-side :class:`~hpsray.serving.cache.HotCache` finds the hot
slots; the UVA kernel (:func:`hpsray.serving.uva.gather_rows`) reads those rows from host memory
into the device output; misses found in the point store are read straight to their device rows
(:class:`~hpsray.serving.gds.DeviceRowReader`); unseen keys get their initial rows. Rows read
from SSD are copied back to the host cache for admission. Returns a CUDA ``torch.Tensor``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.serving.cache import HotCache
from hpsray.serving.gds import DeviceRowReader, scatter_rows
from hpsray.serving.pointstore import PointStore
from hpsray.serving.uva import gather_rows, mapped_rows

__all__ = ["CudaTieredLookup"]


class CudaTieredLookup:
    """Hot rows in mapped host memory + SSD rows to device; see the module docstring."""

    def __init__(self, store: PointStore, capacity: int, init: RowInit) -> None:
        self.store, self.dim, self.init = store, store.dim, init
        capacity = min(capacity, len(store))
        probe = HotCache(capacity, store.dim)  # sizes the sets
        self.host_rows = mapped_rows(max(1, probe.capacity), store.dim)
        self.cache = HotCache(capacity, store.dim, rows=self.host_rows)
        self.reader = DeviceRowReader(store)
        self.ssd_reads = self.unseen = 0

    def rows(self, unique_keys: np.ndarray):
        import torch

        u = unique_keys.size
        out = cuda.device_array((u, self.dim), np.float32)
        slots = self.cache.probe(unique_keys)
        hit = np.flatnonzero(slots >= 0)
        if hit.size:
            gather_rows(self.host_rows, cuda.to_device(slots[hit]), cuda.to_device(hit.astype(np.int64)), out, self.dim)
        miss = np.flatnonzero(slots < 0)
        if miss.size:
            pos = self.store.find(unique_keys[miss])
            found = pos >= 0
            if found.any():
                rows_idx = miss[found]
                self.reader.read(pos[found], out, rows_idx)
                self.ssd_reads += rows_idx.size
                host = out.copy_to_host()[rows_idx]
                self.cache.admit(unique_keys[rows_idx], host)
            if not found.all():
                idx = miss[~found]
                init = initial_rows(unique_keys[idx], self.dim, self.init)
                scatter_rows(cuda.to_device(init), cuda.to_device(idx.astype(np.int64)), out, self.dim)
                self.unseen += idx.size
        cuda.synchronize()
        return torch.as_tensor(out, device="cuda")

    def stats(self) -> dict:
        c = self.cache
        return {
            "mode": "cuda-tiered",
            "rows_in_memory": c.capacity,
            "rows_on_ssd": len(self.store),
            "lookups": c.lookups,
            "hits": c.hits,
            "ssd_reads": self.ssd_reads,
            "unseen": self.unseen,
            "ssd_path": self.reader.path,
        }
