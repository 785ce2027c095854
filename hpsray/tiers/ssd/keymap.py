"""SSD-PS key map (where each key's newest row lives) and recovery (rebuilding it on open).

The map is one open-addressing hash table of its own (linear probing, backward-shift deletion):
three arrays indexed by the same *index slot* — the key (``uint64``), the *file slot* of the
file holding its row (``int32``, see :class:`~hpsray.tiers.ssd.files.FileTable`) and the row's
position in that file (``int32``) — 16 bytes per slot. The table grows by half when it is
:data:`MAX_LOAD` full, so it holds 20–30 bytes per key (:attr:`KeyMap.bytes_per_key`); recovery
and bulk loads size it once for the keys they place (20 bytes per key). Slots stay valid until
the next insert or removal, which callers do under the store's lock. Recovery rebuilds it from
the manifest's live files and their key/version indexes, file by file in one numba pass each:
the highest version of a key wins, so a compacted copy never shadows a newer dump written while the compaction ran.

A deleted key's newest entry is a *tombstone* (a row in a file flagged
:data:`~hpsray.tiers.ssd.paramfile.FLAG_TOMBSTONE`): when it wins, the key is not mapped. A
tombstone file lives while some file that may hold an older copy of its keys does (its
*dependencies*); recovery finds them exactly (the files holding the entries it beat).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import njit

from hpsray.errors import CorruptFileError
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.prefetch import prefetch as _prefetch
from hpsray.kernels.table import readonly
from hpsray.tiers.ssd.files import FileTable
from hpsray.tiers.ssd.manifest import NAME as MANIFEST_NAME
from hpsray.tiers.ssd.manifest import Manifest
from hpsray.tiers.ssd.paramfile import (
    FLAG_TOMBSTONE,
    HEADER_BYTES,
    PARTIAL_VERSIONS,
    TMP_SUFFIX,
    decode_header,
    file_name,
    parse_file_name,
    read_index,
)

__all__ = ["MAX_LOAD", "KeyMap", "map_bytes", "recover"]

MAX_LOAD = 0.8
"""Most keys per index slot; beyond it the table grows by half (so 0.53–0.8 full: 20–30 bytes per
key). Linear probing at 0.8 takes ~3 probes to find a key, ~13 to find it absent."""
GROWTH = 1.5

_EMPTY = np.uint64(EMPTY_KEY)  # as_keys refuses it as a key
_AHEAD = 32  # keys looked up ahead: their slots are prefetched, so cache misses overlap
_MIN_CAPACITY = 1024


@njit(cache=True, nogil=True, inline="always")
def _home(key, cap):
    """Bucket of ``key``: a 64-bit finaliser (murmur3's), so sequential keys spread out, scaled
    to the capacity by a multiply (Lemire's reduction: any capacity below 2**32, so the table
    can grow by half, not by doubling)."""
    h = key ^ (key >> np.uint64(33))
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return ((h >> np.uint64(32)) * cap) >> np.uint64(32)  # in [0, cap) for cap < 2**32, no division


@njit(cache=True, nogil=True, inline="always")
def _next(b, cap):
    b += np.uint64(1)
    return np.uint64(0) if b == cap else b


@njit(cache=True, nogil=True, parallel=True)
def _find(tkeys, cap, keys, out):
    n = keys.size
    for i in numba.prange(n):
        if i + _AHEAD < n:
            _prefetch(tkeys, _home(keys[i + _AHEAD], cap))
        k = keys[i]
        b = _home(k, cap)
        while True:
            t = tkeys[b]
            if t == k:
                out[i] = b
                break
            if t == _EMPTY:
                out[i] = -1
                break
            b = _next(b, cap)


@njit(cache=True, nogil=True, parallel=True)
def _locate(tkeys, tfs, tpos, cap, keys, fs, ps):
    n = keys.size
    for i in numba.prange(n):
        if i + _AHEAD < n:
            h = _home(keys[i + _AHEAD], cap)
            _prefetch(tkeys, h)
            _prefetch(tfs, h)
            _prefetch(tpos, h)
        k = keys[i]
        b = _home(k, cap)
        while True:
            t = tkeys[b]
            if t == k:
                fs[i] = tfs[b]
                ps[i] = tpos[b]
                break
            if t == _EMPTY:
                fs[i] = -1
                ps[i] = 0
                break
            b = _next(b, cap)


@njit(cache=True, nogil=True)
def _place(tkeys, tfs, tpos, cap, keys, fs, pos, out):
    """Find or insert each key, then set its location; returns the keys inserted."""
    new = 0
    n = keys.size
    for i in range(n):
        if i + _AHEAD < n:
            h = _home(keys[i + _AHEAD], cap)
            _prefetch(tkeys, h)
            _prefetch(tfs, h)
            _prefetch(tpos, h)
        k = keys[i]
        b = _home(k, cap)
        while True:
            t = tkeys[b]
            if t == k:
                break
            if t == _EMPTY:
                tkeys[b] = k
                new += 1
                break
            b = _next(b, cap)
        tfs[b] = fs[i]
        tpos[b] = pos[i]
        out[i] = b
    return new


@njit(cache=True, nogil=True)
def _remove(tkeys, tfs, tpos, cap, keys, gone_fs, gone):
    """Remove each present key (backward-shift deletion: the entries after it in its probe run
    move back, so no tombstone markers are needed); returns the keys removed."""
    n = 0
    for i in range(keys.size):
        k = keys[i]
        b = _home(k, cap)
        while tkeys[b] != k and tkeys[b] != _EMPTY:
            b = _next(b, cap)
        if tkeys[b] == _EMPTY:
            continue
        gone[i] = True
        gone_fs[i] = tfs[b]
        n += 1
        hole = b
        j = _next(b, cap)
        while tkeys[j] != _EMPTY:
            home = _home(tkeys[j], cap)
            # the entry at j may fill the hole when its home is not in the cyclic range (hole, j]
            if (j + cap - home) % cap >= (j + cap - hole) % cap:
                tkeys[hole], tfs[hole], tpos[hole] = tkeys[j], tfs[j], tpos[j]
                hole = j
            j = _next(j, cap)
        tkeys[hole] = _EMPTY
        tfs[hole] = -1
        tpos[hole] = 0
    return n


@njit(cache=True, nogil=True)
def _rehash(okeys, ofs, opos, tkeys, tfs, tpos, cap):
    for i in range(okeys.size):
        k = okeys[i]
        if k == _EMPTY:
            continue
        b = _home(k, cap)
        while tkeys[b] != _EMPTY:
            b = _next(b, cap)
        tkeys[b], tfs[b], tpos[b] = k, ofs[i], opos[i]


@njit(cache=True, nogil=True)
def _recover_file(tkeys, tfs, tpos, tver, cap, keys, vers, fslot):
    """Merge one file's index into the map: a key's entry wins over the mapped one when its
    version is at least as high (files come in ascending number, so of equal versions, copies
    of the same value, the later file's wins). Returns the keys inserted."""
    new = 0
    for i in range(keys.size):
        k = keys[i]
        v = vers[i]
        b = _home(k, cap)
        while True:
            t = tkeys[b]
            if t == _EMPTY:
                tkeys[b] = k
                tver[b] = v
                tfs[b] = fslot
                tpos[b] = i
                new += 1
                break
            if t == k:
                if v >= tver[b]:
                    tver[b] = v
                    tfs[b] = fslot
                    tpos[b] = i
                break
            b = _next(b, cap)
    return new


@njit(cache=True, nogil=True)
def _beaten_by_tombstones(tkeys, tfs, cap, keys, fslot, tomb_of, deps):
    """``deps[t, fslot] = True`` when a key of this (row) file is mapped to tombstone file ``t``
    (``tomb_of[file slot]``, -1 for row files): this file holds an older copy of a deleted key."""
    for i in range(keys.size):
        k = keys[i]
        b = _home(k, cap)
        while tkeys[b] != k:
            b = _next(b, cap)
        t = tomb_of[tfs[b]]
        if t >= 0:
            deps[t, fslot] = True


def _capacity_for(n: int) -> int:
    """Index slots for ``n`` keys at :data:`MAX_LOAD` (at least :data:`_MIN_CAPACITY`)."""
    cap = max(_MIN_CAPACITY, int(np.ceil(n / MAX_LOAD)) + 1)
    if cap >= 1 << 32:
        raise ValueError(f"SSD-PS key map: {n} keys in one store exceed its 2**32 index slots; use more nodes")
    return cap


def map_bytes(n: int, grown_from: int | None = None) -> tuple[int, int]:
    """``(steady, peak)`` bytes of a key map holding ``n`` keys: sized once for them (a bulk
    load, a reopen: 20 bytes per key), or grown by half from a map sized for ``grown_from`` keys
    (20–30 bytes per key). The peak counts what exists at once: on a reopen the map and the
    versions recovery keeps per slot (8 bytes), on a growth the old and the new arrays."""
    cap = _capacity_for(n)
    steady, peak = 16 * cap, 24 * cap
    if grown_from is not None and n > grown_from:
        old = _capacity_for(grown_from or _MIN_CAPACITY)  # as KeyMap(grown_from) starts
        while MAX_LOAD * old < n:  # keys arriving a batch at a time: each growth is by half
            new = int(GROWTH * old)
            peak = max(peak, 16 * (old + new))
            old = new
        steady = 16 * old
    return steady, peak


@njit(cache=True, nogil=True)
def _count_tags(tkeys, out):  # pragma: no cover - numba
    for k in tkeys:
        if k != _EMPTY:
            out[k >> np.uint64(56)] += 1


class KeyMap:
    """key → (file slot, row position) in one compact hash table; callers hold the store's lock.

    ``file_slot`` and ``pos`` are indexed by the index slots :meth:`find` and :meth:`place`
    return (valid until the next insert or removal).
    """

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self._alloc(_capacity_for(capacity))
        self._size = 0

    def _alloc(self, cap: int) -> None:
        self.keys = np.full(cap, _EMPTY, dtype=np.uint64)
        self.file_slot = np.full(cap, -1, dtype=np.int32)
        self.pos = np.zeros(cap, dtype=np.int32)
        self._cap = np.uint64(cap)

    @property
    def size(self) -> int:
        """Keys mapped."""
        return self._size

    @property
    def capacity(self) -> int:
        """Index slots."""
        return int(self.keys.size)

    @property
    def nbytes(self) -> int:
        """Memory the map holds (its three arrays)."""
        return int(self.keys.nbytes + self.file_slot.nbytes + self.pos.nbytes)

    @property
    def bytes_per_key(self) -> float:
        """:attr:`nbytes` per key mapped (``nan`` when empty)."""
        return self.nbytes / self._size if self._size else float("nan")

    def count_by_tag(self) -> np.ndarray:
        """``int64[256]``: keys mapped per top byte (a tagged key's table, :mod:`hpsray.tiers.tagcount`);
        one pass over the index, for reports."""
        out = np.zeros(256, dtype=np.int64)
        _count_tags(self.keys, out)
        return out

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Index slots of ``keys`` (-1: not stored)."""
        out = np.empty(keys.size, dtype=np.int64)
        _find(self.keys, self._cap, readonly(np.ascontiguousarray(keys, dtype=np.uint64)), out)
        return out

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(file slots, positions)`` of ``keys`` (``int32``; file slot -1: not stored), looked
        up in one parallel pass."""
        fs = np.empty(keys.size, dtype=np.int32)
        ps = np.empty(keys.size, dtype=np.int32)
        keys = readonly(np.ascontiguousarray(keys, dtype=np.uint64))
        _locate(self.keys, self.file_slot, self.pos, self._cap, keys, fs, ps)
        return fs, ps

    def _resize(self, cap: int) -> None:
        okeys, ofs, opos = self.keys, self.file_slot, self.pos
        self._alloc(cap)
        _rehash(okeys, ofs, opos, self.keys, self.file_slot, self.pos, self._cap)

    def grow(self, extra: int) -> None:
        """Make room for ``extra`` more keys (growing by half at least, rebuilt in one pass)."""
        need = self._size + extra
        if need <= MAX_LOAD * self.capacity:
            return
        self._resize(max(_capacity_for(need), int(GROWTH * self.capacity)))

    def place(self, keys: np.ndarray, file_slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Map ``keys`` (inserting absent ones; :meth:`grow` first) to rows; returns their index
        slots (of duplicate keys, the last one's location stays)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        n = keys.size
        fs = np.ascontiguousarray(np.broadcast_to(np.asarray(file_slots, dtype=np.int32), (n,)))
        ps = np.ascontiguousarray(np.broadcast_to(np.asarray(positions, dtype=np.int32), (n,)))
        if self._size + n > self.capacity - 1:  # a caller that did not grow: never probe a full table
            self.grow(n)
        out = np.empty(n, dtype=np.int64)
        self._size += int(_place(self.keys, self.file_slot, self.pos, self._cap, keys, fs, ps, out))
        return out

    def remove(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unmap ``keys`` (absent ones are skipped); returns ``(the keys removed, the file slots
        their rows were in)``."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        gone_fs = np.empty(keys.size, dtype=np.int32)
        gone = np.zeros(keys.size, dtype=bool)
        self._size -= int(_remove(self.keys, self.file_slot, self.pos, self._cap, keys, gone_fs, gone))
        return keys[gone], gone_fs[gone]

    def lives_at(
        self, keys: np.ndarray, file_slot: int | np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Whether each key's mapped row is still at ``(file_slot, position)`` — no dump (or
        compaction) superseded it since it was written there. ``file_slot`` is one slot or one
        per key. Returns ``(cap, index slots)``."""
        slots = self.find(keys)
        ok = slots >= 0
        at = slots[ok]
        fs = np.broadcast_to(np.asarray(file_slot), keys.shape)
        ok[ok] = (self.file_slot[at] == fs[ok]) & (self.pos[at] == positions[ok])
        return ok, slots

    def live_counts(self, n_file_slots: int) -> np.ndarray:
        """Keys mapped to each file slot (``int64[n_file_slots]``)."""
        fs = self.file_slot[self.keys != _EMPTY]
        return np.bincount(fs, minlength=n_file_slots).astype(np.int64)


def recover(
    directory: str,
    manifest: Manifest,
    width: int,
    block_rows: int,
    files: FileTable,
    keys_map: KeyMap,
    tombstones: dict[int, np.ndarray] | None = None,
) -> tuple[int, int]:
    """Rebuild ``files`` and ``keys_map`` (both empty) from the manifest's live files; fills
    ``tombstones`` (when given) with each tombstone file's dependencies: the file numbers
    holding older entries of the keys whose newest entry it holds.

    Reads each live file's header, key/version index and block table once (a second time for
    the row files only when the store has tombstone files), merging it into the map in one
    numba pass: memory beyond the map is one file's index and 8 bytes per index slot for the
    versions while recovery runs. Removes files a crash left behind (never acknowledged: not in
    the manifest, or temporary). Returns ``(next file number, garbage files removed)``. Raises
    :class:`CorruptFileError` for a live file that is missing or fails its checks.
    """
    live = manifest.live
    removed = 0
    for name in os.listdir(directory):
        no = parse_file_name(name)
        garbage = (no is not None and no not in live) or name.endswith(TMP_SUFFIX)
        if garbage and name != MANIFEST_NAME:  # a crash left it: never acknowledged
            os.unlink(os.path.join(directory, name))
            removed += 1
    next_file_no = max([manifest.next_file_no] + [no + 1 for no in live])
    if not live:
        return next_file_no, removed
    order = sorted(live)
    entries = 0
    for no in order:  # headers first: the map is sized once, for every entry
        path = os.path.join(directory, file_name(no))
        if not os.path.exists(path):
            raise CorruptFileError(f"{path}: listed in the manifest but missing; the store is damaged")
        with open(path, "rb") as f:
            entries += decode_header(f.read(HEADER_BYTES), path).n
    km = keys_map
    km._alloc(_capacity_for(entries))
    km._size = 0
    tver = np.zeros(km.capacity, dtype=np.uint64)  # versions of the mapped entries, while recovering
    tomb_slots: list[int] = []
    row_slots: list[tuple[int, str]] = []
    for no in order:
        path = os.path.join(directory, file_name(no))
        pf = read_index(path, width)
        h = pf.header
        if h.file_no != no:
            raise CorruptFileError(f"{path}: header names file {h.file_no}")
        partial = pf.blocks is not None and h.block_rows == block_rows and h.version in PARTIAL_VERSIONS
        s = files.add(no, h.n, h.size, 0, h.flags, pf.blocks if partial else None)  # format 2: whole reads only
        if h.flags & FLAG_TOMBSTONE:
            tomb_slots.append(s)
        else:
            row_slots.append((s, path))
        keys, vers = np.ascontiguousarray(pf.keys), np.ascontiguousarray(pf.versions)
        km._size += int(_recover_file(km.keys, km.file_slot, km.pos, tver, km._cap, keys, vers, np.int32(s)))
    del tver
    if tomb_slots:
        tomb_of = np.full(files.capacity, -1, dtype=np.int64)
        tomb_of[tomb_slots] = np.arange(len(tomb_slots))
        if tombstones is not None:
            deps = np.zeros((len(tomb_slots), files.capacity), dtype=bool)
            for s, path in row_slots:  # which row files hold older copies of deleted keys
                pf = read_index(path, width)
                _beaten_by_tombstones(km.keys, km.file_slot, km._cap, np.ascontiguousarray(pf.keys), s, tomb_of, deps)
            for t, s in enumerate(tomb_slots):
                tombstones[int(files.no[s])] = files.no[np.flatnonzero(deps[t])].astype(np.int64)
        occupied = km.keys != _EMPTY
        dead = occupied & (tomb_of[np.maximum(km.file_slot, 0)] >= 0)
        km.remove(km.keys[dead].copy())  # the newest entry is a tombstone: deleted
    if km.size < MAX_LOAD / 2 * km.capacity and km.capacity > _MIN_CAPACITY:
        km._resize(_capacity_for(km.size))  # many stale entries: no more slots than the keys need
    files.live[:] = km.live_counts(files.capacity)
    for s in tomb_slots:
        files.live[s] = files.n[s]  # never a compaction victim: retired when its dependencies are gone
    return next_file_no, removed
