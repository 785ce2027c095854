"""Storage engines of one node, with no Ray inside (docs/architecture.md: Tiers).

* :class:`SSDPS` (:mod:`~hpsray.tiers.ssd`) — every row of the node's shard in append-only,
  checksummed parameter files with a manifest, stale counters and background compaction;
  acknowledged dumps survive ``kill -9``.
* :class:`MemPS` (:mod:`~hpsray.tiers.mem`) — the node's rows in host memory: an LRU → LFU
  cache over SSD-PS whose in-flight batches' rows are pinned.
* :class:`Partitioner` (:mod:`~hpsray.tiers.partition`) — owner node and device of each key.

HBM-PS, the trainer's working set over its devices, is :mod:`hpsray.tiers.hbm` (one per row
group of tables of their own widths: :mod:`hpsray.tiers.grouped_hbm`).

Formats, protocols and measurements: ``docs/tiers.md``.
"""

from hpsray.tiers.cache_policy import LruLfuPolicy, belady_hit_rate
from hpsray.tiers.mem import MemPS, rows_for_bytes
from hpsray.tiers.partition import Partitioner, device_of, group_by, owner_of, place
from hpsray.tiers.ssd import DEFAULT_FILE_BYTES, SSDPS, default_rows_per_file

__all__ = [
    "DEFAULT_FILE_BYTES",
    "SSDPS",
    "LruLfuPolicy",
    "MemPS",
    "Partitioner",
    "belady_hit_rate",
    "default_rows_per_file",
    "device_of",
    "group_by",
    "owner_of",
    "place",
    "rows_for_bytes",
]
