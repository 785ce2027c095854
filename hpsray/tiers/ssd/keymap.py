"""SSD-PS key map (where each key's newest row lives) and recovery (rebuilding it on open).

The map is a width-0 :class:`~hpsray.kernels.cpu.CpuHashTable` (key → index slot) plus two
``int32`` arrays indexed by that slot: the *file slot* of the file holding the row (see
:class:`~hpsray.tiers.ssd.files.FileTable`) and the row's position in the file. Recovery rebuilds
both from the manifest's live files and their key/version indexes: the highest version of a key
wins, so a compacted copy never shadows a newer dump written while the compaction ran.

A deleted key's newest entry is a *tombstone* (a row in a file flagged
:data:`~hpsray.tiers.ssd.paramfile.FLAG_TOMBSTONE`): when it wins, the key is not mapped. A
tombstone file lives while some file that may hold an older copy of its keys does (its
*dependencies*); recovery finds them exactly (the files holding the entries it beat).
"""

from __future__ import annotations

import os

import numpy as np

from hpsray.errors import CorruptFileError
from hpsray.kernels.cpu import CpuHashTable
from hpsray.tiers.ssd.files import FileTable
from hpsray.tiers.ssd.manifest import NAME as MANIFEST_NAME
from hpsray.tiers.ssd.manifest import Manifest
from hpsray.tiers.ssd.paramfile import (
    FLAG_TOMBSTONE,
    PARTIAL_VERSIONS,
    TMP_SUFFIX,
    file_name,
    parse_file_name,
    read_index,
)

__all__ = ["KeyMap", "recover"]


class KeyMap:
    """key → (file slot, row position); callers hold the store's lock."""

    def __init__(self, capacity: int = 1024) -> None:
        self.index = CpuHashTable(capacity, 0)
        self.file_slot = np.full(capacity, -1, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)

    @property
    def size(self) -> int:
        """Keys mapped."""
        return self.index.size

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Index slots of ``keys`` (-1: not stored)."""
        return self.index.find(keys)

    def grow(self, extra: int) -> None:
        """Make room for ``extra`` more keys (doubling, rebuilt in one pass)."""
        need = self.index.size + extra
        if need <= self.index.capacity:
            return
        cap = max(need, 2 * self.index.capacity)
        old_keys, _ = self.index.export()
        old_slots = self.index.find(old_keys)
        index = CpuHashTable(cap, 0)
        slots = index.find_or_insert(old_keys)
        file_slot = np.full(cap, -1, dtype=np.int32)
        pos = np.zeros(cap, dtype=np.int32)
        file_slot[slots] = self.file_slot[old_slots]
        pos[slots] = self.pos[old_slots]
        self.index, self.file_slot, self.pos = index, file_slot, pos

    def place(self, keys: np.ndarray, file_slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Map ``keys`` (inserting absent ones; :meth:`grow` first) to rows; returns their index slots."""
        slots = self.index.find_or_insert(keys)
        self.file_slot[slots] = file_slots
        self.pos[slots] = positions
        return slots

    def remove(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unmap ``keys`` (absent ones are skipped); returns ``(the keys removed, the file slots
        their rows were in)``."""
        slots = self.index.find(keys)
        present = slots >= 0
        s = slots[present]
        gone = keys[present]
        file_slots = self.file_slot[s].copy()
        self.index.erase(gone)
        self.file_slot[s] = -1
        self.pos[s] = 0
        return gone, file_slots

    def lives_at(
        self, keys: np.ndarray, file_slot: int | np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Whether each key's mapped row is still at ``(file_slot, position)`` — no dump (or
        compaction) superseded it since it was written there. ``file_slot`` is one slot or one
        per key. Returns ``(mask, index slots)``."""
        slots = self.index.find(keys)
        ok = slots >= 0
        at = slots[ok]
        fs = np.broadcast_to(np.asarray(file_slot), keys.shape)
        ok[ok] = (self.file_slot[at] == fs[ok]) & (self.pos[at] == positions[ok])
        return ok, slots


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

    Removes files a crash left behind (never acknowledged: not in the manifest, or temporary).
    Returns ``(next file number, garbage files removed)``. Raises :class:`CorruptFileError` for a
    live file that is missing or fails its checks.
    """
    live = manifest.live
    removed = 0
    for name in os.listdir(directory):
        no = parse_file_name(name)
        garbage = (no is not None and no not in live) or name.endswith(TMP_SUFFIX)
        if garbage and name != MANIFEST_NAME:  # a crash left it: never acknowledged
            os.unlink(os.path.join(directory, name))
            removed += 1
    keys, vers, fslots, poss, marks = [], [], [], [], []
    tomb_slots = []
    for no in sorted(live):
        path = os.path.join(directory, file_name(no))
        if not os.path.exists(path):
            raise CorruptFileError(f"{path}: listed in the manifest but missing; the store is damaged")
        pf = read_index(path, width)
        if pf.header.file_no != no:
            raise CorruptFileError(f"{path}: header names file {pf.header.file_no}")
        partial = (
            pf.blocks is not None and pf.header.block_rows == block_rows and pf.header.version in PARTIAL_VERSIONS
        )  # format 2 files: whole reads only
        s = files.add(no, pf.header.n, pf.header.size, 0, pf.header.flags, pf.blocks if partial else None)
        tomb = bool(pf.header.flags & FLAG_TOMBSTONE)
        if tomb:
            tomb_slots.append(s)
        marks.append(np.full(pf.header.n, tomb, dtype=bool))
        keys.append(pf.keys)
        vers.append(pf.versions)
        fslots.append(np.full(pf.header.n, s, dtype=np.int32))
        poss.append(np.arange(pf.header.n, dtype=np.int32))
    next_file_no = max([manifest.next_file_no] + [no + 1 for no in live])
    if not keys:
        return next_file_no, removed
    all_keys, all_vers = np.concatenate(keys), np.concatenate(vers)
    all_fslots, all_poss = np.concatenate(fslots), np.concatenate(poss)
    all_tomb = np.concatenate(marks)
    order = np.lexsort((all_vers, all_keys))  # by key, then version: the last of each key wins
    ks = all_keys[order]
    last = np.ones(ks.size, dtype=bool)
    last[:-1] = ks[1:] != ks[:-1]
    win = order[last]
    dead = all_tomb[win]  # the newest entry is a tombstone: deleted
    if tombstones is not None and dead.any():
        group = np.cumsum(np.concatenate([[0], last[:-1]]))  # key group of each sorted entry
        by_tomb = all_fslots[win][group]  # per entry: its key's winning file slot
        older = dead[group] & ~last & ~all_tomb[order]  # older row entries of deleted keys
        pairs = np.unique(np.stack([by_tomb[older], all_fslots[order][older]]), axis=1)
        for s in np.unique(all_fslots[win][dead]).tolist():
            tombstones[int(files.no[s])] = files.no[pairs[1][pairs[0] == s]].astype(np.int64)
    if tombstones is not None:
        for s in tomb_slots:
            tombstones.setdefault(int(files.no[s]), np.empty(0, np.int64))
    keys_map.grow(int(np.count_nonzero(~dead)))
    keys_map.place(all_keys[win[~dead]], all_fslots[win[~dead]], all_poss[win[~dead]])
    files.live[:] = np.bincount(all_fslots[win[~dead]], minlength=files.capacity)
    for s in tomb_slots:
        files.live[s] = files.n[s]  # never a compaction victim: retired when its dependencies are gone
    return next_file_no, removed
