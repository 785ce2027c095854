"""The sparse path of a mini-batch step in a few passes over its keys (CPU, numba).

What TorchRec's FBGEMM kernels fuse, done against a :class:`~hpsray.kernels.cpu.CpuHashTable`:

* **lookup + pooling forward** (:func:`lookup_pool`): the mini-batch's distinct keys (from a sort,
  :func:`~hpsray.kernels.arrays.distinct_inverse`) probed once each, their rows' first ``dim``
  floats copied into a compact buffer and every bag summed from it; the slots found are kept;
* **pooling backward** (:func:`pool_backward`): the pooled gradient summed per distinct row; the
  optimizer then runs at the slots the forward pass found
  (:meth:`~hpsray.kernels.cpu.CpuHashTable.apply_at_slots`), without a second lookup.

Bit-equal to the unfused path and the reference: a bag sums its rows, and a row its bags'
gradients, in bag order starting from zero; the optimizer is
:func:`~hpsray.kernels.optim.apply_row_update`. Bag order and threads: docs/architecture.md,
section "Hash table" ("The fused sparse path").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba import njit, prange

from hpsray.kernels.arrays import distinct_inverse
from hpsray.kernels.hashing import EMPTY_KEY, bucket_hash

__all__ = ["bag_ends", "lookup_pool", "pool_backward"]

_EMPTY = EMPTY_KEY


@njit(cache=True, nogil=True)
def _bag_counts(offsets, slots, n_slots, ends):
    """``ends[b + 1] - ends[b]`` = keys of bag ``b`` (then a prefix sum); returns whether the
    keys already are in bag order."""
    n_examples = offsets.size - 1
    in_order = True
    last = -1
    for e in range(n_examples):
        for i in range(offsets[e], offsets[e + 1]):
            b = e * n_slots + slots[i]
            ends[b + 1] += 1
            if b < last:
                in_order = False
            last = b
    for b in range(ends.size - 1):
        ends[b + 1] += ends[b]
    return in_order


@njit(cache=True, nogil=True)
def _bag_order(offsets, slots, n_slots, ends, order):
    """Positions of the keys sorted by bag, stable (a counting sort over ``ends``)."""
    fill = ends[:-1].copy()
    for e in range(offsets.size - 1):
        for i in range(offsets[e], offsets[e + 1]):
            b = e * n_slots + slots[i]
            order[fill[b]] = i
            fill[b] += 1


def bag_ends(
    offsets: npt.NDArray[np.int64], slots: npt.NDArray[np.int32], n_slots: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
    """``(ends, order)`` of a batch's bags: bag ``b``'s keys are positions ``ends[b]`` to
    ``ends[b + 1]`` in bag order (``int64[B * n_slots + 1]``), and position ``p`` is key
    ``order[p]`` of the batch (``None`` when the keys already are in bag order)."""
    n_bags = (offsets.size - 1) * n_slots
    ends = np.zeros(n_bags + 1, dtype=np.int64)
    if _bag_counts(offsets, slots, n_slots, ends):
        return ends, None
    order = np.empty(int(ends[-1]), dtype=np.int64)
    _bag_order(offsets, slots, n_slots, ends, order)
    return ends, order


@njit(parallel=True, cache=True)
def _lookup_pool(buckets, mask, arena, unique_keys, inverse, ends, slots, rows, pooled):
    n_rows, dim = rows.shape
    for u in prange(n_rows):  # each distinct key: its slot and its row, once
        k = unique_keys[u]
        s = np.int64(-1)
        if k != _EMPTY:
            h = bucket_hash(k) & mask
            while True:
                kk = buckets[h, 0]
                if kk == k:
                    s = np.int64(buckets[h, 1])
                    break
                if kk == _EMPTY:
                    break
                h = (h + np.uint64(1)) & mask
        slots[u] = s
        for j in range(dim):
            rows[u, j] = arena[s, j] if s >= 0 else np.float32(0.0)
    for b in prange(pooled.shape[0]):  # each bag: its rows' sum, in bag order from zero
        for j in range(dim):
            pooled[b, j] = np.float32(0.0)
        for p in range(ends[b], ends[b + 1]):
            u = inverse[p]
            for j in range(dim):
                pooled[b, j] += rows[u, j]


def lookup_pool(
    buckets: np.ndarray,
    mask: np.uint64,
    arena: npt.NDArray[np.float32],
    unique_keys: npt.NDArray[np.uint64],
    inverse: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    dim: int,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """``(pooled float32[n_bags, dim], slots int64[U])``: the slot of each distinct key (-1 if
    absent) and each bag's sum of the first ``dim`` floats of its keys' rows (key at bag-order
    position ``p`` is ``unique_keys[inverse[p]]``). The rows are read from the arena once per
    distinct key into a compact buffer that the pooling then reads: on a large table that is
    ~3x fewer random reads than probing every key at 100 keys per example."""
    n = unique_keys.size
    slots = np.empty(n, dtype=np.int64)
    rows = np.empty((n, dim), dtype=np.float32)
    pooled = np.empty((ends.size - 1, dim), dtype=np.float32)
    _lookup_pool(buckets, mask, arena, unique_keys, inverse, ends, slots, rows, pooled)
    return pooled, slots


@njit(parallel=True, cache=True)
def _backward(grad_pooled, ends, row_of, n_threads, acc):
    n_bags, dim = grad_pooled.shape
    for t in prange(n_threads):
        for b in range(n_bags):
            for p in range(ends[b], ends[b + 1]):
                r = row_of[p]
                if r % n_threads == t:
                    for j in range(dim):
                        acc[r, j] += grad_pooled[b, j]


def pool_backward(
    grad_pooled: npt.NDArray[np.float32], ends: npt.NDArray[np.int64], row_of: npt.NDArray[np.int64], n_rows: int
) -> npt.NDArray[np.float32]:
    """``float32[n_rows, dim]``: row ``r``'s gradient, the sum in bag order (from zero) of the
    pooled gradients of the bags whose keys map to it (``row_of`` per bag-order position)."""
    grad_pooled = np.ascontiguousarray(grad_pooled, dtype=np.float32)
    acc = np.zeros((n_rows, grad_pooled.shape[1]), dtype=np.float32)
    _backward(grad_pooled, ends, row_of, numba.get_num_threads(), acc)
    return acc


# The protocol by which a mini-batch step finds a table's fused path behind its ``weights_of``
# (hpsray.models.step): the step calls ``weights_of(lookup_probe())``, an empty key array; a
# lookup that has a fused path (HbmPS.get) answers with a :class:`FusedOffer`, an empty row
# array carrying the path as ``.lookup``; any other answers with empty rows, and the step
# takes the unfused path.


class LookupProbe(np.ndarray):
    """An empty ``uint64`` key array that asks a step's ``weights_of`` for a fused path."""


