"""SSD-PS reads: planning a load (which files, whole or partial) and running it on the I/O threads.

A load looks every key up once, groups the found keys by file (a counting sort), and reads each
file holding a requested key once: whole (one I/O, every checksum verified), or, when the
requested rows lie in few checksummed blocks, only those blocks through a memory map kept across
loads. Files are opened in rounds under the store's lock, so a compaction that retires a file a
moment later cannot take it away from a round in flight; later rounds look again the rows of
files a compaction retired meanwhile.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from concurrent.futures import wait
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from hpsray.errors import CorruptFileError
from hpsray.tiers.ssd.paramfile import (
    HEADER_BYTES,
    PARTIAL_VERSIONS,
    decode_header,
    pick_blocks,
    read_file,
    touched_blocks,
)

if TYPE_CHECKING:
    from hpsray.tiers.ssd.store import SSDPS

__all__ = ["MAX_OPEN_FILES", "ROUND_BYTES", "FileMap", "Reads"]

MAX_OPEN_FILES = 64  # files opened per load round: bounds descriptors...
ROUND_BYTES = 128 << 20  # ...and the bytes read ahead of the rows being picked


@njit(cache=True)
def _resolve(slots, loc_slot, loc_pos, n_file_slots):
    """Group the found keys by file (a counting sort). ``slots`` are index slots (-1: absent).
    Returns ``(idx, pos, starts)``: the keys of file slot ``f`` are ``idx[starts[f]:starts[f+1]]``
    (positions into ``slots``, ascending), at row positions ``pos[...]`` of that file.
    The mapping is gathered once (random reads), the sort then runs on sequential arrays."""
    n_all = slots.size
    fs = np.empty(n_all, dtype=np.int32)
    ps = np.empty(n_all, dtype=np.int32)
    starts = np.zeros(n_file_slots + 1, dtype=np.int64)
    for i in range(n_all):
        s = slots[i]
        if s >= 0:
            f = loc_slot[s]
            fs[i] = f
            ps[i] = loc_pos[s]
            starts[f + 1] += 1
        else:
            fs[i] = -1
    for f in range(n_file_slots):
        starts[f + 1] += starts[f]
    cursor = starts[:-1].copy()
    n = starts[n_file_slots]
    idx = np.empty(n, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    for i in range(n_all):
        f = fs[i]
        if f >= 0:
            c = cursor[f]
            idx[c] = i
            pos[c] = ps[i]
            cursor[f] = c + 1
    return idx, pos, starts


@njit(cache=True, nogil=True)
def _pick_rows(out, idx, rows, pos, file_keys, keys):
    """``out[idx[j]] = rows[pos[j]]``, checking that the file holds the key there; returns -1,
    or the first ``j`` whose key does not match."""
    width = rows.shape[1]
    for j in range(idx.size):
        p = pos[j]
        i = idx[j]
        if p >= rows.shape[0] or file_keys[p] != keys[i]:
            return j
        for c in range(width):
            out[i, c] = rows[p, c]
    return -1


class FileMap:
    """A read-only memory map of one parameter file, kept across loads (partial reads of a
    cached file then cost no mmap/munmap and no page faults for pages already mapped).
    ``refs`` counts loads using it; a file that compaction retires is unmapped once unused."""

    __slots__ = ("dead", "mm", "refs", "size", "table")

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            if self.size < HEADER_BYTES:
                raise CorruptFileError(f"{path}: truncated header ({self.size} of {HEADER_BYTES} bytes)")
            self.mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.mm.madvise(mmap.MADV_RANDOM)  # no read-around: only the touched pages
        self.refs = 0
        self.dead = False
        # the file's block checksums, kept with the map: compaction may retire the file meanwhile
        self.table: np.ndarray | None = None

    def release(self) -> None:
        """One load is done with the map (call under the store's lock)."""
        self.refs -= 1
        if self.dead and self.refs == 0:
            self.mm.close()

    def retire(self) -> None:
        """The file left the live set: unmap now, or when the last load releases it."""
        self.dead = True
        if self.refs == 0:
            self.mm.close()


def _will_need(fds: list[int]) -> None:
    """Start reading whole files into the page cache (it can block on a full device queue,
    so it runs on an I/O thread while the caller goes on)."""
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)


