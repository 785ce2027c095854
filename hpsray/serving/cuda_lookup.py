"""The CPU-driven GPU lookup, three tiers: hot rows in device memory, warm rows in mapped pinned
host memory, the rest on SSD.

Contract: :meth:`CudaTieredLookup.rows` (a CUDA ``torch.Tensor``) and
:meth:`CudaTieredLookup.rows_device` (the numba device array the simulator tests read) return
the model's rows of a batch of distinct keys, absent keys their initial rows; the host dedupes
and probes both directories and sends index arrays to the device; ``stats()`` counts
``device_hits``, ``host_hits`` and ``ssd_reads``. The tiers and admission: docs/serving.md, How
a request is answered (GPU, CPU-driven); :mod:`hpsray.serving.device_driven` is the
device-driven path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numba import cuda

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.serving.cache import WAYS, HotCache
from hpsray.serving.device_cache import DeviceCache, device_rows_for
from hpsray.serving.gds import DeviceRowReader, scatter_rows
from hpsray.serving.pointstore import PointStore
from hpsray.serving.uva import device_view, gather_rows, host_arena, release_view

if TYPE_CHECKING:
    import torch

__all__ = ["CudaTieredLookup"]


def _dev(a: np.ndarray) -> Any:
    return cuda.to_device(np.ascontiguousarray(a, np.int64))


class CudaTieredLookup:
    """Device rows + mapped host rows + SSD rows to device; see the module docstring.

    ``capacity``: rows of the host tier (``--mem-rows``); ``device_rows``: rows of the device tier
    (``None``: :func:`~hpsray.serving.device_cache.device_rows_for`'s default, the smaller of
    ``capacity`` and a quarter of the device's free memory; 0: no device tier). ``warm_from``: the
    lookup of the model served before; both tiers start with its keys, their rows re-read from
    ``store``.
    """

    def __init__(
        self,
        store: PointStore,
        capacity: int,
        init: RowInit,
        device_rows: int | None = None,
        warm_from: CudaTieredLookup | None = None,
    ) -> None:
        self.store, self.dim, self.init = store, store.dim, init
        capacity = min(capacity, len(store))
        self.device = DeviceCache(device_rows_for(len(store), capacity, device_rows, store.dim), store.dim)
        n = -(-capacity // WAYS) * WAYS  # the host tier's entries (whole sets)
        self.arena = host_arena(n, store.dim)  # written by the host cache, read by the device over the bus
        self.host_rows = device_view(self.arena)
        self.cache = HotCache(capacity, store.dim, rows=self.arena)
        self.reader = DeviceRowReader(store)
        self.ssd_reads = self.unseen = 0
        self.carried = 0
        if warm_from is not None:
            self.carried = self.cache.carry(warm_from.cache, store.lookup)
            self.carried += self.device.carry(warm_from.device, store.lookup)

    def rows_device(self, unique_keys: np.ndarray) -> Any:
        """A numba device array ``float32[U, dim]``: the rows of the distinct keys, through the tiers."""
        keys = np.ascontiguousarray(unique_keys, np.uint64)
        out = cuda.device_array((keys.size, self.dim), np.float32)
        dslots = self.device.probe(keys)
        dhit = np.flatnonzero(dslots >= 0)
        self.device.gather(dslots[dhit], dhit, out)
        rest = np.flatnonzero(dslots < 0)
        if rest.size:
            hslots = self.cache.probe(keys[rest])
            on_host = hslots >= 0
            host_idx = rest[on_host]
            if host_idx.size:
                gather_rows(self.host_rows, _dev(hslots[on_host]), _dev(host_idx), out, self.dim)
            miss = rest[~on_host]
            ssd_idx = miss[:0]
            if miss.size:
                pos = self.store.find(keys[miss])
                found = pos >= 0
                ssd_idx = miss[found]
                if ssd_idx.size:
                    host = self.reader.read(pos[found], out, ssd_idx, want_host=self.cache.n_sets > 0)
                    self.ssd_reads += int(ssd_idx.size)
                    if host is not None:
                        self.cache.admit(keys[ssd_idx], host)
                if not found.all():
                    idx = miss[~found]
                    init = initial_rows(keys[idx], self.dim, self.init)
                    scatter_rows(cuda.to_device(init), _dev(idx), out, self.dim)
                    self.unseen += int(idx.size)
            gathered = np.concatenate([host_idx, ssd_idx])  # host hits first: rows seen before
            self.device.promote(keys[gathered], out, gathered)
        cuda.synchronize()
        return out

    def rows(self, unique_keys: np.ndarray) -> torch.Tensor:
        """A CUDA ``torch.Tensor`` ``float32[U, dim]`` (see :meth:`rows_device`)."""
        import torch

        return torch.as_tensor(self.rows_device(unique_keys), device="cuda")

    def stats(self) -> dict:
        d, c = self.device, self.cache
        hits = d.hits + c.hits
        return {
            "mode": "cuda-tiered",
            "rows_on_device": d.capacity,
            "rows_in_memory": c.capacity,
            "rows_on_ssd": len(self.store),
            "lookups": d.lookups,
            "device_hits": d.hits,
            "host_hits": c.hits,
            "hits": hits,
            "hit_rate": hits / d.lookups if d.lookups else 0.0,
            "ssd_reads": self.ssd_reads,
            "unseen": self.unseen,
            "promoted": d.promoted,
            "carried": self.carried,
            "ssd_path": self.reader.path,
            "reads_per_missed_row": self.reader.reads_per_row,
            "row_bytes_in_memory": self.arena.strides[0],
        }

    def close(self) -> None:
        """Unregister the host arena and close the reader."""
        release_view(self.host_rows)
        self.reader.close()
