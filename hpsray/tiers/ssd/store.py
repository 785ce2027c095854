"""SSD-PS: a node's shard of rows in append-only, checksummed parameter files (paper §6, App. E).

Contract: :meth:`SSDPS.dump` returns only once the rows are durable (files fsynced, renamed, one
manifest record fsynced); :meth:`SSDPS.load` returns every stored key's newest row and flags
keys never stored (or deleted) absent; :meth:`SSDPS.delete` is durable like a dump; disk bytes
stay ≤ ``max_space_ratio`` × live bytes (a dump waits for compaction beyond it). This module is
the facade; ``state`` holds what the parts share, ``keymap``, ``files``, ``reads``,
``compaction``, ``paramfile`` and ``manifest`` the parts. docs/tiers.md (SSD-PS) has the formats,
the durability protocol, versions, tombstones and the measurements.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
from numpy.typing import ArrayLike

from hpsray.fileio import Writer
from hpsray.kernels.distinct import is_sorted_distinct
from hpsray.kernels.table import as_keys, as_rows
from hpsray.tiers.ssd.bulkload import TableImport, bulk_load
from hpsray.tiers.ssd.compaction import Compaction, space_ratio
from hpsray.tiers.ssd.files import remove_files
from hpsray.tiers.ssd.heat import DEFAULT_HEAT_COUNTERS
from hpsray.tiers.ssd.paramfile import FLAG_COMPACTED, FLAG_TOMBSTONE, HEADER_BYTES, read_file, record_bytes
from hpsray.tiers.ssd.reads import PARTIAL_ROUND_FILES, Reads
from hpsray.tiers.ssd.snapshot import restore_snapshot, take_snapshot
from hpsray.tiers.ssd.state import StoreState

__all__ = ["DEFAULT_FILE_BYTES", "MERGE_SMALL_FILES", "SSDPS", "default_rows_per_file"]

DEFAULT_FILE_BYTES = 16 << 20
"""Target size of a parameter file when ``rows_per_file`` is not given. Measured with
``hpsray bench ssd --sweep`` (docs/tiers.md): a whole-file read costs about one device request
plus a fixed latency, so small files waste bandwidth; beyond a few MiB the gain flattens while
sparse batches read ever more unneeded rows."""

MERGE_SMALL_FILES = PARTIAL_ROUND_FILES  # 256
"""Default ``merge_small_files``. Merging rewrites live rows only to make files bigger, and a
partial load reads a small file's blocks as cheaply as a big one's, so compaction lets as many
accumulate as one partial round opens; why not 16: docs/benchmarks.md, "Small files merged
later"."""


