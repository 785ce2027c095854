"""The device-driven lookup: the device dedupes the batch, probes the tiers and gathers the rows itself.

Written once in the array module ``xp`` (CuPy on a GPU, NumPy on the CPU, where CI runs the same
lines). Contract, per request batch (:meth:`DeviceDrivenLookup.layout` then
:meth:`DeviceDrivenLookup.rows`): one upload of the keys and one count read (how many distinct
keys) for the layout; for the rows, one download (the keys both tiers missed, their count in the
same copy) and, when any missed, one upload of their rows; no other host sync: every array has a
size the host knows (masks become ``where``, compaction a stable sort whose head is cut at the
downloaded count, a scatter of the rows a tier does not hold goes to a spare slot past its
last). The rows equal the model's (device tier, host tier over the bus, then SSD for the keys
both missed, unseen keys their initial rows); every host-device copy is counted in
``stats()["transfers"]``. The tiers, their directories
and admission: docs/serving.md, How a request is answered (GPU, device-driven).
"""

from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Any

import numpy as np

from hpsray.data.batch import Batch
from hpsray.kernels.arrays import distinct_inverse, to_host
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.models.pooling import BagLayout
from hpsray.serving.cache import WAYS
from hpsray.serving.pointstore import PointStore
from hpsray.serving.uva import device_view, gather_rows, gather_rows_host, host_arena, release_view

__all__ = ["DeviceDrivenLookup", "Directory", "Transfers", "device_layout", "on_device"]


