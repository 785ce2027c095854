"""SSD-PS key map (where each key's newest row lives) and recovery (rebuilding it on open).

The map is a width-0 :class:`~hpsray.kernels.cpu.CpuHashTable` (key → index slot) plus two
``int32`` arrays indexed by that slot: the *file slot* of the file holding the row (see
:class:`~hpsray.tiers.ssd.files.FileTable`) and the row's position in the file. Recovery rebuilds
both from the manifest's live files and their key/version indexes: the highest version of a key
wins, so a compacted copy never shadows a newer dump written while the compaction ran.
"""

from __future__ import annotations

import os

import numpy as np

from hpsray.errors import CorruptFileError
from hpsray.kernels.cpu import CpuHashTable
from hpsray.tiers.ssd.files import FileTable
from hpsray.tiers.ssd.manifest import NAME as MANIFEST_NAME
from hpsray.tiers.ssd.manifest import Manifest
from hpsray.tiers.ssd.paramfile import PARTIAL_VERSIONS, TMP_SUFFIX, file_name, parse_file_name, read_index

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
    directory: str, manifest: Manifest, width: int, block_rows: int, files: FileTable, keys_map: KeyMap
) -> tuple[int, int]:
    """Rebuild ``files`` and ``keys_map`` (both empty) from the manifest's live files.

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
    keys, vers, fslots, poss = [], [], [], []
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
        keys.append(pf.keys)
        vers.append(pf.versions)
        fslots.append(np.full(pf.header.n, s, dtype=np.int32))
        poss.append(np.arange(pf.header.n, dtype=np.int32))
    next_file_no = max([manifest.next_file_no] + [no + 1 for no in live])
    if not keys:
        return next_file_no, removed
    all_keys, all_vers = np.concatenate(keys), np.concatenate(vers)
    all_fslots, all_poss = np.concatenate(fslots), np.concatenate(poss)
    order = np.lexsort((all_vers, all_keys))  # by key, then version: the last of each key wins
    ks = all_keys[order]
    last = np.ones(ks.size, dtype=bool)
    last[:-1] = ks[1:] != ks[:-1]
    win = order[last]
    keys_map.grow(win.size)
    keys_map.place(all_keys[win], all_fslots[win], all_poss[win])
    files.live[:] = np.bincount(all_fslots[win], minlength=files.capacity)
    return next_file_no, removed
