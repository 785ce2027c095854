"""SSD-PS file table: the live parameter files, their stale counts, victim choice, and writing new ones.

Live files sit in dense *file slots* of numpy arrays (number, rows, live rows, bytes, flags), so
stale counting and victim selection are vectorised; a file's block checksums (format 3 files,
for partial reads) are kept beside them by file number. Callers hold the store's lock.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from hpsray.fileio import FULL_ERRNOS, Writer, fsync_dir, fsync_path, full_error, unlink_quiet
from hpsray.tiers.ssd.paramfile import FLAG_TOMBSTONE, file_bytes, file_name, write_tmp

__all__ = ["FileTable", "remove_files", "write_files"]


class FileTable:
    """Live parameter files in dense slots of numpy arrays (number, rows, live rows, bytes, flags)."""

    def __init__(self) -> None:
        self.no = np.full(64, -1, dtype=np.int64)
        self.n = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=np.int64)
        self.size = np.zeros(64, dtype=np.int64)
        self.flags = np.zeros(64, dtype=np.int32)
        self.slot_of: dict[int, int] = {}
        self.tables: dict[int, np.ndarray] = {}  # file number -> block checksums (format 3 files)
        self._free: list[int] = list(range(63, -1, -1))  # pops 0, 1, 2, ...
        self.disk_bytes = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def capacity(self) -> int:
        return self.no.size

    def add(self, no: int, n: int, size: int, live: int, flags: int, table: np.ndarray | None = None) -> int:
        """Register file ``no`` (with its block table, if partial reads may use it); returns its slot."""
        if not self._free:
            old = self.no.size
            for name in ("no", "n", "live", "size", "flags"):
                a = getattr(self, name)
                b = np.full(2 * old, -1, dtype=a.dtype) if name == "no" else np.zeros(2 * old, dtype=a.dtype)
                b[:old] = a
                setattr(self, name, b)
            self._free.extend(range(2 * old - 1, old - 1, -1))
        s = self._free.pop()
        self.no[s], self.n[s], self.live[s], self.size[s], self.flags[s] = no, n, live, size, flags
        self.slot_of[no] = s
        self.disk_bytes += size
        if table is not None:
            self.tables[no] = table
        return s

    def add_written(
        self,
        nos: Sequence[int],
        sizes: Sequence[int],
        tables: dict[int, np.ndarray],
        n_rows: int,
        rows_per_file: int,
        live: Sequence[int] | np.ndarray | None,
        flags: int,
    ) -> np.ndarray:
        """Register the files :func:`write_files` wrote for ``n_rows`` rows (``rows_per_file``
        each, the last one the rest); ``live`` rows per file (default: all). Returns their slots."""
        return np.asarray(
            [
                self.add(
                    no,
                    min(rows_per_file, n_rows - i * rows_per_file),
                    size,
                    min(rows_per_file, n_rows - i * rows_per_file) if live is None else int(live[i]),
                    flags,
                    tables.get(no),
                )
                for i, (no, size) in enumerate(zip(nos, sizes))
            ],
            dtype=np.int32,
        )

    def remove(self, s: int) -> None:
        """File slot ``s`` leaves the live set."""
        no = int(self.no[s])
        del self.slot_of[no]
        self.tables.pop(no, None)
        self.disk_bytes -= int(self.size[s])
        self.no[s] = -1
        self.n[s] = self.live[s] = self.size[s] = self.flags[s] = 0
        self._free.append(s)

    def kill(self, file_slots: np.ndarray) -> None:
        """One row in each of ``file_slots`` was superseded: count it stale."""
        if file_slots.size:
            self.live -= np.bincount(file_slots, minlength=self.capacity)

    def stale_rows(self) -> int:
        used = self.no >= 0
        return int((self.n[used] - self.live[used]).sum())

    def stale_slots(self, record: int, threshold: float | None) -> np.ndarray:
        """Slots with stale rows whose stale share (bytes; header and block table counted as
        stale) exceeds ``threshold`` (``None``: any stale row)."""
        stale = self.n - self.live
        mask = (self.no >= 0) & (stale > 0)
        if threshold is not None:
            mask &= self.size - (self.n - stale) * record > threshold * self.size
        return np.flatnonzero(mask)

    def small_slots(self, rows_per_file: int) -> np.ndarray:
        """Files with fewer than half of ``rows_per_file`` rows (small dumps write them); never
        tombstone files (their rows are not live rows: the store retires them)."""
        rows = (self.no >= 0) & ((self.flags & FLAG_TOMBSTONE) == 0)
        return np.flatnonzero(rows & (self.n < max(2, rows_per_file // 2)))

    def victims(
        self,
        record: int,
        threshold: float | None,
        rows_per_file: int,
        merge_small_files: int,
        pass_bytes: int,
        full: bool,
        older_than: int | None = None,
    ) -> np.ndarray:
        """The slots one compaction pass rewrites: files over the stale ``threshold`` (``full``:
        any stale row), most stale first, then, once ``merge_small_files`` small files (or with
        ``full`` two) have accumulated, the small ones oldest first; at most ``pass_bytes`` of
        input, but at least one file. ``older_than``: every file numbered below it instead,
        oldest first, tombstone files aside (a relayout)."""
        if older_than is not None:
            ok = (self.no >= 0) & (self.no < older_than) & ((self.flags & FLAG_TOMBSTONE) == 0)
            cand = np.flatnonzero(ok)
            cand = cand[np.argsort(self.no[cand], kind="stable")]
        else:
            cand = self.stale_slots(record, None if full else threshold)
            cand = cand[np.argsort(self.live[cand] / self.n[cand], kind="stable")]  # most stale first
            small = self.small_slots(rows_per_file)
            if small.size >= merge_small_files or (full and small.size > 1):
                small = small[np.argsort(self.no[small], kind="stable")]  # oldest first
                cand = np.concatenate([cand, small[~np.isin(small, cand)]])
        within = np.cumsum(self.size[cand]) <= pass_bytes
        within[:1] = True
        return cand[within]


def write_files(
    directory: str,
    nos: list[int],
    keys: np.ndarray,
    versions: np.ndarray,
    rows: np.ndarray,
    rows_per_file: int,
    flags: int,
    write: Writer,
    fsync_all: Callable[[list[str]], object],
) -> tuple[list[int], dict[int, np.ndarray]]:
    """Write one file per ``rows_per_file`` rows under temporary names, fsync them
    (``fsync_all``: in parallel, so the device sees a queue), rename them, fsync the directory.
    Returns their sizes and block tables (by file number), for :meth:`FileTable.add_written`.

    On failure removes what it wrote and raises; a refusal for want of space is an
    :class:`~hpsray.errors.SSDFullError` naming the directory, the bytes the whole write needs
    and the bytes free (nothing of the write was recorded; the store stays readable).
    """
    rpf = rows_per_file
    tmps, sizes, tables = [], [], []
    try:
        for i, no in enumerate(nos):
            sl = slice(i * rpf, (i + 1) * rpf)
            tmp, size, table = write_tmp(directory, no, keys[sl], versions[sl], rows[sl], flags, write, fsync=False)
            tmps.append(tmp)
            sizes.append(size)
            tables.append(table)
        if len(tmps) > 1:
            fsync_all(tmps)
        elif tmps:
            fsync_path(tmps[0])
        for no, tmp in zip(nos, tmps):
            os.rename(tmp, os.path.join(directory, file_name(no)))
        fsync_dir(directory)
    except BaseException as e:
        for tmp in tmps:
            unlink_quiet(tmp)
        remove_files(directory, nos)
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            width = rows.shape[1]
            needed = sum(file_bytes(min(rpf, keys.size - i * rpf), width) for i in range(len(nos)))
            what = f"writing {keys.size} rows in {len(nos)} parameter files"
            after = "nothing of this write was recorded and the store stays readable"
            raise full_error(e, directory, needed, what, after) from e
        raise
    return sizes, dict(zip(nos, tables))


def remove_files(directory: str, nos: Iterable[int]) -> None:
    """Unlink parameter files ``nos`` (those that exist)."""
    for no in nos:
        unlink_quiet(os.path.join(directory, file_name(no)))
