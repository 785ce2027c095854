"""SSD-PS: a node's shard of rows in append-only parameter files (paper §6, App. E).

* **Mapping.** key → (file, position) lives in memory: a width-0
  :class:`~hpsray.kernels.cpu.CpuHashTable` as the key → slot index plus two ``int32``
  arrays indexed by that slot (the file's dense *file slot* and the row's position in it).
  Live files sit in dense file slots of numpy arrays (number, rows, live rows, bytes), so
  stale counting and victim selection are vectorised. Reopening rebuilds all of it from the
  manifest and the files' key/version indexes.
* **load(keys)** reads every file that holds a requested key whole (one I/O per file, several
  files in flight), verifies its checksums and picks the rows out; a file whose requested rows
  lie in few checksummed blocks is read partially instead, through a memory map kept across
  loads. Keys never stored come back flagged absent so that the caller initialises them.
* **dump(keys, rows)** writes the rows as *new* files, sequentially, each under a temporary
  name; fsyncs them, renames them, fsyncs the directory; appends one manifest record adding
  them and fsyncs it; only then updates the mapping and returns (the acknowledgement). The
  old copies become stale: every file keeps a count of its live rows.
* **Compaction.** A background thread (or :meth:`SSDPS.compact`) rewrites the live rows of
  files whose stale share exceeds ``stale_threshold`` (0.5) into new files and deletes the old
  ones, all in one manifest record. It runs once disk bytes pass ``compact_trigger`` × live
  bytes; a dump that leaves more than ``max_space_ratio`` (2.0) waits for it (backpressure).
  When no file is more than half stale, disk bytes ≤ 2 × live bytes holds exactly.
* **Versions.** Every row in a file carries the number of the dump file that produced its
  value; compaction copies it unchanged. On reopen the highest version of a key wins, so a
  compacted copy never shadows a newer dump written while the compaction ran.

See ``docs/tiers.md`` for the formats, the durability protocol and measurements.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
from numba import njit

from hpsray.kernels.cpu import CpuHashTable
from hpsray.kernels.table import as_keys, as_rows
from hpsray.tiers.manifest import NAME as MANIFEST_NAME
from hpsray.tiers.manifest import Manifest
from hpsray.tiers.paramfile import (
    FLAG_COMPACTED,
    HEADER_BYTES,
    PARTIAL_VERSIONS,
    TMP_SUFFIX,
    CorruptFileError,
    SSDError,
    SSDFullError,
    Writer,
    block_rows_for,
    decode_header,
    file_name,
    fsync_dir,
    fsync_path,
    parse_file_name,
    pick_blocks,
    read_file,
    read_index,
    record_bytes,
    touched_blocks,
    write_tmp,
)

__all__ = ["DEFAULT_FILE_BYTES", "SSDPS", "CorruptFileError", "SSDError", "SSDFullError", "default_rows_per_file"]

DEFAULT_FILE_BYTES = 16 << 20
"""Target size of a parameter file when ``rows_per_file`` is not given. Measured with
``hpsray bench ssd --sweep`` (docs/tiers.md): a whole-file read costs about one device request
plus a fixed latency, so small files waste bandwidth; beyond a few MiB the gain flattens while
sparse batches read ever more unneeded rows."""

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_MAX_OPEN_FILES = 64  # files opened per load round: bounds descriptors...
_ROUND_BYTES = 128 << 20  # ...and the bytes read ahead of the rows being picked


def default_rows_per_file(width: int, file_bytes: int = DEFAULT_FILE_BYTES) -> int:
    """Rows per file so that a file of rows of ``width`` floats is about ``file_bytes``."""
    return max(1, (file_bytes - HEADER_BYTES) // record_bytes(width))


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


class _Files:
    """Live parameter files in dense slots of numpy arrays (number, rows, live rows, bytes)."""

    def __init__(self) -> None:
        self.no = np.full(64, -1, dtype=np.int64)
        self.n = np.zeros(64, dtype=np.int64)
        self.live = np.zeros(64, dtype=np.int64)
        self.size = np.zeros(64, dtype=np.int64)
        self.flags = np.zeros(64, dtype=np.int32)
        self.slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(63, -1, -1))  # pops 0, 1, 2, ...
        self.disk_bytes = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def capacity(self) -> int:
        return self.no.size

    def add(self, no: int, n: int, size: int, live: int, flags: int) -> int:
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
        return s

    def remove(self, s: int) -> None:
        del self.slot_of[int(self.no[s])]
        self.disk_bytes -= int(self.size[s])
        self.no[s] = -1
        self.n[s] = self.live[s] = self.size[s] = self.flags[s] = 0
        self._free.append(s)

    def stale_slots(self, record: int, threshold: float | None) -> np.ndarray:
        """Slots with stale rows whose stale share (bytes; header and block table counted as
        stale) exceeds ``threshold`` (``None``: any stale row)."""
        stale = self.n - self.live
        mask = (self.no >= 0) & (stale > 0)
        if threshold is not None:
            mask &= self.size - (self.n - stale) * record > threshold * self.size
        return np.flatnonzero(mask)


class _Map:
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
        self.table = None  # the file's block checksums, kept with the map: compaction may retire the file meanwhile

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


def _space_ratio(disk: int, live: int) -> float:
    if live == 0:
        return 1.0 if disk == 0 else float("inf")
    return disk / live


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SSDPS:
    """A directory of parameter files holding rows ``float32[width]`` by ``uint64`` key.

    Args:
        directory: store directory (created if needed).
        width: floats per row; ``None`` reopens an existing store with its recorded width.
        rows_per_file: rows per parameter file written by dumps and compaction (default:
            files of about :data:`DEFAULT_FILE_BYTES`).
        stale_threshold: compaction rewrites files whose stale share (by bytes, header
            included) exceeds this; 0.5 bounds disk usage by 2 × live bytes.
        compact_trigger: the background thread compacts once disk bytes exceed this × live bytes.
        max_space_ratio: a dump that leaves disk bytes above this × live bytes waits for a
            compaction pass before it returns (``None``: never wait).
        background: run compaction in a background thread (else only inline, see above).
        io_threads: files read (and fsynced) concurrently.
        partial_read_share: a load reads only the checksummed blocks holding the requested
            rows of a file (through a memory map, see :func:`~hpsray.tiers.paramfile.pick_blocks`)
            when those blocks are at most this share of the file; else the whole file.
        compact_pass_bytes: most input bytes one compaction pass rewrites (the most stale
            files first), so a pass, and a dump waiting on it, stays short.
        merge_small_files: once this many files hold fewer than ``rows_per_file / 2`` rows
            (small dumps write them), compaction merges them into full-size files, so that
            loads keep reading files of a good size.
        write: ``os.write``-compatible function used for all writes (fault injection in tests).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        width: int | None = None,
        *,
        rows_per_file: int | None = None,
        stale_threshold: float = 0.5,
        compact_trigger: float = 1.5,
        max_space_ratio: float | None = 2.0,
        background: bool = True,
        io_threads: int = 4,
        compact_pass_bytes: int = 256 << 20,
        merge_small_files: int = 16,
        partial_read_share: float = 0.25,
        write: Writer = os.write,
    ) -> None:
        if rows_per_file is not None and rows_per_file < 1:
            raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
        if not 0.0 < stale_threshold < 1.0:
            raise ValueError(f"stale_threshold must be in (0, 1), got {stale_threshold}")
        if compact_trigger < 1.0:
            raise ValueError(f"compact_trigger must be >= 1, got {compact_trigger}")
        if width is not None and width < 0:
            raise ValueError(f"width must be >= 0, got {width}")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.stale_threshold = float(stale_threshold)
        self.compact_trigger = float(compact_trigger)
        self.max_space_ratio = max_space_ratio
        self.compact_pass_bytes = int(compact_pass_bytes)
        if merge_small_files < 2:
            raise ValueError(f"merge_small_files must be >= 2, got {merge_small_files}")
        self.merge_small_files = int(merge_small_files)
        self.partial_read_share = float(partial_read_share)
        self._write = write

        self._lock = threading.RLock()  # mapping, file table, counters; held briefly
        self._dump_lock = threading.Lock()  # dumps are sequential
        self._compact_lock = threading.Lock()  # one compaction pass at a time
        self._wake = threading.Event()
        self._pass_done = threading.Condition(self._lock)
        self._passes = 0
        self._closed = False
        self._compaction_errors = 0
        self._last_compaction_error: str | None = None
        self._fatal_error: BaseException | None = None
        self._stats = {
            "dumps": 0, "rows_dumped": 0, "bytes_written": 0, "files_written": 0, "dump_seconds": 0.0,
            "loads": 0, "rows_loaded": 0, "rows_absent": 0, "bytes_read": 0, "files_read": 0, "load_seconds": 0.0,
            "files_read_partially": 0,
            "compactions": 0, "files_compacted": 0, "compaction_bytes_read": 0, "compaction_bytes_written": 0,
            "compaction_seconds": 0.0, "backpressure_waits": 0, "garbage_files_removed": 0,
        }

        self._manifest = Manifest.open(self.directory, width, write)
        self.width = self._manifest.width
        self._rec = record_bytes(self.width)
        self._block_rows = block_rows_for(self.width)
        self._tables: dict[int, np.ndarray] = {}  # file number -> block checksums (format 3 files)
        self._maps: dict[int, _Map] = {}  # file number -> memory map kept for partial reads
        self.rows_per_file = int(rows_per_file or default_rows_per_file(self.width))
        self._round_files = int(min(_MAX_OPEN_FILES, max(2, _ROUND_BYTES // (self._rec * self.rows_per_file))))
        self._next_file_no = self._manifest.next_file_no
        self._files = _Files()
        self._index = CpuHashTable(1024, 0)
        self._loc_slot = np.full(1024, -1, dtype=np.int32)
        self._loc_pos = np.zeros(1024, dtype=np.int32)
        self._recover()
        self._manifest.maybe_rewrite()

        self._tls = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="ssdps-io")
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._compaction_loop, name="ssdps-compaction", daemon=True)
            self._thread.start()

    # -- recovery ------------------------------------------------------------------------

    def _path(self, file_no: int) -> str:
        return os.path.join(self.directory, file_name(file_no))

    def _recover(self) -> None:
        live = self._manifest.live
        for name in os.listdir(self.directory):
            no = parse_file_name(name)
            garbage = (no is not None and no not in live) or name.endswith(TMP_SUFFIX)
            if garbage and name != MANIFEST_NAME:  # a crash left it: never acknowledged
                os.unlink(os.path.join(self.directory, name))
                self._stats["garbage_files_removed"] += 1
        keys, vers, fslots, poss = [], [], [], []
        for no in sorted(live):
            path = self._path(no)
            if not os.path.exists(path):
                raise CorruptFileError(f"{path}: listed in the manifest but missing; the store is damaged")
            pf = read_index(path, self.width)
            if pf.header.file_no != no:
                raise CorruptFileError(f"{path}: header names file {pf.header.file_no}")
            s = self._files.add(no, pf.header.n, pf.header.size, 0, pf.header.flags)
            if (pf.blocks is not None and pf.header.block_rows == self._block_rows
                    and pf.header.version in PARTIAL_VERSIONS):  # format 2 files: whole reads only
                self._tables[no] = pf.blocks
            keys.append(pf.keys)
            vers.append(pf.versions)
            fslots.append(np.full(pf.header.n, s, dtype=np.int32))
            poss.append(np.arange(pf.header.n, dtype=np.int32))
        self._next_file_no = max([self._next_file_no] + [no + 1 for no in live])
        if not keys:
            return
        keys, vers = np.concatenate(keys), np.concatenate(vers)
        fslots, poss = np.concatenate(fslots), np.concatenate(poss)
        order = np.lexsort((vers, keys))  # by key, then version: the last of each key wins
        ks = keys[order]
        last = np.ones(ks.size, dtype=bool)
        last[:-1] = ks[1:] != ks[:-1]
        win = order[last]
        self._grow(win.size)
        slots = self._index.find_or_insert(keys[win])
        self._loc_slot[slots] = fslots[win]
        self._loc_pos[slots] = poss[win]
        self._files.live[:] = np.bincount(fslots[win], minlength=self._files.capacity)

    # -- mapping -------------------------------------------------------------------------

    def _grow(self, extra: int) -> None:
        """Make room in the index for ``extra`` more keys (doubling, rebuilt in one pass)."""
        need = self._index.size + extra
        if need <= self._index.capacity:
            return
        cap = max(need, 2 * self._index.capacity)
        old_keys, _ = self._index.export()
        old_slots = self._index.find(old_keys)
        index = CpuHashTable(cap, 0)
        slots = index.find_or_insert(old_keys)
        loc_slot = np.full(cap, -1, dtype=np.int32)
        loc_pos = np.zeros(cap, dtype=np.int32)
        loc_slot[slots] = self._loc_slot[old_slots]
        loc_pos[slots] = self._loc_pos[old_slots]
        self._index, self._loc_slot, self._loc_pos = index, loc_slot, loc_pos

    def _kill_rows(self, slots: np.ndarray) -> None:
        """The rows at mapped ``slots`` are being superseded: count them stale in their files."""
        if slots.size:
            self._files.live -= np.bincount(self._loc_slot[slots], minlength=self._files.capacity)

    def _live_bytes(self) -> int:
        return self._index.size * self._rec

    # -- public API ----------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return self._index.size

    def contains(self, keys) -> np.ndarray:
        """Whether each key has a stored row."""
        keys = as_keys(keys)
        with self._lock:
            return self._index.find(keys) >= 0

    def load(self, keys) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` and a mask of which keys were found.

        Returns ``(rows float32[n, width], found bool[n])``; rows of absent keys are zero (the
        caller initialises them). Each file holding a requested key is read once: whole, or only
        the checksummed blocks holding the requested rows (``partial_read_share``).
        Raises :class:`CorruptFileError` when a file fails its checks.
        """
        keys = as_keys(keys)
        self._check_open()
        t0 = time.perf_counter()
        # zeros: absent rows stay zero, and the pages fault in on the I/O threads as rows land
        out = np.zeros((keys.size, self.width), dtype=np.float32)
        first_fds: list[int] = []
        pending: list[list] = []  # futures of whole-file rounds in flight
        opened: list[tuple[list, list]] = []
        prefetch: list = []
        n_files = n_bytes = 0
        n_partial = 0
        try:
            with self._lock:
                if keys.size * self._block_rows >= 2 * self.partial_read_share * self._index.size:
                    # So many keys that (nearly) every file will be read whole: start reading
                    # the first files while the lookup and grouping below run (~0.1 s per 2M keys).
                    early = np.flatnonzero(self._files.no >= 0)[: self._round_files]
                    opened.append(([], first_fds))  # closed at the end
                    for no in self._files.no[early].tolist():
                        first_fds.append(os.open(self._path(no), os.O_RDONLY))
                    prefetch.append(self._pool.submit(_will_need, first_fds))
                slots = self._index.find(keys)
                idx, pos, starts = _resolve(slots, self._loc_slot, self._loc_pos, self._files.capacity)
                file_no = self._files.no.copy()
                groups = np.flatnonzero(starts[1:] > starts[:-1])
                partial = self._partial_groups(groups, starts, pos, file_no)
                whole = groups[~partial]
                rf = self._round_files
                rounds = [whole[r : r + rf] for r in range(0, whole.size, rf)]
                if rounds:  # start the I/O right away
                    opened.append(self._open_round(keys, rounds[0], starts, idx, pos, file_no))
            whole_rounds = opened[-1:] if rounds else []
            if rounds:
                prefetch.append(self._pool.submit(_will_need, whole_rounds[0][1]))
            found = slots >= 0
            n_present = int(idx.size)
            # Files whose requested rows fill few blocks: only those blocks are read (memory
            # map, checksummed blocks), in rounds of open descriptors, no read-ahead hint.
            part = groups[partial]
            for r in range(0, part.size, _MAX_OPEN_FILES):
                tasks, fds = self._open_round(keys, part[r : r + _MAX_OPEN_FILES], starts, idx, pos, file_no,
                                              mapped=True)
                opened.append((tasks, fds))
                futures = [self._pool.submit(self._read_partial, keys, out, i, p, self._path(no), fd)
                           if isinstance(fd, _Map) else
                           self._pool.submit(self._read_rows, keys, out, i, p, self._path(no), fd)
                           for (i, p, no), fd in zip(tasks, fds)]
                wait(futures)
                for fut in futures:
                    b, was_partial = fut.result()
                    n_bytes += b
                    n_partial += was_partial
                n_files += len(tasks)
            # Whole files: rounds of a few files (_ROUND_BYTES), opened under the lock: an open
            # descriptor keeps a file readable even if compaction unlinks it a moment later.
            # Later rounds check that their files are still live and look up again the rows of
            # files a compaction retired. Round r + 1 is opened, hinted (WILLNEED, so the device
            # sees a deep queue) and queued on the I/O threads as soon as round r is queued; round
            # r + 2 waits until round r is done (two rounds in flight, no idle threads between).
            for r in range(len(rounds)):
                tasks, fds = whole_rounds[r]
                pending.append([
                    self._pool.submit(self._read_rows, keys, out, i, p, self._path(no), fd)
                    for (i, p, no), fd in zip(tasks, fds)
                ])
                n_files += len(tasks)
                if len(pending) > 1:
                    wait(pending[0])
                    n_bytes += sum(fut.result()[0] for fut in pending.pop(0))
                if r + 1 < len(rounds):
                    opened.append(self._open_round(keys, rounds[r + 1], starts, idx, pos, file_no))
                    whole_rounds.append(opened[-1])
                    prefetch.append(self._pool.submit(_will_need, opened[-1][1]))
            while pending:
                wait(pending[0])
                n_bytes += sum(fut.result()[0] for fut in pending.pop(0))
        finally:
            for futures in pending:  # an error left reads running: they use the descriptors
                wait(futures)
            wait(prefetch)  # before their descriptors close
            for _, fds in opened:
                self._close_all(fds)
        with self._lock:
            st = self._stats
            st["loads"] += 1
            st["rows_loaded"] += n_present
            st["rows_absent"] += int(keys.size - n_present)
            st["files_read"] += n_files
            st["files_read_partially"] += n_partial
            st["bytes_read"] += n_bytes
            st["load_seconds"] += time.perf_counter() - t0
        return out, found

    def _acquire_map(self, no: int) -> _Map:
        """The kept memory map of live file ``no`` (created on first use); call under the lock."""
        m = self._maps.get(no)
        if m is None:
            m = self._maps[no] = _Map(self._path(no))
        m.table = self._tables.get(no)
        m.refs += 1
        return m

    def _close_all(self, fds: list) -> None:
        """Close the descriptors of a round and release its kept maps."""
        with self._lock:
            for fd in fds:
                if isinstance(fd, _Map):
                    fd.release()
                else:
                    os.close(fd)

    def _drop_map(self, no: int) -> None:
        """File ``no`` leaves the live set (call under the lock)."""
        m = self._maps.pop(no, None)
        if m is not None:
            m.retire()

    def _open_round(self, keys, group_slots, starts, idx, pos, file_no, mapped: bool = False) -> tuple[list, list]:
        """Tasks ``(idx, pos, file number)`` for the file slots ``group_slots`` and, per task, an
        open descriptor (``mapped``: the file's kept memory map where it has a block table)."""
        tasks, fds, moved = [], [], []
        with self._lock:
            for s in group_slots.tolist():
                a, b = int(starts[s]), int(starts[s + 1])
                if self._files.no[s] == file_no[s]:
                    tasks.append((idx[a:b], pos[a:b], int(file_no[s])))
                else:
                    moved.append(idx[a:b])
            if moved:
                mi = np.concatenate(moved)
                ms = self._index.find(keys[mi])
                mf, mp = self._loc_slot[ms], self._loc_pos[ms]
                for s in np.unique(mf).tolist():
                    sel = mf == s
                    tasks.append((mi[sel], mp[sel], int(self._files.no[s])))
            try:
                for t in tasks:
                    if mapped and t[2] in self._tables:
                        fds.append(self._acquire_map(t[2]))
                    else:
                        fds.append(os.open(self._path(t[2]), os.O_RDONLY))
            except BaseException:
                self._close_all(fds)
                raise
        return tasks, fds

    def _read_rows(self, keys: np.ndarray, out: np.ndarray, idx: np.ndarray, pos: np.ndarray, path: str, fd: int) -> int:
        buf = getattr(self._tls, "buf", None)  # one reused read buffer per I/O thread
        size = os.fstat(fd).st_size
        if buf is None or buf.size < size:
            buf = self._tls.buf = np.empty(max(size, 1 << 20), dtype=np.uint8)
        pf = read_file(path, fd, self.width, buf=buf)
        bad = _pick_rows(out, idx, pf.rows, pos, pf.keys, keys)
        if bad >= 0:
            raise CorruptFileError(
                f"{path}: row {int(pos[bad])} does not hold key {int(keys[idx[bad]])} as the mapping says"
            )
        return pf.header.size, False

    def _partial_groups(self, groups: np.ndarray, starts: np.ndarray, pos: np.ndarray, file_no: np.ndarray) -> np.ndarray:
        """Which of the file slots ``groups`` to read partially: format-2 files whose requested
        rows lie in at most ``partial_read_share`` of their blocks."""
        if groups.size == 0 or self.partial_read_share <= 0 or not self._tables:
            return np.zeros(groups.size, dtype=bool)
        br = self._block_rows
        touched = touched_blocks(pos, starts, groups, br)
        blocks = -(-self._files.n[groups] // br)
        ok = touched <= self.partial_read_share * blocks
        if ok.any():
            have = np.fromiter((int(no) in self._tables for no in file_no[groups[ok]]), bool, int(ok.sum()))
            ok[np.flatnonzero(ok)[~have]] = False
        return ok

    def _read_partial(self, keys: np.ndarray, out: np.ndarray, idx: np.ndarray, pos: np.ndarray, path: str,
                      m: _Map) -> tuple[int, bool]:
        """Copy the requested rows of one file out of its read-only memory map, verifying the
        checksum of every block touched and the key at every position. Returns the bytes of the
        blocks touched (an estimate of what the device read)."""
        table = m.table
        size = m.size
        data = np.frombuffer(m.mm, dtype=np.uint8)
        try:
            h = decode_header(data[:HEADER_BYTES], path)
            if table is None:
                raise CorruptFileError(f"{path}: no block table to verify a partial read with")
            if (h.width != self.width or h.size != size or h.block_rows != self._block_rows
                    or h.version not in PARTIAL_VERSIONS):
                raise CorruptFileError(f"{path}: size {size} bytes, header says {h.size} "
                                       f"({h.n} rows of width {h.width}, blocks of {h.block_rows})")
            if table.size != h.n_blocks or zlib.crc32(table) != h.table_crc:
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
        return HEADER_BYTES + touched * h.block_rows * self._rec, True

    def dump(self, keys, rows) -> None:
        """Durably store ``rows`` (``float32[n, width]``) for ``keys``; the last duplicate wins.

        When this returns the rows survive a crash (``kill -9``, power loss with an honest
        disk). On failure (e.g. :class:`SSDFullError`) nothing of this call was recorded and
        the store stays readable with its previous contents.
        """
        keys = as_keys(keys)
        rows = as_rows(rows, keys.size, self.width, "dump rows")
        if keys.size == 0:
            return
        rev = np.unique(keys[::-1], return_index=True)[1]
        pick = keys.size - 1 - rev  # last occurrence of each distinct key, in key order
        keys, rows = keys[pick], rows[pick]
        t0 = time.perf_counter()
        rpf = self.rows_per_file
        with self._dump_lock:
            self._check_open()
            self._raise_compaction_error()
            n_files = -(-keys.size // rpf)
            with self._lock:
                first_no = self._next_file_no
                self._next_file_no += n_files
            nos = list(range(first_no, first_no + n_files))
            versions = np.repeat(np.asarray(nos, dtype=np.uint64), rpf)[: keys.size]
            sizes, tables = self._write_files(nos, keys, versions, rows, 0)
            self._hook("dump:written")
            try:
                self._manifest.append(add=nos, next_file_no=first_no + n_files)
            except BaseException:
                self._remove_files(nos)
                raise
            self._hook("dump:recorded")
            with self._lock:
                self._grow(keys.size)
                slots = self._index.find(keys)
                self._kill_rows(slots[slots >= 0])
                fslots = [
                    self._files.add(no, min(rpf, keys.size - i * rpf), size, min(rpf, keys.size - i * rpf), 0)
                    for i, (no, size) in enumerate(zip(nos, sizes))
                ]
                self._tables.update(tables)
                slots = self._index.find_or_insert(keys)
                pos = np.arange(keys.size, dtype=np.int64)
                self._loc_slot[slots] = np.asarray(fslots, dtype=np.int32)[pos // rpf]
                self._loc_pos[slots] = pos % rpf
                st = self._stats
                st["dumps"] += 1
                st["rows_dumped"] += int(keys.size)
                st["bytes_written"] += sum(sizes)
                st["files_written"] += n_files
                st["dump_seconds"] += time.perf_counter() - t0
                ratio = _space_ratio(self._files.disk_bytes, self._live_bytes())
            self._manifest.maybe_rewrite()
        self._wake.set()  # the thread checks needs_compaction(): space ratio, small files
        if self.max_space_ratio is not None and ratio > self.max_space_ratio:
            self._backpressure()

    def _backpressure(self) -> None:
        """Wait (or compact inline) until disk bytes ≤ ``max_space_ratio`` × live bytes.

        Never raises for a failed compaction: the dump it follows is already durable; the
        failure shows in :attr:`stats` and, if fatal, fails the next dump.
        """
        with self._lock:
            self._stats["backpressure_waits"] += 1
        if self._thread is None:
            try:
                while self._over_hard_limit() and self._compact_pass() > 0:
                    pass
            except Exception as e:  # noqa: BLE001 - the dump before it is durable; report, don't fail it
                with self._lock:
                    self._compaction_errors += 1
                    self._last_compaction_error = repr(e)
            return
        with self._lock:
            errors = self._compaction_errors
            while (
                self._over_hard_limit()
                and self._thread.is_alive()
                and self._compaction_errors == errors
                and not self._closed
            ):
                self._wake.set()
                self._pass_done.wait(0.05)

    def _over_hard_limit(self) -> bool:
        with self._lock:
            over = self._files.disk_bytes > self.max_space_ratio * self._live_bytes()
            return over and self._files.stale_slots(self._rec, self.stale_threshold).size > 0

    def _write_files(self, nos: list[int], keys: np.ndarray, versions: np.ndarray, rows: np.ndarray, flags: int) -> tuple[list[int], dict[int, np.ndarray]]:
        """Write one file per ``rows_per_file`` rows under temporary names, fsync them (in
        parallel, so the device sees a queue), rename them, fsync the directory. Returns their
        sizes and block tables (by file number), for the caller to register with the files."""
        rpf = self.rows_per_file
        tmps, sizes, tables = [], [], []
        try:
            for i, no in enumerate(nos):
                sl = slice(i * rpf, (i + 1) * rpf)
                tmp, size, table = write_tmp(self.directory, no, keys[sl], versions[sl], rows[sl], flags, self._write,
                                             fsync=False)
                tmps.append(tmp)
                sizes.append(size)
                tables.append(table)
            if len(tmps) > 1:
                list(self._pool.map(fsync_path, tmps))
            elif tmps:
                fsync_path(tmps[0])
            for no, tmp in zip(nos, tmps):
                os.rename(tmp, self._path(no))
            fsync_dir(self.directory)
        except BaseException as e:
            for tmp in tmps:
                _unlink_quiet(tmp)
            self._remove_files(nos)
            if isinstance(e, OSError) and not isinstance(e, SSDFullError) and e.errno in _FULL_ERRNOS:
                raise SSDFullError(e.errno, f"SSD-PS {self.directory}: no space left: {e.strerror}; "
                                   "nothing of this write was recorded and the store stays readable") from e
            raise
        return sizes, dict(zip(nos, tables))

    def _remove_files(self, nos) -> None:
        for no in nos:
            _unlink_quiet(self._path(no))

    # -- compaction ----------------------------------------------------------------------

    def needs_compaction(self) -> bool:
        """Disk bytes exceed ``compact_trigger`` × live bytes and some file is over the
        stale threshold, or ``merge_small_files`` small files have accumulated."""
        with self._lock:
            if self._small_slots().size >= self.merge_small_files:
                return True
            if self._files.disk_bytes <= self.compact_trigger * self._live_bytes():
                return False
            return self._files.stale_slots(self._rec, self.stale_threshold).size > 0

    def _small_slots(self) -> np.ndarray:
        """Files with fewer than half of ``rows_per_file`` rows (small dumps write them)."""
        f = self._files
        return np.flatnonzero((f.no >= 0) & (f.n < max(2, self.rows_per_file // 2)))

    def compact(self, full: bool = False) -> int:
        """Run compaction passes now, in this thread, until no file exceeds the stale
        threshold (``full=True``: until no file has a stale row). Returns files rewritten."""
        self._check_open()
        done = 0
        while True:
            n = self._compact_pass(full)
            if n == 0:
                return done
            done += n

    def _compact_pass(self, full: bool = False) -> int:
        with self._compact_lock:
            t0 = time.perf_counter()
            f = self._files
            with self._lock:
                cand = f.stale_slots(self._rec, None if full else self.stale_threshold)
                cand = cand[np.argsort(f.live[cand] / f.n[cand], kind="stable")]  # most stale first
                small = self._small_slots()
                if small.size >= self.merge_small_files or (full and small.size > 1):
                    small = small[np.argsort(f.no[small], kind="stable")]  # oldest first
                    cand = np.concatenate([cand, small[~np.isin(small, cand)]])
                within = np.cumsum(f.size[cand]) <= self.compact_pass_bytes
                within[:1] = True
                victims = cand[within]
                victim_nos = f.no[victims].tolist()
            if victims.size == 0:
                return 0
            parts, bytes_read = [], 0
            for s, no in zip(victims.tolist(), victim_nos):
                pf = read_file(self._path(no), None, self.width)
                bytes_read += pf.header.size
                with self._lock:
                    slots = self._index.find(pf.keys)
                    ok = slots >= 0
                    ok[ok] = (self._loc_slot[slots[ok]] == s) & (self._loc_pos[slots[ok]] == np.flatnonzero(ok))
                live = np.flatnonzero(ok)
                parts.append((pf.keys[live], pf.versions[live], pf.rows[live], np.full(live.size, s), live))
            keys = np.concatenate([p[0] for p in parts])
            vers = np.concatenate([p[1] for p in parts])
            rows = np.concatenate([p[2] for p in parts])
            src_slot = np.concatenate([p[3] for p in parts]).astype(np.int32)
            src_pos = np.concatenate([p[4] for p in parts]).astype(np.int32)
            del parts
            self._hook("compaction:read")
            rpf = self.rows_per_file
            n_out = -(-keys.size // rpf)
            with self._lock:
                first_no = self._next_file_no
                self._next_file_no += n_out
            nos = list(range(first_no, first_no + n_out))
            sizes, tables = self._write_files(nos, keys, vers, rows, FLAG_COMPACTED) if n_out else ([], {})
            self._hook("compaction:written")
            with self._lock:
                slots = self._index.find(keys)
                still = slots >= 0  # rows no dump has superseded while this pass ran
                still[still] = (self._loc_slot[slots[still]] == src_slot[still]) & (
                    self._loc_pos[slots[still]] == src_pos[still]
                )
                try:
                    self._manifest.append(add=nos, delete=victim_nos, next_file_no=first_no + n_out)
                except BaseException:
                    self._remove_files(nos)
                    raise
                self._hook("compaction:recorded")
                pos = np.arange(keys.size, dtype=np.int64)
                live_per = np.bincount(pos[still] // rpf, minlength=n_out)
                out_slots = np.asarray(
                    [f.add(no, min(rpf, keys.size - i * rpf), size, int(live_per[i]), FLAG_COMPACTED)
                     for i, (no, size) in enumerate(zip(nos, sizes))],
                    dtype=np.int32,
                )
                self._tables.update(tables)
                if n_out:
                    self._loc_slot[slots[still]] = out_slots[pos[still] // rpf]
                    self._loc_pos[slots[still]] = pos[still] % rpf
                for s, no in zip(victims.tolist(), victim_nos):
                    f.remove(s)
                    self._tables.pop(no, None)
                    self._drop_map(no)
                    _unlink_quiet(self._path(no))
                st = self._stats
                st["compactions"] += 1
                st["files_compacted"] += len(victim_nos)
                st["compaction_bytes_read"] += bytes_read
                st["compaction_bytes_written"] += sum(sizes)
                st["compaction_seconds"] += time.perf_counter() - t0
            self._manifest.maybe_rewrite()
            return len(victim_nos)

    def _hook(self, point: str) -> None:
        """Test seam: called at named points of the write protocol (see the crash tests)."""

    def _compaction_loop(self) -> None:
        while not self._closed:
            self._wake.wait(0.5)
            self._wake.clear()
            if self._closed:
                break
            try:
                while not self._closed and self.needs_compaction():
                    if self._compact_pass() == 0:
                        break
                    with self._lock:
                        self._passes += 1
                        self._pass_done.notify_all()
            except Exception as e:  # noqa: BLE001 - shown in stats; a fatal one fails the next dump
                with self._lock:
                    self._compaction_errors += 1
                    self._last_compaction_error = repr(e)
                    if not isinstance(e, SSDFullError):  # a full disk may drain; retry on wake
                        self._fatal_error = e
                    self._pass_done.notify_all()
                if self._fatal_error is not None:
                    return

    def _raise_compaction_error(self) -> None:
        e = self._fatal_error
        if e is not None:
            raise SSDError(
                f"SSD-PS {self.directory}: background compaction stopped after an error ({e!r}); "
                "acknowledged rows are intact, reopen the store after fixing the cause"
            ) from e

    def wait_compaction(self, timeout: float | None = None) -> bool:
        """Block until compaction has nothing left to do (per ``compact_trigger``); compacts
        inline without a background thread. Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.needs_compaction():
            if self._thread is None:
                self._compact_pass()
                continue
            with self._lock:
                passes, errors = self._passes, self._compaction_errors
                self._wake.set()
                while self._passes == passes and self._compaction_errors == errors:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._wake.set()
                    self._pass_done.wait(0.1 if left is None else min(0.1, left))
                if self._compaction_errors != errors:
                    raise SSDError(f"SSD-PS {self.directory}: compaction failed: {self._last_compaction_error}")
        return True

    # -- inspection ----------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Counters and sizes: files, disk/live bytes, space ratio, I/O and compaction totals."""
        with self._lock:
            f = self._files
            live = self._live_bytes()
            used = f.no >= 0
            return dict(
                self._stats,
                files=len(f),
                live_rows=self._index.size,
                live_bytes=live,
                disk_bytes=f.disk_bytes,
                space_ratio=_space_ratio(f.disk_bytes, live),
                stale_rows=int((f.n[used] - f.live[used]).sum()),
                compaction_errors=self._compaction_errors,
                last_compaction_error=self._last_compaction_error,
            )

    def file_stats(self) -> list[dict]:
        """Per file: number, rows, live rows, stale rows, bytes, whether compaction wrote it."""
        with self._lock:
            f = self._files
            return [
                {"file_no": int(f.no[s]), "rows": int(f.n[s]), "live": int(f.live[s]),
                 "stale": int(f.n[s] - f.live[s]), "bytes": int(f.size[s]),
                 "compacted": bool(f.flags[s] & FLAG_COMPACTED)}
                for s in sorted(f.slot_of.values(), key=lambda s: f.no[s])
            ]

    def scan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, rows)`` of the live rows, file by file (checksums verified).

        Compaction is paused until the scan ends (a pass that moved rows from a file not yet
        scanned into a new one would hide them from it); every live row is yielded once as long
        as no dump runs concurrently.
        """
        with self._compact_lock:
            yield from self._scan()

    def _scan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self._lock:
            nos = sorted(self._files.slot_of)
        for no in nos:
            with self._lock:
                s = self._files.slot_of.get(no)
                if s is None:
                    continue
                fd = os.open(self._path(no), os.O_RDONLY)
            try:
                pf = read_file(self._path(no), fd, self.width)
            finally:
                os.close(fd)
            with self._lock:
                slots = self._index.find(pf.keys)
                ok = slots >= 0
                ok[ok] = (self._loc_slot[slots[ok]] == s) & (self._loc_pos[slots[ok]] == np.flatnonzero(ok))
            yield pf.keys[ok].copy(), pf.rows[ok].copy()

    def verify(self) -> int:
        """Read every file and check its checksums; returns the number of files checked."""
        return sum(1 for _ in self.scan())

    # -- lifecycle -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SSDError(f"SSD-PS {self.directory} is closed")

    def close(self) -> None:
        """Stop the compaction thread (after its current pass), release files. Idempotent."""
        if self._closed:
            return
        with self._dump_lock:
            self._closed = True
            self._wake.set()
            if self._thread is not None:
                self._thread.join()
            with self._compact_lock:
                self._pool.shutdown(wait=True)
                self._manifest.close()
                with self._lock:
                    for no in list(self._maps):
                        self._drop_map(no)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SSDPS({self.directory!r}, width={self.width}, rows={len(self)}, files={len(self._files)})"
