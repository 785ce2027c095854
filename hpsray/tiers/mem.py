"""MEM-PS: a node's rows in host memory, a cache over SSD-PS (paper §5, App. D).

Rows live in the arena of a :class:`~hpsray.kernels.cpu.CpuHashTable` (key → slot); per-slot
metadata (replacement state, pin counts, dirty flags) lives in numpy arrays. Replacement is
LRU → LFU (:mod:`hpsray.tiers.cache_policy`): every visited row enters the LRU region, rows
leaving the LRU enter the LFU region, rows leaving the LFU region are handed to SSD-PS
(``dump``) *before* their memory is released; a store that writes behind
(:class:`WritingBehindStore`) keeps them readable until they are written.

A batch's rows are pinned under its batch id from :meth:`MemPS.pull` (which leaves the rows it
does not hold to the load stage: their slots are *reserved*) until :meth:`MemPS.unpin`; pinned
rows are never evicted (docs/architecture.md: invariant 3). Only *dirty* rows
(changed by :meth:`MemPS.write_back` since they were last stored) are written on eviction: a
clean row is already on SSD-PS with the same value, or was never stored and is re-created
bit for bit by the deterministic initializer.

Every call takes arrays of keys; there is no per-row Python on the hot path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from hpsray.errors import CapacityError
from hpsray.kernels.cpu import CpuHashTable
from hpsray.kernels.distinct import is_sorted_distinct
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.kernels.table import as_keys, as_rows, bucket_count
from hpsray.tiers.cache_policy import (
    DEFAULT_AGING,
    DEFAULT_HISTORY,
    DEFAULT_LRU_FRACTION,
    FrequencySketch,
    LruLfuPolicy,
)

__all__ = ["META_BYTES_PER_ROW", "BackingStore", "DeletingStore", "MemPS", "WritingBehindStore", "rows_for_bytes"]

# per-row bookkeeping besides the row and the hash buckets: table row_keys/free/first (24),
# our slot keys (8), policy region/tick/freq/pins (21), dirty flag (1)
META_BYTES_PER_ROW = 54
FLUSH_CHUNK_BYTES = 64 << 20
"""The most row bytes one write of a flush hands to the backing store: each write's gathered
rows, their copy in flight and the store's unsynced pages stay this small, whatever the cache's
size (a flush in one write of a 600k-row cache of 512-byte rows held ~1 GB at once)."""


class BackingStore(Protocol):
    """What MEM-PS needs from the tier below (:class:`~hpsray.tiers.ssd.SSDPS`)."""

    width: int

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows float32[n, width], found bool[n])``: a row per key, zero where not found (the
        load contract, as :meth:`~hpsray.tiers.ssd.SSDPS.load`)."""
        ...

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None: ...


class DeletingStore(BackingStore, Protocol):
    """A backing store that also deletes rows (expiry: docs/architecture.md, Admission and expiry)."""

    def delete(self, keys: np.ndarray) -> int: ...