class Transfers:
    """Host↔device copies of one lookup, counted by what they carry (``keys``, ``miss_keys``,
    ``rows``, ``dense``, ``probabilities``). With NumPy nothing crosses a bus, but the same
    calls are made, so the counts are those a GPU would see."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp
        self.h2d: Counter[str] = Counter()
        self.d2h: Counter[str] = Counter()

    def to_device(self, a: np.ndarray, what: str) -> Any:
        self.h2d[what] += 1
        return self.xp.asarray(a)

    def to_host(self, x: Any, what: str) -> np.ndarray:
        self.d2h[what] += 1
        return np.asarray(to_host(x))  # a plain host array, whatever array type stood for the device

    def stats(self) -> dict:
        return {"host_to_device": dict(self.h2d), "device_to_host": dict(self.d2h)}


def on_device(xp: ModuleType) -> bool:
    """Whether ``xp`` keeps its arrays on a CUDA device (CuPy), not in host memory (NumPy)."""
    return xp.__name__.split(".", 1)[0] == "cupy"


def device_layout(batch: Batch, xp: ModuleType, transfers: Transfers) -> BagLayout:
    """The batch's :class:`BagLayout` computed in ``xp`` after one upload of its keys, slots and
    offsets (packed in one ``uint64`` buffer); equal to ``BagLayout.of(batch)``. One count read:
    the number of distinct keys (:func:`~hpsray.kernels.arrays.distinct_inverse`)."""
    nnz, b, n_slots = batch.nnz, len(batch), batch.n_slots
    packed = np.empty(2 * nnz + b + 1, np.uint64)
    packed[:nnz] = batch.keys
    packed[nnz : 2 * nnz] = batch.slots
    packed[2 * nnz :] = batch.offsets
    d = transfers.to_device(packed, "keys")
    keys = d[:nnz]
    slots = d[nnz : 2 * nnz].astype(xp.int64)
    offsets = d[2 * nnz :].astype(xp.int64)
    example = xp.searchsorted(offsets[1:], xp.arange(nnz, dtype=xp.int64), side="right")
    bag = example * n_slots + slots
    order = xp.argsort(bag, kind="stable")  # keys by bag; an example's keys need not come in slot order
    unique_keys, inverse = distinct_inverse(xp, keys[order])
    n_bags = b * n_slots
    # each bag's first key among the keys sorted by bag (CuPy's bincount reads the largest value back)
    bag_offsets = xp.searchsorted(bag[order], xp.arange(n_bags, dtype=xp.int64), side="left").astype(xp.int64)
    return BagLayout(unique_keys, inverse, bag_offsets, b, n_slots)


class Directory:
    """Which key sits in which of ``capacity`` slots, in ``xp`` arrays (on the device on a GPU).

    Sets of :data:`WAYS` entries, a key's set ``key % n_sets``; an 8-bit use count per entry.
    Hits and lookups are counted on the device (read by :meth:`counts`, not per batch). One spare
    entry past the last (:attr:`spare`) takes the writes meant for no entry, so that every write
    is a fixed-size scatter (no mask whose size the host must learn).
    """

    def __init__(self, capacity: int, xp: ModuleType) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.xp = xp
        self.n_sets = -(-capacity // WAYS) if capacity else 0
        n = self.n_sets * WAYS
        self.spare = n  # never an entry of a set: no key is ever found there
        self.keys = xp.full(n + 1, EMPTY_KEY, dtype=xp.uint64)
        self.uses = xp.zeros(n + 1, dtype=xp.uint8)
        self._ways = xp.arange(WAYS, dtype=xp.int64)
        self._hits = xp.zeros((), dtype=xp.int64)
        self._lookups = xp.zeros((), dtype=xp.int64)

    @property
    def capacity(self) -> int:
        return self.n_sets * WAYS

    def counts(self) -> tuple[int, int]:
        """``(hits, lookups)`` so far."""
        return int(self._hits), int(self._lookups)

    def _entries(self, keys: Any) -> Any:
        base = (keys % self.xp.uint64(self.n_sets)).astype(self.xp.int64) * WAYS
        return base[:, None] + self._ways[None, :]

    def locate(self, keys: Any) -> Any:
        """``int64[n]``: each key's slot, ``-1`` where absent (counts untouched)."""
        xp = self.xp
        if not self.n_sets:
            return xp.full(keys.shape[0], -1, dtype=xp.int64)
        entries = self._entries(keys)
        match = self.keys[entries] == keys[:, None]
        return xp.where(match.any(axis=1), entries[xp.arange(keys.shape[0]), match.argmax(axis=1)], -1)

    def probe(self, keys: Any, active: Any = None) -> Any:
        """:meth:`locate` for distinct keys, bumping each hit's count and counting the hits;
        ``active`` (bool per key): only those are looked up, the others get ``-1``."""
        xp = self.xp
        slots = self.locate(keys)
        if active is not None:
            slots = xp.where(active, slots, -1)
            self._lookups += active.sum()
        else:
            self._lookups += keys.shape[0]
        if self.n_sets:
            hit = slots >= 0
            at = xp.where(hit, slots, self.spare)
            self.uses[at] += (hit & (self.uses[at] < 255)).astype(xp.uint8)  # distinct keys: distinct entries
            self._hits += hit.sum()
        return slots

    def admit(self, keys: Any, active: Any = None) -> Any:
        """Offer distinct keys none of which is held (``active``: only those marked); ``int64[n]``:
        the slot each was given, ``-1`` where turned away or not offered. A set takes keys into
        its free entries (use count 0); a full set ages its entries by the keys it turned away."""
        xp = self.xp
        n = keys.shape[0]
        if not self.n_sets or not n:
            return xp.full(n, -1, dtype=xp.int64)
        sets = (keys % xp.uint64(self.n_sets)).astype(xp.int64)
        if active is not None:
            sets = xp.where(active, sets, self.n_sets)  # a set past the last: sorted last, given nothing
        order = xp.argsort(sets, kind="stable")
        s = sets[order]
        offered = s < self.n_sets
        first = xp.searchsorted(s, s, side="left")
        size = xp.searchsorted(s, s, side="right") - first
        rank = xp.arange(n, dtype=xp.int64) - first  # place among this batch's keys of the set
        entries = xp.minimum(s, self.n_sets - 1)[:, None] * WAYS + self._ways[None, :]
        free = self.uses[entries] == 0
        n_free = free.sum(axis=1)
        take = offered & (rank < n_free)
        way = ((xp.cumsum(free, axis=1) == (rank + 1)[:, None]) & free).argmax(axis=1)
        slot = xp.where(take, s * WAYS + way, -1)
        at = xp.where(take, slot, self.spare)  # the spare stays empty, its count 0
        self.keys[at] = xp.where(take, keys[order], xp.uint64(EMPTY_KEY))
        self.uses[at] = take.astype(xp.uint8)
        full = offered & (rank == 0) & (n_free == 0)  # one row per full set: age it by the keys it turned away
        aged = xp.where(full[:, None], entries, self.spare)
        by = xp.where(full, size, 0)[:, None]
        self.uses[aged] = xp.maximum(self.uses[aged].astype(xp.int64) - by, 0).astype(xp.uint8)
        out = xp.empty(n, dtype=xp.int64)
        out[order] = slot
        return out