def lookup_probe() -> LookupProbe:
    return np.empty(0, dtype=np.uint64).view(LookupProbe)


class FusedOffer(np.ndarray):
    """Empty rows ``float32[0, columns]`` answering a :class:`LookupProbe`, carrying the fused
    path as ``.lookup`` (an object with ``forward(batch) -> bags`` and ``backward(bags,
    grad_pooled) -> (keys, grads)``; see :class:`TableLookup`). Arrays derived from it carry
    nothing, so code that reshapes what ``weights_of`` returns falls back to the unfused path."""

    lookup: object = None

    def __array_finalize__(self, obj: object) -> None:
        self.lookup = None


def fused_offer(lookup: Any, columns: int) -> FusedOffer:
    offer = np.empty((0, columns), dtype=np.float32).view(FusedOffer)
    offer.lookup = lookup
    return offer


class FusedBags:
    """A mini-batch's bags after the fused forward pass: ``pooled`` (``float32[n_bags, dim]``,
    bag ``example * n_slots + slot``), the bag ``ends`` and, per bag-order position, ``row_of``
    (index into ``keys``, the sorted distinct keys, and ``slots``, their rows' slots)."""

    __slots__ = ("pooled", "ends", "row_of", "slots", "keys", "n_examples", "n_slots")

    def __init__(
        self, pooled: Any, ends: Any, row_of: Any, slots: Any, keys: Any, n_examples: int, n_slots: int
    ) -> None:
        self.pooled, self.ends, self.row_of, self.slots, self.keys = pooled, ends, row_of, slots, keys
        self.n_examples, self.n_slots = n_examples, n_slots


class TableLookup:
    """The fused path over one :class:`~hpsray.kernels.cpu.CpuHashTable` (``columns`` floats
    per row pooled). ``on_backward(keys, grads, slots)`` is told each backward pass's result,
    so that the owner can apply the optimizer at the known slots."""

    def __init__(self, table: Any, columns: int, on_backward: Callable[[Any, Any, Any], None] | None = None) -> None:
        self.table, self.columns, self.on_backward = table, columns, on_backward

    def forward(self, batch: Any) -> FusedBags:
        ends, order = bag_ends(batch.offsets, batch.slots, batch.n_slots)
        unique_keys, inverse = distinct_inverse(np, batch.keys if order is None else batch.keys[order])
        pooled, slots = self.table.lookup_pool(unique_keys, inverse, ends, self.columns)
        return FusedBags(pooled, ends, inverse, slots, unique_keys, len(batch), batch.n_slots)

    def backward(self, bags: FusedBags, grad_pooled: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, grads)``: the sorted distinct keys of the mini-batch and their summed
        gradients."""
        grads = pool_backward(grad_pooled, bags.ends, bags.row_of, bags.slots.size)
        if self.on_backward is not None:
            self.on_backward(bags.keys, grads, bags.slots)
        return bags.keys, grads
