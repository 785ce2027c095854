"""CUDA backend of :class:`~hpsray.kernels.table.HashTable`, in numba.cuda (runs under the simulator).

State lives on the device: bucket keys ``uint64[nb]`` and slots ``int64[nb]`` as two 1-D arrays
(``atomic.cas`` on the keys), the arena ``float32[capacity, width]``, ``row_keys`` and the free
stack. Its top and the size are mirrored on the host, which issues every kernel.

Insert without locks, one thread per key: probe from the home bucket; a bucket holding the key
ends the probe; an empty one is claimed with ``atomic.cas(EMPTY -> key)``, and a thread losing
the CAS to the *same* key just records that bucket. Buckets never change once set during the
kernel, so all threads of a key stop at one bucket. Each step moves on, probes are bounded by the
bucket count, and no thread waits for another: no spin-waits (they deadlock or crawl in the
simulator, whose threads are Python threads, and serialise warps on a GPU). A new bucket's slot
stays pending, holding ``atomic.min`` of its input indices = the key's first occurrence; a scan
ranks first occurrences in input order and rank ``r`` pops free-stack entry ``r`` (the CPU's
slots). The host reads one count first: if it exceeds the free rows (or a probe ran out of
buckets), the claimed buckets, all empty before the call, are reset and TableFullError raised.

Duplicates (``scatter_add``, ``assign``, ``apply_gradients``): entries are grouped by slot with a
stable radix sort on the device, then one thread per (distinct row, column) walks its group in
input order, so sums, last-wins and float rounding equal the CPU backend's; calls without
duplicates skip the sort. Scans are chunked per thread (no barriers). ``erase`` is one device
thread running the CPU's backward-shift deletion. Row copies put consecutive threads on
consecutive columns (coalesced); a call reads back at most a few integers, never inside a loop.

Layout, one module per family of kernels (as HierarchicalKV splits its core kernels):

* :mod:`~hpsray.kernels.cuda.probing`: find, claim, commit, rollback and erase of buckets;
* :mod:`~hpsray.kernels.cuda.scans`: chunked exclusive scans, compaction, and the stable LSD
  radix sort that groups entries by slot;
* :mod:`~hpsray.kernels.cuda.rows`: initialise, gather, scatter and optimizer-apply rows;
* :mod:`~hpsray.kernels.cuda.table`: :class:`CudaHashTable`, which owns the device state and
  launches the kernels, and :func:`cuda_available`, :func:`simulator_enabled`,
  :func:`is_device_array`;
* :mod:`~hpsray.kernels.cuda.common`: the constants the kernels compile in, and numba's modules
  under names typed for mypy.
"""

from __future__ import annotations

from hpsray.kernels.cuda.common import config
from hpsray.kernels.cuda.table import CudaHashTable, cuda_available, is_device_array, simulator_enabled

# A mini-batch's tables are small next to a GPU: numba's "grid size N will likely result in GPU
# under-utilization" warning would fire on most launches and say nothing a caller can act on.
# numba reads the switch at each launch. (``config`` is ``numba.config``: common.py says why
# under that name.)
config.CUDA_LOW_OCCUPANCY_WARNINGS = False

__all__ = ["CudaHashTable", "cuda_available", "is_device_array", "simulator_enabled"]