class WritingBehindStore(BackingStore, Protocol):
    """A backing store whose ``dump`` and ``delete`` may return before the store has them (the
    Ray actor's, which submits them to the SSD-PS actor without waiting). ``in_flight(keys)``
    answers ``(rows, found, deleted)`` for keys whose newest dump (``found``, its row in
    ``rows``) or delete is still under way, so MEM-PS never misses a row it handed down."""

    def in_flight(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def _distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(sorted distinct keys, inverse)``; inverse ``None`` when ``keys`` already are (what readers send)."""
    if is_sorted_distinct(keys):
        return keys, None
    uk, inv = np.unique(keys, return_inverse=True)
    return uk, inv


def rows_for_bytes(capacity_bytes: int, width: int, history: float | None = DEFAULT_HISTORY) -> int:
    """Most rows of ``width`` floats whose rows and bookkeeping (hash buckets, replacement
    state, frequency sketch) fit in ``capacity_bytes``."""

    def cost(rows: int) -> int:
        sketch = 4 * 2 * FrequencySketch.width_for(int(history * rows)) if history else 0
        return rows * (4 * width + META_BYTES_PER_ROW) + 16 * bucket_count(rows) + sketch

    lo, hi = 0, max(1, capacity_bytes // (4 * width + META_BYTES_PER_ROW))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= capacity_bytes:
            lo = mid
        else:
            hi = mid - 1
    if lo < 1:
        raise ValueError(f"capacity_bytes={capacity_bytes} holds no row of width {width} ({cost(1)} bytes each)")
    return lo


class MemPS:
    """In-memory rows of one node over a backing SSD-PS.

    Args:
        capacity_rows: most rows held (``None`` when ``capacity_bytes`` is given).
        width: floats per row; must equal ``ssd.width``.
        ssd: the backing store (rows come from ``ssd.load`` and go to ``ssd.dump``).
        init: initializer of keys the store has never seen (zeros when ``None``).
        capacity_bytes: memory budget instead of ``capacity_rows`` (rows + bookkeeping).
        lru_fraction: share of the capacity for the LRU region (1: plain LRU, 0: plain LFU).
        aging: frequencies halve every ``aging × capacity`` visits (``None``: never).
        history: size of the frequency sketch, counters per depth × capacity (``None``: a
            row's count restarts at 1 whenever it is re-admitted).
        stats_history: how many batches keep their per-batch counters.
    """

    def __init__(
        self,
        capacity_rows: int | None,
        width: int,
        ssd: BackingStore,
        init: RowInit | None = None,
        *,
        capacity_bytes: int | None = None,
        lru_fraction: float = DEFAULT_LRU_FRACTION,
        aging: float | None = DEFAULT_AGING,
        history: float | None = DEFAULT_HISTORY,
        stats_history: int = 4096,
    ) -> None:
        if (capacity_rows is None) == (capacity_bytes is None):
            raise ValueError("give exactly one of capacity_rows and capacity_bytes")
        if capacity_rows is None:
            assert capacity_bytes is not None
            capacity_rows = rows_for_bytes(int(capacity_bytes), width, history)
        if capacity_rows < 1:
            raise ValueError(f"capacity_rows must be >= 1, got {capacity_rows}")
        if ssd.width != width:
            raise ValueError(f"MEM-PS width {width} differs from its store's width {ssd.width}")
        self.width = int(width)
        self.capacity = int(capacity_rows)
        self.init = init or RowInit(dim=0, scale=0.0)
        if self.init.dim > width:
            raise ValueError(f"init.dim={self.init.dim} exceeds row width {width}")
        self.ssd = ssd
        self._table = CpuHashTable(self.capacity, self.width)
        self._policy = LruLfuPolicy(self.capacity, lru_fraction, aging, history)
        self._slot_key = np.full(self.capacity, EMPTY_KEY, dtype=np.uint64)
        self._dirty = np.zeros(self.capacity, dtype=bool)
        self._reserved = np.zeros(self.capacity, dtype=bool)  # resident, its row not given yet
        self._pins: dict[Hashable, list[np.ndarray]] = {}
        self._batch_stats: OrderedDict[Hashable, dict] = OrderedDict()
        self._history = int(stats_history)
        self._lock = threading.RLock()
        self._totals = {
            "pulls": 0,
            "hits": 0,
            "misses": 0,
            "loaded": 0,
            "initialised": 0,
            "evicted": 0,
            "evicted_dirty": 0,
            "write_backs": 0,
            "rows_written_back": 0,
            "flushed": 0,
            "dropped": 0,
            "recovered": 0,
            "reserved": 0,
        }

    # -- the batch cycle -----------------------------------------------------------------

    def pull(
        self, batch_id: Hashable, keys: ArrayLike, held: np.ndarray | None = None, compact: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pin the distinct sorted ``keys`` for ``batch_id``: ``(rows, missing)``, where
        ``rows[missing]`` are zeros the caller must fill with the store's rows (initial rows for
        keys it never stored): the load stage's job. Room is made by evicting unpinned rows.
        Raises :class:`CapacityError` (changing nothing) when the rows pinned by in-flight
        batches plus this batch's misses exceed the capacity. May be called more than once per
        batch id.

        A missing key gets a *reserved* slot: resident and pinned, but with no row until
        :meth:`write_back` (or :meth:`store_kept`) gives it one; a reserved row is never dumped
        (the store already holds its newest value), :meth:`peek` refuses it and a later
        ``pull`` names it missing again. Keys whose dump or delete the store still has in
        flight (``store.in_flight``) are not missing: their rows come from there. Resident keys
        flagged ``held`` (their borrower holds the newest row) are never missing: they count
        as hits. With ``compact`` (and ``held``), ``rows`` are only those of the keys not held,
        in key order (``missing`` still counts positions among all ``keys``): a held row is
        never gathered.
        """
        keys = as_keys(keys)
        if not is_sorted_distinct(keys):
            raise ValueError("pull: keys must be sorted and distinct")
        with self._lock:
            slots, missing = self._take(batch_id, keys, held)
            if compact and held is not None:
                shipped = ~held
                rows = self._table.gather(slots[shipped])
                if missing.size:  # a held key is never missing
                    rows[(np.cumsum(shipped) - 1)[missing]] = 0.0
                return rows, missing
            rows = self._table.gather(slots)
            if missing.size:
                rows[missing] = 0.0
            return rows, missing

    def _take(
        self, batch_id: Hashable, uk: np.ndarray, held: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pin the sorted distinct ``uk`` for ``batch_id``: ``(slots, missing positions)``."""
        slots = self._table.find(uk)
        hit = slots >= 0
        hit_slots = slots[hit]
        miss_keys = uk[~hit]
        m = miss_keys.size
        need = self._table.size + m - self.capacity
        policy = self._policy
        if need > 0 and need > policy.evictable(hit_slots):
            pinned = policy.n_pinned + int(np.count_nonzero(policy.pins[hit_slots] == 0))
            raise CapacityError(
                f"MEM-PS capacity {self.capacity} rows: batch {batch_id!r} needs {uk.size} distinct rows "
                f"({m} not resident), {policy.n_pinned} rows are pinned by in-flight batches "
                f"{list(self._pins)[:8]}, so {pinned + m} rows would have to be held; "
                "raise the capacity or keep fewer batches in flight"
            )
        policy.touch(hit_slots, uk[hit])
        policy.pin(hit_slots)
        unfilled = np.flatnonzero(hit)[self._reserved[hit_slots]]  # resident, no row yet
        if held is not None and unfilled.size:
            unfilled = unfilled[~held[unfilled]]  # its borrower holds the row: nothing to load
        try:
            recovered = 0
            absent = np.zeros(0, np.int64)  # positions in miss_keys the store must give
            if m:
                victims = policy.make_room(max(need, 0), incoming=m)
                self._evict(victims)
                rows, known = self._in_flight(miss_keys)
                recovered = int(np.count_nonzero(known))
                absent = np.flatnonzero(~known)
                new_slots = self._table.find_or_insert(miss_keys, initialise=False)  # overwritten below
                self._table.put(new_slots, rows)
                self._slot_key[new_slots] = miss_keys
                self._dirty[new_slots] = False
                self._reserved[new_slots] = False
                self._reserved[new_slots[absent]] = True
                policy.touch(new_slots, miss_keys)
                policy.pin(new_slots)
                slots[~hit] = new_slots
        except BaseException:
            policy.unpin(hit_slots)
            raise
        self._pins.setdefault(batch_id, []).append(slots)
        misses = m - recovered + int(unfilled.size)
        self._count(batch_id, hits=uk.size - misses, misses=misses, loaded=0, initialised=0)
        self._totals["pulls"] += 1
        self._totals["recovered"] += recovered
        self._totals["reserved"] += int(absent.size)
        missing = np.sort(np.concatenate([np.flatnonzero(~hit)[absent], unfilled]))
        return slots, missing

    def _in_flight(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` the store is still writing (``store.in_flight``, when it has one):
        ``(rows, known)``; a key whose delete is in flight gets its initial row."""
        rows = np.zeros((keys.size, self.width), np.float32)
        probe = getattr(self.ssd, "in_flight", None)
        if probe is None:
            return rows, np.zeros(keys.size, bool)
        got, found, deleted = probe(keys)
        if found.any():
            rows[found] = got[found]
        if deleted.any():
            rows[deleted] = initial_rows(keys[deleted], self.width, self.init)
        return rows, found | deleted

    def write_back(self, batch_id: Hashable, keys: ArrayLike, rows: ArrayLike) -> None:
        """Store the updated ``rows`` of ``keys`` (all pulled by ``batch_id`` and still pinned);
        the last duplicate wins. The rows become dirty: eviction will write them to SSD-PS."""
        keys = as_keys(keys)
        rows = as_rows(rows, keys.size, self.width, "write_back rows")
        with self._lock:
            held = self._pins.get(batch_id)
            if held is None:
                raise KeyError(f"write_back: batch {batch_id!r} has no pinned rows (never pulled, or unpinned)")
            slots = self._table.find(keys)
            bad = slots < 0
            if not bad.any():
                bad = ~np.isin(slots, np.concatenate(held))
            if bad.any():
                raise KeyError(
                    f"write_back: {int(bad.sum())} of {keys.size} keys were not pulled by batch {batch_id!r} "
                    f"(first: {int(keys[np.argmax(bad)])})"
                )
            self._table.put(slots, rows)  # found above: no second probe
            self._dirty[slots] = True
            self._reserved[slots] = False
            self._totals["write_backs"] += 1
            self._totals["rows_written_back"] += int(keys.size)

    def store_kept(self, keys: ArrayLike, rows: ArrayLike) -> np.ndarray:
        """Give the resident ``keys`` their ``rows`` whatever pins them (a trainer's flush of
        rows it kept across batch ends); returns which were resident. The rows become dirty."""
        keys = as_keys(keys)
        rows = as_rows(rows, keys.size, self.width, "store_kept rows")
        with self._lock:
            slots = self._table.find(keys)
            placed = slots >= 0
            if placed.any():
                at = slots[placed]
                self._table.put(at, rows[placed])
                self._dirty[at] = True
                self._reserved[at] = False
            return placed

    def unpin(self, batch_id: Hashable) -> None:
        """Release the pins of ``batch_id``; its rows become evictable (LRU order)."""
        with self._lock:
            held = self._pins.pop(batch_id, None)
            if held is None:
                raise KeyError(f"unpin: batch {batch_id!r} has no pinned rows")
            for slots in held:
                self._policy.unpin(slots)

    def drop(self, keys: ArrayLike) -> int:
        """Forget the resident rows of ``keys`` without writing them (expired keys, whose rows
        the caller also deletes from SSD-PS); absent keys are skipped. Returns the rows dropped.
        Raises ``ValueError`` (changing nothing) when one of them is pinned by a batch in flight."""
        keys = as_keys(keys)
        with self._lock:
            slots = self._table.find(keys)
            slots = slots[slots >= 0]
            if slots.size == 0:
                return 0
            pinned = self._policy.pins[slots] > 0
            if pinned.any():
                raise ValueError(
                    f"drop: {int(pinned.sum())} of {keys.size} keys are pinned by batches in flight "
                    f"{list(self._pins)[:8]} (first: {int(self._slot_key[slots[np.argmax(pinned)]])})"
                )
            self._table.erase(self._slot_key[slots])
            self._policy.release(slots)  # forgotten: a later return starts afresh
            self._slot_key[slots] = EMPTY_KEY
            self._dirty[slots] = False
            self._reserved[slots] = False
            self._totals["dropped"] += int(slots.size)
            return int(slots.size)

    # -- eviction and flushing -----------------------------------------------------------

    def _evict(self, victims: np.ndarray) -> None:
        if victims.size == 0:
            return
        dirty = victims[self._dirty[victims]]
        if dirty.size:
            dirty = dirty[np.argsort(self._slot_key[dirty])]  # in key order: no store reorders a copy
            self.ssd.dump(self._slot_key[dirty], self._table.gather(dirty))  # before release
        self._table.erase(self._slot_key[victims])
        self._policy.release(victims, self._slot_key[victims])
        self._slot_key[victims] = EMPTY_KEY
        self._dirty[victims] = False
        self._reserved[victims] = False  # never dumped: the store holds its newest row
        self._totals["evicted"] += int(victims.size)
        self._totals["evicted_dirty"] += int(dirty.size)

    def flush(self) -> int:
        """Write every dirty row (pinned ones included) to SSD-PS, in key order, in writes of at
        most :data:`FLUSH_CHUNK_BYTES` of rows; rows stay resident. Returns the number of rows
        written."""
        with self._lock:
            dirty = np.flatnonzero(self._dirty)
            dirty = dirty[np.argsort(self._slot_key[dirty])]
            chunk = max(1, FLUSH_CHUNK_BYTES // max(1, 4 * self.width))
            for i in range(0, dirty.size, chunk):
                part = dirty[i : i + chunk]
                self.ssd.dump(self._slot_key[part], self._table.gather(part))
                self._dirty[part] = False
            self._totals["flushed"] += int(dirty.size)
            return int(dirty.size)

    # -- inspection ----------------------------------------------------------------------

    def peek(self, keys: ArrayLike) -> np.ndarray:
        """Current rows of resident ``keys`` without touching replacement state (e.g. to
        re-read a prefetched batch's rows after the previous batch's write-back)."""
        keys = as_keys(keys)
        with self._lock:
            slots = self._table.find(keys)
            if slots.size and slots.min() < 0:
                raise KeyError(
                    f"peek: {int((slots < 0).sum())} of {keys.size} keys are not resident "
                    f"(first: {int(keys[np.argmax(slots < 0)])})"
                )
            unfilled = self._reserved[slots]
            if unfilled.any():
                raise KeyError(
                    f"peek: {int(unfilled.sum())} of {keys.size} keys are reserved for a load still "
                    f"under way (first: {int(keys[np.argmax(unfilled)])})"
                )
            return self._table.gather(slots)

    def contains(self, keys: ArrayLike) -> np.ndarray:
        """Whether each key is resident."""
        keys = as_keys(keys)
        with self._lock:
            return self._table.find(keys) >= 0

    def has_rows(self, keys: ArrayLike) -> np.ndarray:
        """Whether each key is resident with its row (not reserved for a load under way)."""
        keys = as_keys(keys)
        with self._lock:
            slots = self._table.find(keys)
            out = slots >= 0
            out[out] = ~self._reserved[slots[out]]
            return out

    def pinned(self, keys: ArrayLike) -> np.ndarray:
        """Whether each key is resident and pinned by some in-flight batch."""
        keys = as_keys(keys)
        with self._lock:
            slots = self._table.find(keys)
            out = slots >= 0
            out[out] = self._policy.pins[slots[out]] > 0
            return out

    @property
    def size(self) -> int:
        """Resident rows."""
        return self._table.size

    def __len__(self) -> int:
        return self.size

    @property
    def in_flight(self) -> list:
        """Batch ids holding pins."""
        with self._lock:
            return list(self._pins)

    def _count(self, batch_id: Hashable, **kv: int) -> None:
        s = self._batch_stats.get(batch_id)
        if s is None:
            s = self._batch_stats[batch_id] = {"hits": 0, "misses": 0, "loaded": 0, "initialised": 0}
            while len(self._batch_stats) > self._history:
                self._batch_stats.popitem(last=False)
        for k, v in kv.items():
            s[k] += v
            self._totals[k] += v

    def batch_stats(self, batch_id: Hashable) -> dict:
        """``hits``, ``misses`` (of which ``loaded`` from SSD-PS, ``initialised`` new) and
        ``hit_rate`` of one batch (distinct keys)."""
        with self._lock:
            s = dict(self._batch_stats[batch_id])
        total = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / total if total else 0.0
        return s

    @property
    def stats(self) -> dict:
        """Totals since creation plus current occupancy (rows, pinned rows, LRU/LFU split)."""
        with self._lock:
            t: dict = dict(self._totals)
            total = t["hits"] + t["misses"]
            p = self._policy
            t.update(
                hit_rate=t["hits"] / total if total else 0.0,
                capacity=self.capacity,
                size=self.size,
                pinned_rows=p.n_pinned,
                batches_in_flight=len(self._pins),
                lru_rows=p.n_lru,
                lfu_rows=p.n_lfu,
                dirty_rows=int(np.count_nonzero(self._dirty)),
                reserved_rows=int(np.count_nonzero(self._reserved)),
            )
            return t

    def close(self, flush: bool = True) -> None:
        """Flush dirty rows (unless ``flush=False``). The SSD-PS is not closed."""
        if flush:
            self.flush()

    def __repr__(self) -> str:
        return f"MemPS(capacity={self.capacity}, width={self.width}, rows={self.size}, in_flight={len(self._pins)})"
