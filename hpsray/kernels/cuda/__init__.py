"""CUDA backend of :class:`~hpsray.kernels.table.HashTable`, in numba.cuda (runs under the simulator).

Same results as the CPU backend, bit for bit: slots, sums and last-wins of duplicates in input
order, :class:`~hpsray.errors.TableFullError` with the table unchanged. Kernels by family, as
HierarchicalKV splits its core kernels:

* :mod:`~hpsray.kernels.cuda.probing`: find, claim, commit, rollback and erase of buckets;
* :mod:`~hpsray.kernels.cuda.scans`: chunked exclusive scans, compaction, stable radix grouping;
* :mod:`~hpsray.kernels.cuda.rows`: initialise, gather, scatter and optimizer-apply rows;
* :mod:`~hpsray.kernels.cuda.table`: :class:`CudaHashTable`, which owns the device state and
  launches the kernels; :mod:`~hpsray.kernels.cuda.device`: :func:`cuda_available`,
  :func:`simulator_enabled`, :func:`is_device_array` and the table's inputs put on the device;
* :mod:`~hpsray.kernels.cuda.common`: the constants the kernels compile in, numba's modules typed.

The design (lock-free insert, pending slots, grouping of duplicates): docs/architecture.md,
section "Hash table" ("On the GPU").
"""

from __future__ import annotations

from hpsray.kernels.cuda.common import config
from hpsray.kernels.cuda.device import cuda_available, is_device_array, simulator_enabled
from hpsray.kernels.cuda.table import CudaHashTable

# A mini-batch's tables are small next to a GPU: numba's "grid size N will likely result in GPU
# under-utilization" warning would fire on most launches and say nothing a caller can act on.
# numba reads the switch at each launch. (``config`` is ``numba.config``: common.py says why
# under that name.)
config.CUDA_LOW_OCCUPANCY_WARNINGS = False

__all__ = ["CudaHashTable", "cuda_available", "is_device_array", "simulator_enabled"]
