"""CPU backend of :class:`~hpsray.kernels.table.HashTable`, in numba.

Layout: ``buckets uint64[nb, 2]`` holds (key, slot) pairs so one probe reads one cache line;
``rows float32[capacity, width]`` is the arena; ``row_keys uint64[capacity]`` names the key of
each slot (``EMPTY_KEY`` when free); ``free`` is a stack of free slots.

Parallelism: reads (``find``, ``gather``) split keys over threads. Inserts find in parallel and
insert only the misses serially, which keeps duplicates and probe chains simple; new rows are
then initialised in parallel. Updates (``scatter_add``, ``assign``, ``apply_gradients``) use
*owner computes*: thread ``t`` applies the entries whose slot is ``t`` mod threads, in input
order, so there are no races and duplicates are combined deterministically.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt
from numba import njit, prange

from hpsray.errors import TableFullError
from hpsray.kernels.distinct import distinct_sorted, is_sorted_distinct
from hpsray.kernels.fused import lookup_pool
from hpsray.kernels.hashing import EMPTY_KEY, bucket_hash
from hpsray.kernels.init import RowInit, init_row
from hpsray.kernels.optim import SparseOptimizer, apply_row_update
from hpsray.kernels.table import HashTable, as_keys, as_rows, bucket_count, check_columns, missing_key_error, readonly

_EMPTY = EMPTY_KEY

# apply_row_update is inlined into this file's cached kernels: numba's cache keys on this file only,
# so a change of its math comes with a change here (per-row Adagrad's float64 sum, 2026-11-27)


@njit(parallel=True, cache=True)
def _find(buckets, mask, keys, out):
    for i in prange(keys.size):
        k = keys[i]
        b = bucket_hash(k) & mask
        while True:
            kk = buckets[b, 0]
            if kk == k:
                out[i] = np.int64(buckets[b, 1])
                break
            if kk == _EMPTY:
                out[i] = -1
                break
            b = (b + np.uint64(1)) & mask


@njit(cache=True)
def _insert_misses(buckets, mask, row_keys, free, state, keys, miss, out, new_slots):
    """Insert ``keys[miss]`` serially; state = [size, free_top]. Returns #new or -1 if full."""
    n_new = 0
    for t in range(miss.size):
        i = miss[t]
        k = keys[i]
        b = bucket_hash(k) & mask
        while True:
            kk = buckets[b, 0]
            if kk == k:  # a duplicate inserted earlier in this call
                out[i] = np.int64(buckets[b, 1])
                break
            if kk == _EMPTY:
                if state[1] == 0:
                    return -1 - n_new
                state[1] -= 1
                s = free[state[1]]
                buckets[b, 0] = k
                buckets[b, 1] = np.uint64(s)
                row_keys[s] = k
                state[0] += 1
                new_slots[n_new] = s
                n_new += 1
                out[i] = s
                break
            b = (b + np.uint64(1)) & mask
    return n_new


@njit(parallel=True, cache=True)
def _init_rows(rows, row_keys, slots, dim, scale, seed, state_value):
    width = rows.shape[1]
    for t in prange(slots.size):
        s = slots[t]
        init_row(rows[s], row_keys[s], dim, width, scale, seed, state_value)


@njit(cache=True)
def _erase(buckets, mask, row_keys, free, state, keys):
    removed = 0
    for i in range(keys.size):
        k = keys[i]
        b = bucket_hash(k) & mask
        while True:
            kk = buckets[b, 0]
            if kk == _EMPTY:
                b = np.uint64(0xFFFFFFFFFFFFFFFF)
                break
            if kk == k:
                break
            b = (b + np.uint64(1)) & mask
        if b == np.uint64(0xFFFFFFFFFFFFFFFF):
            continue
        s = np.int64(buckets[b, 1])
        row_keys[s] = _EMPTY
        free[state[1]] = s
        state[1] += 1
        state[0] -= 1
        removed += 1
        # backward-shift deletion: pull later members of the probe chain into the hole
        hole = b
        j = b
        while True:
            j = (j + np.uint64(1)) & mask
            kj = buckets[j, 0]
            if kj == _EMPTY:
                break
            home = bucket_hash(kj) & mask
            # move j into the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
                buckets[hole, 0] = kj
                buckets[hole, 1] = buckets[j, 1]
                hole = j
        buckets[hole, 0] = _EMPTY
        buckets[hole, 1] = np.uint64(0)
    return removed


@njit(parallel=True, cache=True)
def _gather(rows, slots, out):
    width = out.shape[1]
    for i in prange(slots.size):
        s = slots[i]
        for j in range(width):
            out[i, j] = rows[s, j]


@njit(parallel=True, cache=True)
def _scatter(rows, slots, values, add, n_threads):
    width = values.shape[1]
    for t in prange(n_threads):
        for i in range(slots.size):
            s = slots[i]
            if s % n_threads == t:
                if add:
                    for j in range(width):
                        rows[s, j] += values[i, j]
                else:
                    for j in range(width):
                        rows[s, j] = values[i, j]


