"""SSD-PS state: the one object a store's parts share (LevelDB's ``VersionSet`` plus its options).

:class:`StoreState` holds what the store (:mod:`~hpsray.tiers.ssd.store`), its reads, its
compaction, snapshots and bulk loads all work on: the options, the locks, the file table, the
key map, the tombstones, the manifest, the file-number allocation, the counters and the I/O
threads. Each part receives it explicitly; none reaches into another part.

Locking contract: ``lock`` (re-entrant) guards ``files``, ``keys``, ``tombstones``,
``next_file_no`` and ``stats`` and is held briefly; ``dump_lock`` makes writes (dump, delete,
bulk load) sequential; ``compaction_lock`` admits one compaction pass at a time and is taken by
whatever must not see files vanish (delete, scans, snapshots, bulk loads). Order:
``dump_lock`` → ``compaction_lock`` → ``lock``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hpsray.errors import SSDError
from hpsray.fileio import Writer, fsync_path, unlink_quiet
from hpsray.tiers.ssd.files import FileTable, write_files
from hpsray.tiers.ssd.heat import LoadHeat
from hpsray.tiers.ssd.keymap import KeyMap, recover
from hpsray.tiers.ssd.manifest import Manifest
from hpsray.tiers.ssd.paramfile import block_rows_for, file_name, record_bytes

__all__ = ["STAT_NAMES", "StoreState"]

STAT_NAMES = (
    "dumps",
    "rows_dumped",
    "bytes_written",
    "files_written",
    "dump_seconds",
    "loads",
    "rows_loaded",
    "rows_absent",
    "bytes_read",
    "files_read",
    "load_seconds",
    "files_read_partially",
    "reads_issued",
    "reads_mapped",
    "reads_ring",
    "pages_read",
    "load_cpu_seconds",
    "compactions",
    "files_compacted",
    "compaction_bytes_read",
    "compaction_bytes_written",
    "compaction_seconds",
    "backpressure_waits",
    "garbage_files_removed",
    "deletes",
    "rows_deleted",
    "tombstone_files_written",
    "tombstone_files_retired",
)
"""The store's counters (``SSDPS.stats``); all start at 0. ``reads_issued``: the positioned reads
loads made (a partial load's merged ranges, a whole file's header, index, chunks and table);
``reads_mapped``: of a partial load's ranges, those the page cache held, copied from the file's
mapping without a system call (:mod:`~hpsray.tiers.ssd.maps`); ``reads_ring``: of the rest, those
read through the load thread's io_uring ring (:mod:`hpsray.uring`, opt-in); ``pages_read``: the 4 KiB pages
those reads span (a whole-file read's bytes in pages), what the device reads at the least when
the page cache holds none of them; ``load_cpu_seconds``: this
process's CPU seconds (all its threads) while loads ran."""


def _no_hook(point: str) -> None:
    """Default of :attr:`StoreState.hook`."""


class StoreState:
    """The shared state of one open SSD-PS directory; opening it recovers the key map and the
    file table from the manifest (see :func:`~hpsray.tiers.ssd.keymap.recover`).

    The options are those of :class:`~hpsray.tiers.ssd.store.SSDPS` (validated there).
    """

    def __init__(
        self,
        directory: str,
        width: int | None,
        *,
        rows_per_file: int | None,
        default_rows_per_file: Callable[[int], int],
        stale_threshold: float,
        compact_trigger: float,
        max_space_ratio: float | None,
        compact_pass_bytes: int,
        merge_small_files: int,
        partial_read_share: float,
        io_threads: int,
        write: Writer,
        heat_counters: int | None = None,
    ) -> None:
        self.directory = directory
        self.stale_threshold = stale_threshold
        self.compact_trigger = compact_trigger
        self.max_space_ratio = max_space_ratio
        self.compact_pass_bytes = compact_pass_bytes
        self.merge_small_files = merge_small_files
        self.partial_read_share = partial_read_share
        self.write = write
        self.hook: Callable[[str], None] = _no_hook
        """Test seam: called at named points of the write protocol (see the crash tests)."""
        self.heat = LoadHeat(heat_counters) if heat_counters else None
        """Loads per key (:mod:`~hpsray.tiers.ssd.heat`): compaction writes hotter rows first."""

        self.lock = threading.RLock()
        self.dump_lock = threading.Lock()
        self.compaction_lock = threading.Lock()
        self.closed = False
        self.stats: dict[str, float] = dict.fromkeys(STAT_NAMES, 0)
        self.stats["dump_seconds"] = self.stats["load_seconds"] = self.stats["compaction_seconds"] = 0.0
        self.stats["load_cpu_seconds"] = 0.0

        self.manifest = Manifest.open(directory, width, write)
        self.width = self.manifest.width
        self.record = record_bytes(self.width)
        self.block_rows = block_rows_for(self.width)
        self.rows_per_file = int(rows_per_file or default_rows_per_file(self.width))
        self.files = FileTable()
        self.keys = KeyMap()
        self.tombstones: dict[int, np.ndarray] = {}  # tombstone file number -> its dependencies
        self.next_file_no, garbage = recover(
            directory, self.manifest, self.width, self.block_rows, self.files, self.keys, self.tombstones
        )
        self.stats["garbage_files_removed"] = garbage
        self.manifest.maybe_rewrite()
        self.io_threads = max(1, io_threads)
        self.pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="ssdps-io")

    def path(self, file_no: int) -> str:
        """The path of parameter file ``file_no``."""
        return os.path.join(self.directory, file_name(file_no))

    def live_bytes(self) -> int:
        """On-disk bytes of the live rows (call under ``lock``)."""
        return self.keys.size * self.record

    def check_open(self) -> None:
        """Raise :class:`SSDError` once the store is closed."""
        if self.closed:
            raise SSDError(f"SSD-PS {self.directory} is closed")

    def allocate_file_numbers(self, n: int) -> range:
        """``n`` fresh file numbers (dumps, compaction and bulk loads draw from one counter)."""
        with self.lock:
            first = self.next_file_no
            self.next_file_no += n
        return range(first, first + n)

    def write_files(
        self, nos: list[int], keys: np.ndarray, versions: np.ndarray, rows: np.ndarray, flags: int
    ) -> tuple[list[int], dict[int, np.ndarray]]:
        """Write (and fsync, on the I/O threads) the files ``nos``, ``rows_per_file`` rows each:
        see :func:`~hpsray.tiers.ssd.files.write_files`."""
        return write_files(
            self.directory,
            nos,
            keys,
            versions,
            rows,
            self.rows_per_file,
            flags,
            self.write,
            lambda paths: list(self.pool.map(fsync_path, paths)),
        )

    def retire_file(self, slot: int) -> None:
        """The file in ``slot`` leaves the live set: out of the file table, its name unlinked (the
        caller recorded the deletion in the manifest and holds ``lock``; loads that opened it
        keep reading it through their descriptors)."""
        no = int(self.files.no[slot])
        self.files.remove(slot)
        unlink_quiet(self.path(no))