class _Tier:
    """A directory and its rows (``float32[slots + 1, dim]``, natural stride; the last row is the
    directory's spare entry)."""

    def __init__(self, capacity: int, dim: int, xp: ModuleType, rows: Any) -> None:
        self.directory = Directory(capacity, xp)
        self.rows = rows
        self.xp = xp
        self.kernel = on_device(xp)  # the device gather; NumPy's twin on the CPU

    def gather(self, slots: Any, out: Any) -> None:
        """``out[i] = rows[slots[i]]`` where ``slots[i] >= 0``; other rows of ``out`` untouched."""
        dst = self.xp.arange(slots.shape[0], dtype=self.xp.int64)
        if self.kernel:
            gather_rows(self.rows, slots, dst, out, out.shape[1])
        else:
            gather_rows_host(self.rows, slots, dst, out)


class DeviceDrivenLookup:
    """Device tier + registered host tier + SSD, driven from the device; see the module docstring.

    ``capacity``: rows of the host tier; ``device_rows``: rows of the device tier; ``xp``: the
    array module (NumPy: the same lines on the CPU); ``warm_from``: the lookup of the model served
    before, whose keys both tiers start with, their rows re-read from ``store``.
    """

    def __init__(
        self,
        store: PointStore,
        capacity: int,
        init: RowInit,
        device_rows: int,
        xp: ModuleType = np,
        warm_from: DeviceDrivenLookup | None = None,
    ) -> None:
        self.store, self.dim, self.init, self.xp = store, store.dim, init, xp
        self.transfers = Transfers(xp)
        capacity, device_rows = min(capacity, len(store)), min(device_rows, len(store))
        dim = store.dim
        n_dev = -(-device_rows // WAYS) * WAYS
        self.device = _Tier(device_rows, dim, xp, xp.zeros((n_dev + 1, dim), dtype=xp.float32))
        n_host = -(-capacity // WAYS) * WAYS
        self.arena = host_arena(n_host + 1, dim)  # host memory the device reads and writes in place
        self.host = _Tier(capacity, dim, xp, device_view(self.arena) if on_device(xp) else self.arena)
        self.reader = store.block_reader()
        from hpsray.serving.gds import kvikio_available

        self.kvikio = on_device(xp) and kvikio_available()
        self.ssd_reads = self.unseen = self.carried = 0
        self._staging = np.empty((0, dim), np.float32)
        if warm_from is not None:
            self.carried = self._carry(self.host, warm_from.host) + self._carry(self.device, warm_from.device)

    def layout(self, batch: Batch) -> BagLayout:
        """The batch's layout on the device (:func:`device_layout`)."""
        return device_layout(batch, self.xp, self.transfers)

    def _staged(self, m: int) -> np.ndarray:
        """A host buffer of ``m`` rows, pinned on a GPU, reused across batches."""
        if self._staging.shape[0] < m:
            n = max(m, 2 * self._staging.shape[0])
            if on_device(self.xp):
                import cupyx

                self._staging = cupyx.empty_pinned((n, self.dim), np.float32)
            else:
                self._staging = np.empty((n, self.dim), np.float32)
        return self._staging[:m]

    def _read_misses(self, keys: np.ndarray) -> Any:
        """Rows of host keys the tiers missed, on the device: SSD rows, initial rows for unseen keys."""
        xp = self.xp
        pos = self.store.find(keys)
        found = pos >= 0
        idx = np.flatnonzero(found)
        self.ssd_reads += int(idx.size)
        self.unseen += int(keys.size - idx.size)
        if self.kvikio:
            rows = xp.empty((keys.size, self.dim), dtype=xp.float32)
            if idx.size:
                rows[self.transfers.to_device(idx, "rows")] = self.reader.read_device(pos[idx], xp)
            if idx.size < keys.size:
                lost = np.flatnonzero(~found)
                rows[xp.asarray(lost)] = self.transfers.to_device(initial_rows(keys[lost], self.dim, self.init), "rows")
            return rows
        staged = self._staged(keys.size)
        if idx.size:
            self.reader.read_into(pos[idx], staged, idx)
        if idx.size < keys.size:
            lost = np.flatnonzero(~found)
            staged[lost] = initial_rows(keys[lost], self.dim, self.init)
        return self.transfers.to_device(staged, "rows")

    def rows(self, unique_keys: Any) -> Any:
        """``float32[U, dim]`` in ``xp``: the rows of the distinct keys (``xp`` arrays), through the tiers.

        Host syncs: one download (the missed keys, their count in the same copy), one upload of
        their rows when any missed; every other array has a size the host knows."""
        xp = self.xp
        n = unique_keys.shape[0]
        out = xp.empty((n, self.dim), dtype=xp.float32)
        dslots = self.device.directory.probe(unique_keys)
        self.device.gather(dslots, out)
        rest = dslots < 0
        hslots = self.host.directory.probe(unique_keys, active=rest)
        self.host.gather(hslots, out)
        miss = rest & (hslots < 0)
        order = xp.argsort((~miss).astype(xp.int8), kind="stable")  # the missed keys first, in key order
        packed = xp.empty(n + 1, dtype=xp.uint64)
        packed[:1] = miss.sum(keepdims=True)  # a device copy: no value read on the host
        packed[1:] = unique_keys[order]
        down = self.transfers.to_host(packed, "miss_keys")
        n_miss = int(down[0])
        if n_miss:
            at = order[:n_miss]
            rows = self._read_misses(down[1 : 1 + n_miss])
            out[at] = rows
            admitted = self.host.directory.admit(unique_keys[at])
            into = xp.where(admitted >= 0, admitted, self.host.directory.spare)
            self.host.rows[into] = rows  # the device writes the host arena
        promoted = self.device.directory.admit(unique_keys, active=rest)
        into = xp.where(promoted >= 0, promoted, self.device.directory.spare)
        self.device.rows[into] = out
        return out

    def _carry(self, tier: _Tier, old: _Tier) -> int:
        """Take over ``old``'s keys, their rows read from this model's store; returns the keys carried."""
        xp, d = self.xp, old.directory
        if not tier.directory.n_sets or not d.n_sets:
            return 0
        held = self.transfers.to_host(d.keys, "carry")
        slots = np.flatnonzero(held != EMPTY_KEY)
        found, rows = self.store.lookup(held[slots])
        slots, rows = slots[found], rows[found]
        if d.n_sets == tier.directory.n_sets:
            at = xp.asarray(slots)
            tier.directory.keys[at] = d.keys[at]
            tier.directory.uses[at] = d.uses[at]
        else:
            order = np.argsort(self.transfers.to_host(d.uses, "carry")[slots], kind="stable")[::-1]  # hottest first
            slots, rows = slots[order], rows[order]
            at = tier.directory.admit(xp.asarray(held[slots]))
            keep = self.transfers.to_host(at, "carry") >= 0
            at, rows = at[xp.asarray(keep)], rows[keep]
        tier.rows[at] = xp.asarray(rows)
        return int(at.shape[0])

    def stats(self) -> dict:
        dh, dn = self.device.directory.counts()
        hh, hn = self.host.directory.counts()
        return {
            "mode": "device-driven",
            "array_module": self.xp.__name__,
            "rows_on_device": self.device.directory.capacity,
            "rows_in_memory": self.host.directory.capacity,
            "rows_on_ssd": len(self.store),
            "lookups": dn,
            "device_hits": dh,
            "host_hits": hh,
            "hits": dh + hh,
            "hit_rate": (dh + hh) / dn if dn else 0.0,
            "ssd_reads": self.ssd_reads,
            "ssd_path": "kvikio" if self.kvikio else "preadv",
            "reads_per_missed_row": self.reader.reads_per_row,
            "unseen": self.unseen,
            "carried": self.carried,
            "row_bytes_in_memory": int(self.arena.strides[0]),
            "transfers": self.transfers.stats(),
        }

    def close(self) -> None:
        """Unregister the host arena and close the reader."""
        if on_device(self.xp):
            release_view(self.host.rows)
        self.reader.close()