class Reads:
    """The loads of one store: its kept memory maps and per-thread read buffers. Works on the
    store's key map and file table under the store's lock."""

    def __init__(self, store: SSDPS) -> None:
        self.store = store
        self.maps: dict[int, FileMap] = {}  # file number -> memory map kept for partial reads
        self._tls = threading.local()

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """Rows of ``keys``, the found mask, and the load's counters (see :meth:`SSDPS.load`)."""
        st = self.store
        pool = st._pool
        # zeros: absent rows stay zero, and the pages fault in on the I/O threads as rows land
        out = np.zeros((keys.size, st.width), dtype=np.float32)
        first_fds: list[int] = []
        pending: list[list] = []  # futures of whole-file rounds in flight
        opened: list[tuple[list, list]] = []
        prefetch: list = []
        n_files = n_bytes = 0
        n_partial = 0
        try:
            with st._lock:
                files, kmap = st._files, st._keys
                if keys.size * st._block_rows >= 2 * st.partial_read_share * kmap.size:
                    # So many keys that (nearly) every file will be read whole: start reading
                    # the first files while the lookup and grouping below run (~0.1 s per 2M keys).
                    early = np.flatnonzero(files.no >= 0)[: st._round_files]
                    opened.append(([], first_fds))  # closed at the end
                    for no in files.no[early].tolist():
                        first_fds.append(os.open(st._path(no), os.O_RDONLY))
                    prefetch.append(pool.submit(_will_need, first_fds))
                slots = kmap.find(keys)
                idx, pos, starts = _resolve(slots, kmap.file_slot, kmap.pos, files.capacity)
                file_no = files.no.copy()
                groups = np.flatnonzero(starts[1:] > starts[:-1])
                partial = self._partial_groups(groups, starts, pos, file_no)
                whole = groups[~partial]
                rf = st._round_files
                rounds = [whole[r : r + rf] for r in range(0, whole.size, rf)]
                if rounds:  # start the I/O right away
                    opened.append(self._open_round(keys, rounds[0], starts, idx, pos, file_no))
            whole_rounds = opened[-1:] if rounds else []
            if rounds:
                prefetch.append(pool.submit(_will_need, whole_rounds[0][1]))
            found = slots >= 0
            n_present = int(idx.size)
            # Files whose requested rows fill few blocks: only those blocks are read (memory
            # map, checksummed blocks), in rounds of open descriptors, no read-ahead hint.
            part = groups[partial]
            for r in range(0, part.size, MAX_OPEN_FILES):
                tasks, fds = self._open_round(
                    keys, part[r : r + MAX_OPEN_FILES], starts, idx, pos, file_no, mapped=True
                )
                opened.append((tasks, fds))
                futures = [
                    pool.submit(self._read_partial, keys, out, i, p, st._path(no), fd)
                    if isinstance(fd, FileMap)
                    else pool.submit(self._read_rows, keys, out, i, p, st._path(no), fd)
                    for (i, p, no), fd in zip(tasks, fds)
                ]
                wait(futures)
                for fut in futures:
                    b, was_partial = fut.result()
                    n_bytes += b
                    n_partial += was_partial
                n_files += len(tasks)
            # Whole files: rounds of a few files (ROUND_BYTES), opened under the lock: an open
            # descriptor keeps a file readable even if compaction unlinks it a moment later.
            # Later rounds check that their files are still live and look up again the rows of
            # files a compaction retired. Round r + 1 is opened, hinted (WILLNEED, so the device
            # sees a deep queue) and queued on the I/O threads as soon as round r is queued; round
            # r + 2 waits until round r is done (two rounds in flight, no idle threads between).
            for r in range(len(rounds)):
                tasks, fds = whole_rounds[r]
                pending.append(
                    [
                        pool.submit(self._read_rows, keys, out, i, p, st._path(no), fd)
                        for (i, p, no), fd in zip(tasks, fds)
                    ]
                )
                n_files += len(tasks)
                if len(pending) > 1:
                    wait(pending[0])
                    n_bytes += sum(fut.result()[0] for fut in pending.pop(0))
                if r + 1 < len(rounds):
                    opened.append(self._open_round(keys, rounds[r + 1], starts, idx, pos, file_no))
                    whole_rounds.append(opened[-1])
                    prefetch.append(pool.submit(_will_need, opened[-1][1]))
            while pending:
                wait(pending[0])
                n_bytes += sum(fut.result()[0] for fut in pending.pop(0))
        finally:
            for futures in pending:  # an error left reads running: they use the descriptors
                wait(futures)
            wait(prefetch)  # before their descriptors close
            for _, fds in opened:
                self.close_all(fds)
        counts = {
            "rows_loaded": n_present,
            "rows_absent": int(keys.size - n_present),
            "files_read": n_files,
            "files_read_partially": n_partial,
            "bytes_read": n_bytes,
        }
        return out, found, counts

    def _acquire_map(self, no: int) -> FileMap:
        """The kept memory map of live file ``no`` (created on first use); call under the lock."""
        m = self.maps.get(no)
        if m is None:
            m = self.maps[no] = FileMap(self.store._path(no))
        m.table = self.store._files.tables.get(no)
        m.refs += 1
        return m

    def close_all(self, fds: list) -> None:
        """Close the descriptors of a round and release its kept maps."""
        with self.store._lock:
            for fd in fds:
                if isinstance(fd, FileMap):
                    fd.release()
                else:
                    os.close(fd)

    def drop_map(self, no: int) -> None:
        """File ``no`` leaves the live set (call under the lock)."""
        m = self.maps.pop(no, None)
        if m is not None:
            m.retire()

    def _open_round(
        self,
        keys: np.ndarray,
        group_slots: np.ndarray,
        starts: np.ndarray,
        idx: np.ndarray,
        pos: np.ndarray,
        file_no: np.ndarray,
        mapped: bool = False,
    ) -> tuple[list, list]:
        """Tasks ``(idx, pos, file number)`` for the file slots ``group_slots`` and, per task, an
        open descriptor (``mapped``: the file's kept memory map where it has a block table)."""
        st = self.store
        tasks: list[tuple[np.ndarray, np.ndarray, int]] = []
        fds: list[int | FileMap] = []
        moved: list[np.ndarray] = []
        with st._lock:
            files, kmap = st._files, st._keys
            for s in group_slots.tolist():
                a, b = int(starts[s]), int(starts[s + 1])
                if files.no[s] == file_no[s]:
                    tasks.append((idx[a:b], pos[a:b], int(file_no[s])))
                else:
                    moved.append(idx[a:b])
            if moved:
                mi = np.concatenate(moved)
                ms = kmap.find(keys[mi])
                mf, mp = kmap.file_slot[ms], kmap.pos[ms]
                for s in np.unique(mf).tolist():
                    sel = mf == s
                    tasks.append((mi[sel], mp[sel], int(files.no[s])))
            try:
                for t in tasks:
                    if mapped and t[2] in files.tables:
                        fds.append(self._acquire_map(t[2]))
                    else:
                        fds.append(os.open(st._path(t[2]), os.O_RDONLY))
            except BaseException:
                self.close_all(fds)
                raise
        return tasks, fds

    def _read_rows(
        self, keys: np.ndarray, out: np.ndarray, idx: np.ndarray, pos: np.ndarray, path: str, fd: int
    ) -> tuple[int, bool]:
        buf = getattr(self._tls, "buf", None)  # one reused read buffer per I/O thread
        size = os.fstat(fd).st_size
        if buf is None or buf.size < size:
            buf = self._tls.buf = np.empty(max(size, 1 << 20), dtype=np.uint8)
        pf = read_file(path, fd, self.store.width, buf=buf)
        bad = _pick_rows(out, idx, pf.rows, pos, pf.keys, keys)
        if bad >= 0:
            raise CorruptFileError(
                f"{path}: row {int(pos[bad])} does not hold key {int(keys[idx[bad]])} as the mapping says"
            )
        return pf.header.size, False

    def _partial_groups(
        self, groups: np.ndarray, starts: np.ndarray, pos: np.ndarray, file_no: np.ndarray
    ) -> np.ndarray:
        """Which of the file slots ``groups`` to read partially: files with a block table
        (format 3) whose requested rows lie in at most ``partial_read_share`` of their blocks."""
        st = self.store
        tables = st._files.tables
        if groups.size == 0 or st.partial_read_share <= 0 or not tables:
            return np.zeros(groups.size, dtype=bool)
        br = st._block_rows
        touched = touched_blocks(pos, starts, groups, br)
        blocks = -(-st._files.n[groups] // br)
        ok = touched <= st.partial_read_share * blocks
        if ok.any():
            have = np.fromiter((int(no) in tables for no in file_no[groups[ok]]), bool, int(ok.sum()))
            ok[np.flatnonzero(ok)[~have]] = False
        return ok

    def _read_partial(
        self, keys: np.ndarray, out: np.ndarray, idx: np.ndarray, pos: np.ndarray, path: str, m: FileMap
    ) -> tuple[int, bool]:
        """Copy the requested rows of one file out of its read-only memory map, verifying the
        checksum of every block touched and the key at every position. Returns the bytes of the
        blocks touched (an estimate of what the device read)."""
        st = self.store
        table = m.table
        size = m.size
        data = np.frombuffer(m.mm, dtype=np.uint8)
        try:
            h = decode_header(data[:HEADER_BYTES], path)
            if table is None:
                raise CorruptFileError(f"{path}: no block table to verify a partial read with")
            if (
                h.width != st.width
                or h.size != size
                or h.block_rows != st._block_rows
                or h.version not in PARTIAL_VERSIONS
            ):
                raise CorruptFileError(
                    f"{path}: size {size} bytes, header says {h.size} "
                    f"({h.n} rows of width {h.width}, blocks of {h.block_rows})"
                )
            if table.size != h.n_blocks or zlib.crc32(table.data) != h.table_crc:
                raise CorruptFileError(f"{path}: block table checksum mismatch")
            r, touched = pick_blocks(data, h, table, out, idx, pos, keys)
        finally:
            del data
        if r > 0:
            raise CorruptFileError(f"{path}: block {r - 1} checksum mismatch (rows {(r - 1) * h.block_rows}.. damaged)")
        if r < 0:
            j = -r - 1
            raise CorruptFileError(
                f"{path}: row {int(pos[j])} does not hold key {int(keys[idx[j]])} as the mapping says"
            )
        return HEADER_BYTES + touched * h.block_rows * st._rec, True
