"""Rows of a request batch's distinct keys: all in memory, or hot rows in memory + SSD point reads.

Both lookups take the *distinct* keys of a batch (the model dedupes them first) and return
``float32[U, dim]`` weights. A key the model never trained (absent from the export) gets the
initial row the trainer would have given it (:func:`hpsray.kernels.init.initial_rows` with the
export's ``init_scale`` and ``seed``), so serving an unseen key equals what training would see.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hpsray.kernels.init import RowInit, initial_rows
from hpsray.serving.cache import HotCache
from hpsray.serving.pointstore import PointStore

__all__ = ["SSD_READS", "Lookup", "MemoryLookup", "TieredLookup", "mem_rows_for", "resolve_ssd_read"]

SSD_READS = ("auto", "blocks", "mmap")
"""How a tiered lookup reads its misses: ``blocks``, merged ranges by parallel ``preadv``
(:mod:`hpsray.serving.blockread`; rows on disk are read several at a time, a system call per
range even when they are cached); ``mmap``, a copy from the mapped rows file (no system call while
the file sits in the page cache; a row not there faults in one page at a time); ``auto``
(:func:`resolve_ssd_read`): ``mmap`` for a rows file that fits in a quarter of the memory
available, ``blocks`` otherwise."""

PAGE_CACHE_SHARE = 0.25  # of MemAvailable: a rows file this small is expected to stay in the page cache


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resolve_ssd_read(mode: str, rows_file_bytes: int, available_bytes: int | None = None) -> str:
    """``mode`` itself, or for ``auto``: ``mmap`` when ``rows_file_bytes`` is at most
    :data:`PAGE_CACHE_SHARE` of ``available_bytes`` (``MemAvailable`` of ``/proc/meminfo`` when
    not given; ``blocks`` where it cannot be read), else ``blocks``."""
    if mode not in SSD_READS:
        raise ValueError(f"ssd_read must be one of {', '.join(SSD_READS)}, got {mode!r}")
    if mode != "auto":
        return mode
    available = _available_bytes() if available_bytes is None else available_bytes
    return "mmap" if available is not None and rows_file_bytes <= PAGE_CACHE_SHARE * available else "blocks"


def mem_rows_for(n_rows: int, mem_rows: int | None, mem_fraction: float | None) -> int:
    """Rows held in memory: ``mem_rows``, or ``ceil(mem_fraction * n_rows)``, or all (neither given)."""
    if mem_rows is not None and mem_fraction is not None:
        raise ValueError("give mem_rows or mem_fraction, not both")
    if mem_rows is not None:
        if mem_rows < 0:
            raise ValueError(f"mem_rows must be >= 0, got {mem_rows}")
        return int(mem_rows)
    if mem_fraction is not None:
        if not 0.0 <= mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must lie in [0, 1], got {mem_fraction}")
        return int(np.ceil(mem_fraction * n_rows))
    return n_rows


class Lookup(Protocol):
    dim: int

    def rows(self, unique_keys: np.ndarray) -> np.ndarray:
        """``float32[U, dim]``: the weights of each distinct key (initial rows for unseen keys)."""

    def stats(self) -> dict:
        """Counters for reports: lookups, hits, SSD reads."""


def _fill_unseen(out: np.ndarray, keys: np.ndarray, where: np.ndarray, init: RowInit) -> int:
    idx = np.flatnonzero(where)
    if idx.size:
        out[idx] = initial_rows(keys[idx], out.shape[1], init)
    return int(idx.size)


class MemoryLookup:
    """Every row in memory: sorted keys searched with ``np.searchsorted``, rows gathered by numpy."""

    def __init__(self, keys: np.ndarray, weights: np.ndarray, init: RowInit) -> None:
        self.keys = np.ascontiguousarray(keys, np.uint64)
        self.weights = np.ascontiguousarray(weights, np.float32)
        self.dim = self.weights.shape[1]
        self.init = init
        self.lookups = self.unseen = 0

    def rows(self, unique_keys: np.ndarray) -> np.ndarray:
        n = self.keys.size
        pos = np.searchsorted(self.keys, unique_keys)
        pos[pos == n] = 0
        found = self.keys[pos] == unique_keys if n else np.zeros(unique_keys.size, np.bool_)
        out = self.weights[pos] if n else np.empty((unique_keys.size, self.dim), np.float32)
        self.lookups += unique_keys.size
        self.unseen += _fill_unseen(out, unique_keys, ~found, self.init)
        return out

    def stats(self) -> dict:
        return {"mode": "memory", "rows_in_memory": int(self.keys.size), "lookups": self.lookups, "unseen": self.unseen}


class TieredLookup:
    """Hot rows in a :class:`HotCache`, the rest read from a :class:`PointStore` on SSD.

    Per batch: probe the cache; gather the hits; find the misses in the store's key index and read
    them straight into their output rows (``ssd_read``, :data:`SSD_READS`: merged ranges by
    parallel ``preadv``, or a copy from the mapped rows file; ``auto`` picks by the file's size
    against the memory available); give unseen keys their initial rows; offer the rows read from
    SSD to the cache.

    ``warm_from``: the lookup of the model served before this one (an earlier export, or the
    state before a delta); its hot keys start in this cache with their rows read from ``store``,
    so a swap does not start cold and no row is served as it was before the delta.
    """

    def __init__(
        self,
        store: PointStore,
        capacity: int,
        init: RowInit,
        cache: HotCache | None = None,
        warm_from: TieredLookup | None = None,
        ssd_read: str = "auto",
    ) -> None:
        ssd_read = resolve_ssd_read(ssd_read, len(store) * store.stride)
        self.store = store
        self.ssd_read = ssd_read
        self.reader = store.block_reader() if ssd_read == "blocks" else None
        self.dim = store.dim
        self.cache = cache if cache is not None else HotCache(capacity, store.dim)
        self.init = init
        self.ssd_reads = self.unseen = 0
        self.carried = self.cache.carry(warm_from.cache, store.lookup) if warm_from is not None else 0

    def rows(self, unique_keys: np.ndarray) -> np.ndarray:
        out = np.empty((unique_keys.size, self.dim), np.float32)
        slots = self.cache.probe(unique_keys)
        self.cache.gather(slots, out)
        miss = np.flatnonzero(slots < 0)
        if miss.size:
            pos = self.store.find(unique_keys[miss])
            found = pos >= 0
            hit_rows, hit_pos = miss[found], pos[found]
            if hit_rows.size:
                if self.reader is not None:
                    self.reader.read_into(hit_pos, out, hit_rows)
                else:
                    self.store.read_into(hit_pos, out, hit_rows)
                self.ssd_reads += hit_rows.size
                self.cache.admit(unique_keys[hit_rows], out[hit_rows])
            if not found.all():
                unseen = np.zeros(unique_keys.size, np.bool_)
                unseen[miss[~found]] = True
                self.unseen += _fill_unseen(out, unique_keys, unseen, self.init)
        return out

    def stats(self) -> dict:
        c = self.cache
        return {
            "mode": "tiered",
            "rows_in_memory": c.capacity,
            "rows_on_ssd": len(self.store),
            "lookups": c.lookups,
            "hits": c.hits,
            "hit_rate": c.hits / c.lookups if c.lookups else 0.0,
            "ssd_reads": self.ssd_reads,
            "ssd_read": self.ssd_read,
            "reads_per_missed_row": self.reader.reads_per_row if self.reader is not None else None,
            "unseen": self.unseen,
            "carried": self.carried,
            "row_bytes_in_memory": int(c.rows.strides[0]),
        }
