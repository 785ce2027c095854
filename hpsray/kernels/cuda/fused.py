"""The fused sparse path on the GPU: :mod:`hpsray.kernels.fused`'s kernels in numba.cuda.

* ``k_lookup_rows``: one thread per distinct key probes the buckets and copies its row's first
  ``dim`` floats into a compact buffer (``k_find`` + ``k_gather`` in one launch);
* ``k_pool``: one thread per (bag, column) sums the bag's rows in bag order from zero;
* ``k_bag_of`` and ``k_pool_backward``: the positions are grouped by distinct row with the
  table's stable radix grouping (each group in bag order), and one thread per (row, column) sums
  its bags' pooled gradients in that order from zero.

The same float operations in the same order as the CPU kernels (and the reference), so the
simulator gives bit-equal results; on a GPU only the optimizer's FMA contraction may differ in
the last bits, as in the table's other kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hpsray.kernels.cuda.common import cuda
from hpsray.kernels.cuda.probing import probe
from hpsray.kernels.fused import FusedBags, bag_ends


@cuda.jit
def k_lookup_rows(bkeys, bslots, mask, keys, arena, slots, rows, stat):
    """``slots[u]`` = slot of ``keys[u]`` (-1 and ``stat[0] = 1`` when absent), ``rows[u]`` its
    first ``dim`` floats (zeros when absent)."""
    u = cuda.grid(1)
    if u < keys.size:
        s = probe(bkeys, bslots, mask, keys[u])
        slots[u] = s
        if s < 0:
            stat[0] = 1
        for j in range(rows.shape[1]):
            rows[u, j] = arena[s, j] if s >= 0 else np.float32(0.0)


@cuda.jit
def k_pool(rows, inverse, ends, pooled):
    t = cuda.grid(1)
    dim = pooled.shape[1]
    if t < pooled.shape[0] * dim:
        b = t // dim
        j = t - b * dim
        v = np.float32(0.0)
        for p in range(ends[b], ends[b + 1]):
            v += rows[inverse[p], j]
        pooled[b, j] = v


@cuda.jit
def k_bag_of(ends, bag_of):
    b = cuda.grid(1)
    if b < ends.size - 1:
        for p in range(ends[b], ends[b + 1]):
            bag_of[p] = b


@cuda.jit
def k_pool_backward(grad_pooled, bag_of, inverse, order, starts, acc):
    """``acc[row]`` = the pooled gradients of the bags of the positions in ``row``'s group, in
    bag order from zero."""
    t = cuda.grid(1)
    dim = acc.shape[1]
    n_groups = starts.size - 1
    if t < n_groups * dim:
        r = t // dim
        j = t - r * dim
        v = np.float32(0.0)
        for q in range(starts[r], starts[r + 1]):
            v += grad_pooled[bag_of[order[q]], j]
        acc[inverse[order[starts[r]]], j] = v


class CudaTableLookup:
    """The fused path over one :class:`~hpsray.kernels.cuda.CudaHashTable`, as
    :class:`~hpsray.kernels.fused.TableLookup` is over a CPU table: the bag layout is counted on
    the host, the keys are deduplicated on the device (CuPy), and every pass after runs there."""

    def __init__(self, table: Any, columns: int, on_backward: Callable[[Any, Any, Any], None] | None = None) -> None:
        self.table, self.columns, self.on_backward = table, columns, on_backward

    def forward(self, batch: Any) -> FusedBags:
        import cupy

        from hpsray.kernels.arrays import distinct_inverse

        ends, order = bag_ends(batch.offsets, batch.slots, batch.n_slots)
        keys = batch.keys if order is None else batch.keys[order]
        unique_keys, inverse = distinct_inverse(cupy, cupy.asarray(keys))
        dends = cupy.asarray(ends)
        pooled, slots = self.table.lookup_pool(unique_keys, inverse, dends, self.columns)
        return FusedBags(cupy.asarray(pooled), dends, inverse, slots, unique_keys, len(batch), batch.n_slots)

    def backward(self, bags: FusedBags, grad_pooled: Any) -> tuple[Any, Any]:
        import cupy

        grads = cupy.asarray(self.table.pool_backward(grad_pooled, bags.ends, bags.row_of, bags.keys.shape[0]))
        if self.on_backward is not None:
            self.on_backward(bags.keys, grads, bags.slots)
        return bags.keys, grads