@njit(parallel=True, cache=True)
def _apply_distinct(rows, slots, grads, kind, hp):
    """:func:`_apply_gradients` for slots known to be distinct: nothing to sum first."""
    dim = grads.shape[1]
    for i in prange(slots.size):
        apply_row_update(kind, rows[slots[i]], grads[i], dim, hp)


@njit(parallel=True, cache=True)
def _apply_gradients(rows, slots, grads, kind, hp, first, n_threads):
    """``first`` (int64[capacity], all -1) maps a slot to the first input index holding it."""
    dim = grads.shape[1]
    acc = np.empty_like(grads)
    for t in prange(n_threads):
        for i in range(slots.size):  # sum duplicates, in input order
            s = slots[i]
            if s % n_threads != t:
                continue
            f = first[s]
            if f < 0:
                first[s] = i
                for j in range(dim):
                    acc[i, j] = grads[i, j]
            else:
                for j in range(dim):
                    acc[f, j] += grads[i, j]
        for i in range(slots.size):  # one update per distinct row
            s = slots[i]
            if s % n_threads == t and first[s] == i:
                apply_row_update(kind, rows[s], acc[i], dim, hp)
                first[s] = -1


@njit(cache=True)
def _occupied_slots(row_keys):
    out = np.empty(row_keys.size, dtype=np.int64)
    n = 0
    for s in range(row_keys.size):
        if row_keys[s] != _EMPTY:
            out[n] = s
            n += 1
    return out[:n]