def default_rows_per_file(width: int, file_bytes: int = DEFAULT_FILE_BYTES) -> int:
    """Rows per file so that a file of rows of ``width`` floats is about ``file_bytes``."""
    return max(1, (file_bytes - HEADER_BYTES) // record_bytes(width))


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
            rows of a file (see :mod:`~hpsray.tiers.ssd.reads`) when those blocks are at most
            this share of the file; else the whole file.
        compact_pass_bytes: most input bytes one compaction pass rewrites (the most stale
            files first), so a pass, and a dump waiting on it, stays short.
        merge_small_files: once this many files hold fewer than ``rows_per_file / 2`` rows
            (dumps write them), compaction merges them into full-size files (fewer files to
            open and list; whole-file reads of a good size).
        heat_counters: counters per row of the sketch that counts the loads of each key
            (:mod:`~hpsray.tiers.ssd.heat`; 8 bytes of memory per counter); compaction writes
            the rows loads want most first, so rows missed together share pages (0: off, rows
            keep the order compaction reads them in).
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
        merge_small_files: int = MERGE_SMALL_FILES,
        partial_read_share: float = 0.25,
        heat_counters: int = DEFAULT_HEAT_COUNTERS,
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
        if heat_counters < 0:
            raise ValueError(f"heat_counters must be >= 0, got {heat_counters}")
        if merge_small_files < 2:
            raise ValueError(f"merge_small_files must be >= 2, got {merge_small_files}")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.state = StoreState(
            self.directory,
            width,
            rows_per_file=rows_per_file,
            default_rows_per_file=default_rows_per_file,
            stale_threshold=float(stale_threshold),
            compact_trigger=float(compact_trigger),
            max_space_ratio=max_space_ratio,
            compact_pass_bytes=int(compact_pass_bytes),
            merge_small_files=int(merge_small_files),
            partial_read_share=float(partial_read_share),
            io_threads=io_threads,
            write=write,
            heat_counters=heat_counters,
        )
        """The state the store's parts share (:class:`~hpsray.tiers.ssd.state.StoreState`)."""
        self.width = self.state.width
        self.rows_per_file = self.state.rows_per_file
        self._reads = Reads(self.state)
        self._compaction = Compaction(self.state, background)
        self._compaction.start()

    # -- public API ----------------------------------------------------------------------

    def __len__(self) -> int:
        with self.state.lock:
            return self.state.keys.size

    def contains(self, keys: ArrayLike) -> np.ndarray:
        """Whether each key has a stored row."""
        keys = as_keys(keys)
        with self.state.lock:
            return self.state.keys.find(keys) >= 0

    def load(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` and a mask of which keys were found.

        Returns ``(rows float32[n, width], found bool[n])``; rows of absent keys are zero (the
        caller initialises them). Each file holding a requested key is read once: whole, or only
        the checksummed blocks holding the requested rows (``partial_read_share``). The store
        keeps the memory of its last large output and writes a later output into it once the
        caller holds no reference to it (:mod:`~hpsray.tiers.ssd.outbuf`).
        Raises :class:`CorruptFileError` when a file fails its checks.
        """
        keys = as_keys(keys)
        self.state.check_open()
        t0, c0 = time.perf_counter(), time.process_time()
        out, found, counts = self._reads.load(keys)
        if self.state.heat is not None:
            self.state.heat.count(keys[found])
        with self.state.lock:
            st = self.state.stats
            st["loads"] += 1
            for k, v in counts.items():
                st[k] += v
            st["load_seconds"] += time.perf_counter() - t0
            st["load_cpu_seconds"] += time.process_time() - c0
        return out, found

    def dump(self, keys: ArrayLike, rows: ArrayLike) -> None:
        """Durably store ``rows`` (``float32[n, width]``) for ``keys``; the last duplicate wins.

        When this returns the rows survive a crash (``kill -9``, power loss with an honest
        disk). On failure (e.g. :class:`SSDFullError`) nothing of this call was recorded and
        the store stays readable with its previous contents.
        """
        keys = as_keys(keys)
        rows = as_rows(rows, keys.size, self.width, "dump rows")
        if keys.size == 0:
            return
        if not is_sorted_distinct(keys):  # else distinct and in order already: written without a copy
            rev = np.unique(keys[::-1], return_index=True)[1]
            pick = keys.size - 1 - rev  # last occurrence of each distinct key, in key order
            keys, rows = keys[pick], rows[pick]
        t0 = time.perf_counter()
        rpf = self.rows_per_file
        with self.state.dump_lock:
            self.state.check_open()
            self._compaction.raise_fatal()
            n_files = -(-keys.size // rpf)
            nos = self.state.allocate_file_numbers(n_files)
            versions = np.repeat(np.asarray(nos, dtype=np.uint64), rpf)[: keys.size]
            sizes, tables = self.state.write_files(list(nos), keys, versions, rows, 0)
            self.state.hook("dump:written")
            try:
                self.state.manifest.append(add=list(nos), next_file_no=nos.stop)
            except BaseException:
                remove_files(self.directory, nos)
                raise
            self.state.hook("dump:recorded")
            with self.state.lock:
                kmap = self.state.keys
                slots = kmap.find(keys)
                self.state.files.kill(kmap.file_slot[slots[slots >= 0]])
                kmap.grow(int(np.count_nonzero(slots < 0)))  # only new keys take slots: no growth on rewrites
                fslots = self.state.files.add_written(nos, sizes, tables, int(keys.size), rpf, None, 0)
                pos = np.arange(keys.size, dtype=np.int64)
                kmap.place(keys, fslots[pos // rpf], pos % rpf)
                st = self.state.stats
                st["dumps"] += 1
                st["rows_dumped"] += int(keys.size)
                st["bytes_written"] += sum(sizes)
                st["files_written"] += n_files
                st["dump_seconds"] += time.perf_counter() - t0
                ratio = space_ratio(self.state.files.disk_bytes, self.state.live_bytes())
            self.state.manifest.maybe_rewrite()
        self._compaction.wake.set()  # the thread checks needs_compaction(): space ratio, small files
        if self.state.max_space_ratio is not None and ratio > self.state.max_space_ratio:
            self._compaction.backpressure()

    def bulk_load(self, spec: TableImport, shard: tuple[int, int] | None = None) -> dict:
        """Load an exported table (``spec``) into this empty store: sequential file writes, the
        key map built as they are written, one manifest edit at the end; on any error nothing is
        loaded. See :func:`~hpsray.tiers.ssd.bulkload.bulk_load`."""
        return bulk_load(self.state, spec, shard)

    def delete(self, keys: ArrayLike) -> int:
        """Durably delete the rows of ``keys`` (absent keys are skipped); returns the rows deleted.

        Writes tombstones for the stored keys as a dump writes rows (files fsynced, then one
        manifest record), so a reopen or a snapshot never brings them back; their rows count
        stale from then on and compaction reclaims them. Waits for a compaction pass in progress.
        """
        keys = np.unique(as_keys(keys))
        if keys.size == 0:
            return 0
        t0 = time.perf_counter()
        rpf = self.rows_per_file
        with self.state.dump_lock, self.state.compaction_lock:  # no pass may copy a row it is deleting
            self.state.check_open()
            with self.state.lock:
                keys = keys[self.state.keys.find(keys) >= 0]
            if keys.size == 0:
                return 0
            n_files = -(-keys.size // rpf)
            nos = self.state.allocate_file_numbers(n_files)
            versions = np.repeat(np.asarray(nos, dtype=np.uint64), rpf)[: keys.size]
            zeros = np.zeros((keys.size, self.width), dtype=np.float32)
            sizes, tables = self.state.write_files(list(nos), keys, versions, zeros, FLAG_TOMBSTONE)
            self.state.hook("delete:written")
            try:
                self.state.manifest.append(add=list(nos), next_file_no=nos.stop)
            except BaseException:
                remove_files(self.directory, nos)
                raise
            self.state.hook("delete:recorded")
            with self.state.lock:
                _, file_slots = self.state.keys.remove(keys)
                f = self.state.files
                f.kill(file_slots)
                slots = f.add_written(nos, sizes, tables, int(keys.size), rpf, None, FLAG_TOMBSTONE)
                # any older copy of a deleted key is a stale row, so it sits in a file with stale rows
                rows_files = (f.no >= 0) & ((f.flags & FLAG_TOMBSTONE) == 0) & (f.n > f.live)
                deps = f.no[rows_files].copy()
                for s in slots.tolist():
                    self.state.tombstones[int(f.no[s])] = deps
                st = self.state.stats
                st["deletes"] += 1
                st["rows_deleted"] += int(keys.size)
                st["tombstone_files_written"] += n_files
                st["bytes_written"] += sum(sizes)
                st["dump_seconds"] += time.perf_counter() - t0
            self.state.manifest.maybe_rewrite()
        self._compaction.wake.set()
        return int(keys.size)

    # -- compaction (compaction.py) ------------------------------------------------------

    def needs_compaction(self) -> bool:
        """Disk bytes exceed ``compact_trigger`` × live bytes and some file is over the
        stale threshold, or ``merge_small_files`` small files have accumulated."""
        return self._compaction.needed()

    def compact(self, full: bool = False) -> int:
        """Run compaction passes now, in this thread, until no file exceeds the stale
        threshold (``full=True``: until no file has a stale row). Returns files rewritten."""
        self.state.check_open()
        done = 0
        while True:
            n = self._compact_pass(full)
            if n == 0:
                return done
            done += n

    def relayout(self) -> int:
        """Rewrite every parameter file there is now, in compaction passes, each pass's rows
        hottest first by how many loads wanted them (``heat_counters``); returns the files
        rewritten. Placement only: what loads return is the same before and after."""
        self.state.check_open()
        return self._compaction.relayout()

    def _compact_pass(self, full: bool = False) -> int:
        return self._compaction.step(full)

    def wait_compaction(self, timeout: float | None = None) -> bool:
        """Block until compaction has nothing left to do (per ``compact_trigger``); compacts
        inline without a background thread. Returns False on timeout."""
        return self._compaction.wait(timeout)

    # -- inspection ----------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Counters and sizes: files, disk/live bytes, space ratio, key map bytes, I/O and compaction totals."""
        with self.state.lock:
            f = self.state.files
            live = self.state.live_bytes()
            return dict(
                self.state.stats,
                files=len(f),
                tombstone_files=len(self.state.tombstones),
                live_rows=self.state.keys.size,
                key_map_bytes=self.state.keys.nbytes,
                live_bytes=live,
                disk_bytes=f.disk_bytes,
                space_ratio=space_ratio(f.disk_bytes, live),
                stale_rows=f.stale_rows(),
                compaction_errors=self._compaction.errors,
                last_compaction_error=self._compaction.last_error,
            )

    def live_rows_by_tag(self) -> np.ndarray:
        """``int64[256]``: live rows per key's top byte (a table's tag when keys are tagged); each
        row takes :attr:`record` bytes of a parameter file."""
        with self.state.lock:
            return self.state.keys.count_by_tag()

    @property
    def record(self) -> int:
        """Bytes of one row in a parameter file: its key, version and ``width`` floats."""
        return int(self.state.record)

    def file_stats(self) -> list[dict]:
        """Per file: number, rows, live rows, stale rows, bytes, whether compaction wrote it."""
        with self.state.lock:
            f = self.state.files
            return [
                {
                    "file_no": int(f.no[s]),
                    "rows": int(f.n[s]),
                    "live": int(f.live[s]),
                    "stale": int(f.n[s] - f.live[s]),
                    "bytes": int(f.size[s]),
                    "compacted": bool(f.flags[s] & FLAG_COMPACTED),
                }
                for s in sorted(f.slot_of.values(), key=lambda s: f.no[s])
            ]

    def scan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, rows)`` of the live rows, file by file (checksums verified).

        Compaction is paused until the scan ends (a pass that moved rows from a file not yet
        scanned into a new one would hide them from it); every live row is yielded once as long
        as no dump runs concurrently.
        """
        with self.state.compaction_lock:
            yield from self._scan()

    def _scan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self.state.lock:
            nos = sorted(self.state.files.slot_of)
        for no in nos:
            with self.state.lock:
                s = self.state.files.slot_of.get(no)
                if s is None:
                    continue
                fd = os.open(self.state.path(no), os.O_RDONLY)
            try:
                pf = read_file(self.state.path(no), fd, self.width)
            finally:
                os.close(fd)
            assert pf.rows is not None  # a whole read has rows
            with self.state.lock:
                ok, _ = self.state.keys.lives_at(pf.keys, s, np.arange(pf.keys.size))
            yield pf.keys[ok].copy(), pf.rows[ok].copy()

    def verify(self) -> int:
        """Read every file and check its checksums; returns the number of files checked."""
        return sum(1 for _ in self.scan())

    # -- snapshots (snapshot.py) ---------------------------------------------------------

    def snapshot(self, dest: str | os.PathLike, *, link: bool = True) -> dict:
        """Reference this store's current rows in the directory ``dest`` by hard links to its
        immutable parameter files (copies where linking fails), consistent while dumps and
        compaction run; see :func:`~hpsray.tiers.ssd.snapshot.take_snapshot`. Returns
        ``{"files", "bytes", "rows", "linked", "copied", "dumps", "seconds"}``."""
        return take_snapshot(self.state, dest, link=link)

    @staticmethod
    def restore(snapshot_dir: str | os.PathLike, directory: str | os.PathLike, **options: bool) -> dict:
        """Build a store directory from a snapshot (``SSDPS(directory)`` then opens exactly its
        rows); see :func:`~hpsray.tiers.ssd.snapshot.restore_snapshot` for ``options``."""
        return restore_snapshot(snapshot_dir, directory, **options)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the compaction thread (after its current pass), release files. Idempotent."""
        if self.state.closed:
            return
        with self.state.dump_lock:
            self.state.closed = True
            self._compaction.stop()
            with self.state.compaction_lock:
                self.state.pool.shutdown(wait=True)
                self.state.manifest.close()
            self._reads.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SSDPS({self.directory!r}, width={self.width}, rows={len(self)}, files={len(self.state.files)})"
