"""What a node's memory and disk must hold for its SSD-PS store, and what the node has (issue 27).

* Key map: :func:`~hpsray.tiers.ssd.keymap.map_bytes` — 20 bytes per key sized once (a bulk load
  from ``[tiers] init_from``, a reopen), 20–30 while it grows; its peak counts the old and new
  arrays of a growth, or the versions a reopen keeps per slot (30 bytes per key).
* Block tables: 4 bytes per checksummed block of :func:`~hpsray.tiers.ssd.paramfile.block_rows_for`
  rows, in memory and on disk.
* Load heat: :data:`HEAT_BYTES` per store (:mod:`~hpsray.tiers.ssd.heat`, compaction's layout).
* Disk: live bytes (16 + 4·width + the block table per row); the high-water mark is live bytes
  plus what training dumps before compaction reclaims it (at most ``compact_trigger - 1`` × live,
  the bound ``max_space_ratio`` × live).
* The node's memory: :data:`RUNTIME_BYTES` (Ray and the processes themselves) + key map (as it
  stands while training; its reopen peak is reported beside) + block tables + load heat + MEM-PS + objects
  in flight + the trainer's tables on a CPU device; the limit is the smaller of the machine's
  memory and this process's memory cgroup (what Ray's processes, started from it, inherit).
"""

from __future__ import annotations

from hpsray.memlimit import memory_limit
from hpsray.plan.sizing import ssd_live_bytes
from hpsray.tiers.ssd.heat import DEFAULT_HEAT_COUNTERS
from hpsray.tiers.ssd.keymap import map_bytes
from hpsray.tiers.ssd.paramfile import block_rows_for

__all__ = ["HEAT_BYTES", "RUNTIME_BYTES", "disk_high_water", "import_rows", "memory_limit", "ssd_memory"]

RUNTIME_BYTES = 2_400_000_000
"""Memory of a node beyond the tiers' data: Ray's GCS and raylet, the driver, the actors'
interpreters, numpy/numba/torch, read buffers. Fitted to one run of ``hpsray bench
bigger-than-memory`` (docs/benchmarks.md): resident peak 4.10 GB = this + key map 0.70 + MEM-PS
0.41 + an object store of 0.54, so the planner agrees with that run by construction."""
HEAT_BYTES = 8 * DEFAULT_HEAT_COUNTERS  # a store's load heat sketch (4 rows of uint16 counters)


def import_rows(init_from: str | None) -> int:
    """Rows ``[tiers] init_from`` holds, from its Parquet footers (0 without one)."""
    if not init_from:
        return 0
    from hpsray.tiers.ssd.bulkload import declared_rows

    return declared_rows(init_from)


def ssd_memory(rows: int, width: int, imported: int = 0) -> dict:
    """Memory of a node's SSD-PS holding ``rows`` keys of ``width`` floats, ``imported`` of them
    bulk-loaded (the key map sized once for those, grown for the rest), and its load heat."""
    steady, peak = map_bytes(max(int(rows), 1), None if imported >= rows else int(imported))
    tables = 4 * -(-int(rows) // block_rows_for(width))
    return {
        "heat_bytes": HEAT_BYTES,
        "rows": int(rows),
        "imported_rows": int(imported),
        "key_map_bytes": steady,
        "key_map_peak_bytes": peak,
        "block_table_bytes": tables,
        "bytes_per_key_memory": (steady + tables) / max(int(rows), 1),
        "bytes_per_key_disk": (ssd_live_bytes(rows, width) + tables) / max(int(rows), 1),
    }


def disk_high_water(rows: int, width: int, dumped_rows: float, compact_trigger: float, max_space_ratio: float) -> dict:
    """``{"live_bytes", "expected_bytes", "max_bytes"}`` of a store of ``rows`` live rows into
    which training dumps ``dumped_rows`` rows (each a new copy until compaction reclaims the old)."""
    live = ssd_live_bytes(rows, width) + 4 * -(-int(rows) // block_rows_for(width))
    written = ssd_live_bytes(dumped_rows, width)
    return {
        "live_bytes": live,
        "expected_bytes": int(live + min(written, (compact_trigger - 1.0) * live)),
        "max_bytes": int(live * max_space_ratio),
    }