class CpuHashTable(HashTable):
    """Numba CPU hash table; see the module docstring for its layout and parallelism."""

    def __init__(self, capacity: int, width: int, init: RowInit | None = None) -> None:
        super().__init__(capacity, width, init)
        nb = bucket_count(capacity)
        self._mask = np.uint64(nb - 1)
        self._buckets = np.empty((nb, 2), dtype=np.uint64)
        self._buckets[:, 0] = _EMPTY
        self._buckets[:, 1] = 0
        self._rows = np.zeros((capacity, width), dtype=np.float32)
        self._row_keys = np.full(capacity, _EMPTY, dtype=np.uint64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # pops 0, 1, 2, ...
        self._state = np.array([0, capacity], dtype=np.int64)  # size, free-stack top
        self._first = np.full(capacity, -1, dtype=np.int64)

    @property
    def size(self) -> int:
        return int(self._state[0])

    @property
    def rows(self) -> npt.NDArray[np.float32]:
        """The arena itself (a view; slots index it)."""
        return self._rows

    @property
    def row_keys(self) -> npt.NDArray[np.uint64]:
        """Each slot's key (a view; ``EMPTY_KEY`` where free)."""
        return self._row_keys

    @staticmethod
    def _threads() -> int:
        return numba.get_num_threads()

    def find(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        keys = as_keys(keys)
        out = np.empty(keys.size, dtype=np.int64)
        _find(self._buckets, self._mask, readonly(keys), out)
        return out

    def find_or_insert(self, keys: npt.ArrayLike, initialise: bool = True) -> npt.NDArray[np.int64]:
        """Slots of ``keys``, inserting the absent ones with their initial rows (``initialise=False``:
        rows left as they are, for a caller that overwrites them right away)."""
        keys = as_keys(keys)
        out = self.find(keys)
        miss = np.flatnonzero(out < 0)
        if miss.size == 0:
            return out
        new_slots = np.empty(miss.size, dtype=np.int64)
        n_new = _insert_misses(
            self._buckets, self._mask, self._row_keys, self._free, self._state, readonly(keys), miss, out, new_slots
        )
        if n_new < 0:  # roll back this call's inserts, then report
            done = -1 - n_new
            # erase newest first so the free stack returns to its exact previous order
            self.erase(self._row_keys[new_slots[:done][::-1]].copy())
            distinct = distinct_sorted(keys[miss]).size
            raise TableFullError(
                f"hash table full: capacity {self.capacity} rows, {self.size} used, "
                f"this call needs {distinct} more; nothing was inserted"
            )
        if not initialise:
            return out
        init = self.init
        _init_rows(
            self._rows,
            self._row_keys,
            new_slots[:n_new],
            init.dim,
            np.float32(init.scale),
            np.uint64(init.seed),
            np.float32(init.state_value),
        )
        return out

    def _checked_slots(self, slots: npt.ArrayLike, op: str) -> npt.NDArray[np.int64]:
        """``slots`` as int64, each a row of this table (an absent key's -1 is refused)."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if slots.size and (slots.min() < 0 or slots.max() >= self.capacity):
            bad = slots[(slots < 0) | (slots >= self.capacity)][0]
            raise KeyError(f"{op}: slot {bad} is not a row of this table (an absent key gives -1)")
        return slots

    def gather(self, slots: npt.ArrayLike, columns: int | None = None) -> npt.NDArray[np.float32]:
        slots = self._checked_slots(slots, "gather")
        out = np.empty((slots.size, check_columns(columns, self.width)), dtype=np.float32)
        _gather(self._rows, slots, out)
        return out

    def put(self, slots: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Overwrite the rows at ``slots`` (from :meth:`find` / :meth:`find_or_insert`) with
        ``values``: the write that mirrors :meth:`gather` (a numba kernel, much faster than a numpy
        fancy assignment: docs/benchmarks.md, "Notes from the code")."""
        slots = self._checked_slots(slots, "put")
        values = as_rows(values, slots.size, self.width, "put values")
        _scatter(self._rows, readonly(slots), readonly(values), False, self._threads())

    def _present_slots(self, keys: npt.NDArray[np.uint64], op: str) -> npt.NDArray[np.int64]:
        slots = self.find(keys)
        if slots.size and slots.min() < 0:
            raise missing_key_error(keys, slots, op)
        return slots

    def scatter_add(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        keys = as_keys(keys)
        values = as_rows(values, keys.size, self.width, "scatter_add values")
        _scatter(
            self._rows, readonly(self._present_slots(keys, "scatter_add")), readonly(values), True, self._threads()
        )

    def assign(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        keys = as_keys(keys)
        values = as_rows(values, keys.size, self.width, "assign values")
        _scatter(self._rows, readonly(self._present_slots(keys, "assign")), readonly(values), False, self._threads())

    def insert_or_assign(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        keys = as_keys(keys)
        values = as_rows(values, keys.size, self.width, "insert_or_assign values")
        _scatter(
            self._rows, readonly(self.find_or_insert(keys, initialise=False)), readonly(values), False, self._threads()
        )

    def erase(self, keys: npt.ArrayLike) -> int:
        keys = as_keys(keys)
        return int(_erase(self._buckets, self._mask, self._row_keys, self._free, self._state, readonly(keys)))

    def export(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        slots = _occupied_slots(self._row_keys)
        return self._row_keys[slots].copy(), self.gather(slots)

    def keys(self) -> npt.NDArray[np.uint64]:
        return self._row_keys[_occupied_slots(self._row_keys)]

    def _check_optimizer(self, optimizer: SparseOptimizer) -> int:
        dim = self.init.dim
        if dim + optimizer.state_width(dim) != self.width:
            raise ValueError(
                f"{type(optimizer).__name__} needs rows of width {dim + optimizer.state_width(dim)} "
                f"(dim {dim}), this table has width {self.width}"
            )
        return dim

    def apply_gradients(self, keys: npt.ArrayLike, grads: npt.ArrayLike, optimizer: SparseOptimizer, step: int) -> None:
        keys = as_keys(keys)
        dim = self._check_optimizer(optimizer)
        grads = as_rows(grads, keys.size, dim, "apply_gradients grads")
        slots = self._present_slots(keys, "apply_gradients")
        if is_sorted_distinct(keys):  # a mini-batch's keys: nothing to sum first
            _apply_distinct(self._rows, slots, grads, optimizer.kind, optimizer.hyperparams(step))
            return
        _apply_gradients(
            self._rows, slots, grads, optimizer.kind, optimizer.hyperparams(step), self._first, self._threads()
        )

    # The fused sparse path (hpsray.kernels.fused): a mini-batch's lookup and pooling in one
    # kernel, the optimizer applied at the slots that lookup found.

    def lookup_pool(
        self,
        unique_keys: npt.NDArray[np.uint64],
        inverse: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        columns: int,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """``(pooled float32[n_bags, columns], slots int64[U])``: the sum-pooled first ``columns``
        floats of the rows per bag, where bag ``b`` holds the keys ``unique_keys[inverse[p]]``
        for ``ends[b] <= p < ends[b + 1]``, and the slot of each distinct key; every key must be
        present (``KeyError`` otherwise, like :meth:`get`)."""
        columns = check_columns(columns, self.width)
        unique_keys = np.ascontiguousarray(unique_keys, dtype=np.uint64)
        pooled, slots = lookup_pool(self._buckets, self._mask, self._rows, unique_keys, inverse, ends, columns)
        if slots.size and slots.min() < 0:
            raise missing_key_error(unique_keys, slots, "lookup_pool")
        return pooled, slots

    def apply_at_slots(
        self, slots: npt.NDArray[np.int64], grads: npt.NDArray[np.float32], optimizer: SparseOptimizer, step: int
    ) -> None:
        """:meth:`apply_gradients` for distinct ``slots`` already looked up (from :meth:`distinct`)."""
        dim = self._check_optimizer(optimizer)
        slots = self._checked_slots(slots, "apply_at_slots")
        grads = as_rows(grads, slots.size, dim, "apply_at_slots grads")
        _apply_distinct(self._rows, slots, grads, optimizer.kind, optimizer.hyperparams(step))

    def keys_at(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        """The keys held at ``slots``."""
        return self._row_keys[self._checked_slots(slots, "keys_at")]

    def holds_at(self, slots: npt.NDArray[np.int64], keys: npt.NDArray[np.uint64]) -> bool:
        """Whether slot ``slots[i]`` holds key ``keys[i]`` for every ``i``."""
        return bool(np.array_equal(self.keys_at(slots), keys))
