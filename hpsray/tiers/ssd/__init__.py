"""SSD-PS: a node's shard of rows in append-only, checksummed parameter files.

The store is :class:`SSDPS` (:mod:`~hpsray.tiers.ssd.store`); the modules beside it are its
parts (key map and recovery, file table, reads, compaction) and the on-disk format
(:mod:`~hpsray.tiers.ssd.paramfile`, :mod:`~hpsray.tiers.ssd.manifest`); snapshots of a store
and restoring them are in :mod:`~hpsray.tiers.ssd.snapshot`. See docs/tiers.md.
"""

from hpsray.tiers.ssd.bulkload import TableImport, read_table
from hpsray.tiers.ssd.snapshot import restore_snapshot, verify_snapshot
from hpsray.tiers.ssd.store import DEFAULT_FILE_BYTES, SSDPS, default_rows_per_file

__all__ = [
    "DEFAULT_FILE_BYTES",
    "SSDPS",
    "TableImport",
    "default_rows_per_file",
    "read_table",
    "restore_snapshot",
    "verify_snapshot",
]
