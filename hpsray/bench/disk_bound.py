"""The load stage beside the disk's random-read bound, for ``hpsray bench ssd`` and
``hpsray bench bigger-than-memory``.

:func:`store_bound` probes a store's own parameter files (:func:`hpsray.tiers.ssd.probe.probe`) at
the size of one checksummed block of rows, page-rounded (what a partial load reads per touched
block); :func:`load_vs_bound` turns the store's counters over some loads (``SSDPS.stats``
differences) into the load stage's reads/s and bytes/s and their ratios to the bound at the
store's queue depth (:func:`hpsray.blockio.queue_depth`: its io_uring ring's, else its I/O
threads): ``load_reads_vs_disk_bound`` and ``load_bytes_vs_disk_bound``
(the reads counted include those the page cache served: ``reads_mapped_share`` of them were
copied from a mapping, ``reads_ring_share`` read through the load threads' io_uring rings).
:func:`read_bound` is the most a spilled pass can reach beside the in-memory one when its
missed rows must come from the disk at that bound.
"""

from __future__ import annotations

import os

from hpsray.tiers.ssd.paramfile import SUFFIX, block_rows_for
from hpsray.tiers.ssd.probe import DEPTHS, DiskBound, probe

__all__ = ["COUNTERS", "block_bytes", "delta", "load_vs_bound", "read_bound", "store_bound"]

COUNTERS = (
    "loads",
    "rows_loaded",
    "bytes_read",
    "reads_issued",
    "reads_mapped",
    "reads_ring",
    "pages_read",
    "files_read",
    "files_read_partially",
)
COUNTERS_S = ("load_seconds", "load_cpu_seconds")


def block_bytes(width: int) -> int:
    """Bytes of row data of one checksummed block of rows of ``width`` floats."""
    return block_rows_for(width) * 4 * width


def store_bound(directory: str, width: int, depth: int, seconds: float = 2.0) -> DiskBound:
    """The random-read bound of the disk under the store ``directory``, over its parameter files,
    at depths 1, 8, 32 and the store's ``depth``, reads of one block (:func:`block_bytes`)."""
    paths = [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(SUFFIX)]
    depths = tuple(sorted({*DEPTHS, max(1, depth)}))
    return probe(paths, block_bytes(width), depths, seconds)


def delta(after: dict, before: dict) -> dict:
    """The load counters of a store's stats ``after`` less those ``before``."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS + COUNTERS_S}


def load_vs_bound(counts: dict, bound: DiskBound, depth: int) -> dict:
    """The load stage's figures over the loads of ``counts`` (:func:`delta`): per load, per row
    loaded, per second of load, and its reads/s and bytes/s over the bound at ``depth`` reads in
    flight (interpolated between measured depths)."""
    loads = max(int(counts["loads"]), 1)
    secs = max(float(counts["load_seconds"]), 1e-9)
    rows = max(int(counts["rows_loaded"]), 1)
    reads_s = counts["reads_issued"] / secs
    bytes_s = counts["bytes_read"] / secs
    disk = bound.at(depth)
    return {
        "loads": int(counts["loads"]),
        "reads_per_load": counts["reads_issued"] / loads,
        "bytes_per_load": counts["bytes_read"] / loads,
        "rows_per_load": counts["rows_loaded"] / loads,
        "seconds_per_load": secs / loads,
        "bytes_per_row": counts["bytes_read"] / rows,
        "reads_per_row": counts["reads_issued"] / rows,
        "pages_per_row": counts.get("pages_read", 0) / rows,
        "reads_mapped_share": counts.get("reads_mapped", 0) / max(int(counts["reads_issued"]), 1),
        "reads_ring_share": counts.get("reads_ring", 0) / max(int(counts["reads_issued"]), 1),
        "files_read_partially_share": counts["files_read_partially"] / max(int(counts["files_read"]), 1),
        "reads_per_s": reads_s,
        "bytes_per_s": bytes_s,
        "cpu_per_wall": float(counts["load_cpu_seconds"]) / secs,
        "queue_depth": depth,
        "disk_reads_per_s": disk,
        "disk_bytes_per_s": disk * bound.read_bytes,
        "load_reads_vs_disk_bound": reads_s / disk if disk else 0.0,
        "load_bytes_vs_disk_bound": bytes_s / (disk * bound.read_bytes) if disk else 0.0,
    }


def read_bound(
    distinct_keys_per_batch: float,
    hit_rates: dict[str, float],
    disk_s_per_missed_row: float,
    in_memory_s_per_batch: float,
) -> dict:
    """At most which share of the in-memory rate a spilled pass reaches when a batch cannot
    train before its missed rows are read: per hit rate (named in ``hit_rates``: the cache's
    measured one, Belady's at its capacity, a never-evicting cache's), a batch's missed rows
    (``distinct_keys_per_batch × (1 − hit rate)``) times the disk's seconds a missed row
    (:func:`hpsray.plan.disk.disk_s_per_row`), beside the in-memory run's seconds a batch.
    ``vs_in_memory_at_most`` is 1 where the reads take no longer than the in-memory batch."""
    by_rate = {}
    for name, rate in hit_rates.items():
        missed = distinct_keys_per_batch * (1.0 - rate)
        disk_s = missed * disk_s_per_missed_row
        by_rate[name] = {
            "hit_rate": rate,
            "missed_rows_per_batch": missed,
            "disk_s_per_batch": disk_s,
            "vs_in_memory_at_most": min(1.0, in_memory_s_per_batch / disk_s) if disk_s > 0 else 1.0,
        }
    return {
        "distinct_keys_per_batch": distinct_keys_per_batch,
        "disk_s_per_missed_row": disk_s_per_missed_row,
        "in_memory_s_per_batch": in_memory_s_per_batch,
        "by_hit_rate": by_rate,
    }
