"""Bytes and rows per node from key figures, with the same formulas the tiers size themselves by.

* MEM-PS: ``rows × (4·width + 54) + 16 × buckets + frequency sketch`` — the cost
  :func:`hpsray.tiers.mem.rows_for_bytes` inverts for ``[tiers] mem_bytes``; the default budget
  (no ``mem_rows``/``mem_bytes``) is ``4 × batch_size × slots`` rows (hpsray/job/build.py).
* HBM-PS: ``hbm_rows`` or ``2 × batch_size × slots`` rows (hpsray/pipelines/pipeline.py), spread
  over ``n_devices`` tables of ``ceil(rows / D × 1.1) + 64`` rows each (hpsray/tiers/hbm.py); a
  working set beyond it makes the tables double (no failure, a pause and twice the memory).
* SSD-PS: live bytes = rows × (16 + 4·width); the disk holds at most ``max_space_ratio`` (2.0)
  × live bytes (docs/tiers.md, Compaction).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hpsray.kernels.table import bucket_count
from hpsray.tiers.cache_policy import DEFAULT_HISTORY, FrequencySketch
from hpsray.tiers.mem import META_BYTES_PER_ROW, rows_for_bytes

if TYPE_CHECKING:
    from hpsray.job import JobConfig

__all__ = [
    "SSD_RECORD_EXTRA",
    "batch_bytes",
    "hbm_capacity",
    "hbm_table_bytes",
    "mem_bytes_for_rows",
    "mem_capacity_rows",
    "ssd_live_bytes",
]

SSD_RECORD_EXTRA = 16  # key + version per row in a parameter file
_HBM_META_BYTES_PER_ROW = 24  # the table's row_keys / free list / first-slot arrays


def mem_bytes_for_rows(rows: int, width: int, history: float | None = DEFAULT_HISTORY) -> int:
    """Host bytes a MEM-PS of ``rows`` rows of ``width`` floats takes (the cost ``mem_bytes`` buys)."""
    rows = max(int(rows), 1)
    sketch = 4 * 2 * FrequencySketch.width_for(int(history * rows)) if history else 0
    return rows * (4 * width + META_BYTES_PER_ROW) + 16 * bucket_count(rows) + sketch


def mem_capacity_rows(job: JobConfig, n_slots: int) -> int:
    """The MEM-PS budget in rows each node gets from the job (``mem_rows``, ``mem_bytes`` or the default)."""
    t, width = job.tiers, job.train_config().row_width
    if t.mem_bytes is not None:
        return rows_for_bytes(int(t.mem_bytes), width, dict(t.mem).get("history", DEFAULT_HISTORY))
    if t.mem_rows is not None:
        return int(t.mem_rows)
    return 4 * job.pipeline.batch_size * max(n_slots, 1)


def hbm_capacity(job: JobConfig, n_slots: int) -> int:
    """Rows the trainer's HBM-PS tables are sized for at start."""
    p = job.pipeline
    return int(p.hbm_rows) if p.hbm_rows else 2 * p.batch_size * max(n_slots, 1)


def hbm_table_bytes(capacity: int, width: int, n_devices: int, working_set: int = 0) -> tuple[int, int]:
    """``(bytes, rows)`` of the node's device tables once they hold ``working_set`` rows: each of
    the ``n_devices`` tables starts at ``ceil(capacity / D × 1.1) + 64`` rows and doubles while
    its share (with the same 10 % slack for uneven hashing) does not fit."""
    per_device = int(math.ceil(capacity / n_devices * 1.1)) + 64
    share = int(math.ceil(working_set / n_devices * 1.1))
    while per_device < share:
        per_device *= 2
    one = per_device * (4 * width + _HBM_META_BYTES_PER_ROW) + 16 * bucket_count(per_device)
    return n_devices * one, n_devices * per_device


def ssd_live_bytes(rows: float, width: int) -> int:
    """Bytes of ``rows`` live rows in SSD-PS parameter files."""
    return int(round(rows * (SSD_RECORD_EXTRA + 4 * width)))


def batch_bytes(examples: float, keys_per_example: float, n_dense: int) -> int:
    """Bytes of one :class:`~hpsray.data.Batch` in the object store (labels, dense, CSR keys, slots)."""
    nnz = examples * keys_per_example
    return int(examples * (4 + 4 * n_dense + 8) + nnz * (8 + 4))
