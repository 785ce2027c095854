"""The disk under SSD-PS in the plan: its measured random-read bound, cached per disk, and what it
adds to the load stage of a job bigger than memory.

A missed row the page cache does not hold costs the load stage :func:`reads_per_missed_row` random
reads of the disk (a partial load reads the touched block's keys and its rows, or only the row of a
one-row block, :mod:`~hpsray.tiers.ssd.reads`), in flight at once (a load thread's io_uring ring,
else the store's ``io_threads``): ``reads / bound(deepest depth probed)`` seconds, on top of the
engine's own seconds (the calibration's store is small and cached). The share of missed rows read
from the disk (:func:`cold_share`) is what the page cache cannot hold: the store's bytes beyond the
memory the plan leaves to the cache.

The bound is measured with ``hpsray plan --calibrate`` (:func:`measure_bound`: a scratch file in the
SSD-PS directory's file system, random reads of one checksummed block at depths 1, 8, 32, the
store's I/O threads and the depth its loads keep in flight, :func:`hpsray.blockio.queue_depth`, a
second each) and cached beside the stage costs (:func:`cache_file`), keyed by this host and the
disk's device; like the stage costs, a bound measured while the load average is above the cores
serves that plan only and is not cached (other processes' reads share the disk).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict

from hpsray.blockio import queue_depth
from hpsray.fileio import write_json
from hpsray.plan.pipeline_cost import cache_file as costs_cache_file
from hpsray.tiers.ssd.paramfile import block_rows_for
from hpsray.tiers.ssd.probe import DEPTHS, DiskBound, probe

__all__ = [
    "CACHE_NAME",
    "READS_PER_MISSED_ROW",
    "cache_file",
    "cold_share",
    "disk_key",
    "disk_s_per_row",
    "load_bound",
    "load_depth",
    "measure_bound",
    "reads_per_missed_row",
    "save_bound",
]

CACHE_NAME = "plan-disk-bound.json"
READS_PER_MISSED_ROW = 2.0  # a touched block's keys and its rows: two ranges of a partial load


def reads_per_missed_row(width: int) -> float:
    """Random reads a missed row of ``width`` floats costs: its block's keys and rows
    (:data:`READS_PER_MISSED_ROW`), or only its row for a one-row block, read without its key."""
    return 1.0 if block_rows_for(width) == 1 else READS_PER_MISSED_ROW


SCRATCH_BYTES = 512 << 20  # the probe's file: beyond what a disk's own cache serves hot


def cache_file() -> str:
    """The cache's path, beside the stage costs' (it need not exist)."""
    return os.path.join(os.path.dirname(costs_cache_file()), CACHE_NAME)


def _existing(path: str | None) -> str:
    """The existing directory nearest ``path`` (the temporary directory for none)."""
    path = path or tempfile.gettempdir()
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            return "."
        path = parent
    return path


def disk_key(path: str | None) -> str:
    """What a bound belongs to: this host and the device of the file system holding ``path``."""
    st = os.stat(_existing(path))
    return f"{socket.gethostname()}|{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def load_bound(path: str | None) -> DiskBound | None:
    """The cached bound of the disk holding ``path``, or ``None`` (none, another disk, unreadable)."""
    try:
        with open(cache_file()) as f:
            d = json.load(f)
        if d.pop("key") != disk_key(path) or "issued_by" not in d.get("extra", {}):
            return None  # another disk's, or measured before the probe read through a ring
        for name in ("reads_per_s", "bytes_per_s", "reads", "seconds"):
            d[name] = {int(k): v for k, v in d[name].items()}
        return DiskBound(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def save_bound(bound: DiskBound, path: str | None) -> str:
    """Cache ``bound`` as the bound of the disk holding ``path``; returns the cache's path."""
    out = cache_file()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_json(out, {**asdict(bound), "key": disk_key(path)})
    return out


def measure_bound(
    path: str | None, width: int, io_threads: int, seconds: float = 1.0, nbytes: int = SCRATCH_BYTES
) -> tuple[DiskBound, str | None]:
    """Measure the bound of the disk holding ``path`` (a scratch file there, removed after) at
    reads of one block of rows of ``width`` floats; cache it unless the machine was busy.
    Returns the bound and why it was not cached (``None``: cached)."""
    where = _existing(path)
    with tempfile.TemporaryDirectory(prefix="hpsray-disk-", dir=where) as d:
        from hpsray.tiers.ssd.probe import scratch_file

        f = scratch_file(d, nbytes)
        depths = tuple(sorted({*DEPTHS, max(1, io_threads), queue_depth(io_threads)}))
        bound = probe([f], block_rows_for(width) * 4 * width, depths, seconds)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if bound.load_average > cores:
        return bound, f"load average {bound.load_average:.1f} above the {cores} cores"
    if not bound.direct:
        return bound, bound.note
    save_bound(bound, path)
    return bound, None


def cold_share(store_bytes: float, cache_bytes: float) -> float:
    """The share of missed rows read from the disk: the store's bytes the page cache
    (``cache_bytes``, at least 0) cannot hold, over the store's bytes."""
    if store_bytes <= 0:
        return 0.0
    return max(0.0, 1.0 - max(cache_bytes, 0.0) / store_bytes)


def load_depth(bound: DiskBound, io_threads: int) -> int:
    """The reads in flight a load's misses see: the deepest depth ``bound`` probed, or
    ``io_threads`` if deeper (see :func:`disk_s_per_row`)."""
    return max(1, io_threads, *bound.reads_per_s)


def disk_s_per_row(bound: DiskBound, io_threads: int, share: float, width: int = 0) -> float:
    """Disk seconds per missed row: ``share`` of the rows read from the disk, each
    :func:`reads_per_missed_row` random reads (``width`` 0: two) at the bound's deepest probed
    depth, or ``io_threads`` if deeper: each I/O thread hints its whole share of a load's ranges
    before reading them (:mod:`hpsray.blockio`), so the device sees far more reads in flight
    than there are threads."""
    rate = bound.at(load_depth(bound, io_threads))
    reads = reads_per_missed_row(width) if width else READS_PER_MISSED_ROW
    return share * reads / rate if rate > 0 else 0.0
