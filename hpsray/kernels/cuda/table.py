"""The table class of the CUDA backend: :class:`CudaHashTable`, which owns the device state and
issues every kernel from the host; its inputs come onto the device through
:mod:`~hpsray.kernels.cuda.device`.

The kernels live beside it by family: :mod:`~hpsray.kernels.cuda.probing` (buckets),
:mod:`~hpsray.kernels.cuda.scans` (scans, compaction, radix grouping) and
:mod:`~hpsray.kernels.cuda.rows` (row copies and updates); the package docstring gives the design.
Over 500 lines: the one class that owns the device state.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from hpsray.errors import TableFullError
from hpsray.kernels.arrays import DeviceArray
from hpsray.kernels.cuda.common import CHUNK, EMPTY, MAX_TPB, MAXI, cuda
from hpsray.kernels.cuda.device import (
    as_device,
    cuda_available,
    device_index,
    device_keys,
    device_values,
    is_device_array,
    simulator_enabled,
)
from hpsray.kernels.cuda.probing import (
    k_claim,
    k_commit_new,
    k_erase,
    k_fill_claimed,
    k_find,
    k_new_flags,
    k_rollback,
)
from hpsray.kernels.cuda.rows import (
    k_apply_direct,
    k_apply_segments,
    k_check_slots,
    k_gather,
    k_gather_keys,
    k_init_rows,
    k_scatter_direct,
    k_scatter_segments,
    k_sum_segments,
)
from hpsray.kernels.cuda.scans import (
    k_chunk_scan,
    k_chunk_sums,
    k_compact,
    k_count_zero_bits,
    k_first,
    k_heads,
    k_iota,
    k_occupied,
    k_reset_first,
    k_segment_ids,
    k_segment_starts,
    k_serial_scan,
    k_split_chunks,
    k_zero,
)
from hpsray.kernels.distinct import distinct_sorted
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SparseOptimizer
from hpsray.kernels.table import (
    HashTable,
    Keys,
    Rows,
    Slots,
    Values,
    bucket_count,
    check_columns,
    missing_key_error,
)


class CudaHashTable(HashTable):
    """numba.cuda hash table; see the package docstring (:mod:`hpsray.kernels.cuda`) for the design.

    Methods take numpy arrays (copied to the device; results come back as numpy, so code and
    tests written for the CPU backend run unchanged) or device arrays (numba device arrays, or
    anything with ``__cuda_array_interface__`` such as torch CUDA tensors or CuPy arrays; results
    are numba device arrays, and inputs are read in place). Device keys may be ``uint64`` or
    ``int64`` (read bitwise, since torch has no full ``uint64``); device values ``float32``
    C-contiguous. Device keys are not checked on the host for the reserved key ``2**64 - 1``:
    it reads as absent (``find``, ``erase``), and inserting it raises ``ValueError`` with the
    table unchanged. :meth:`export` always returns numpy. Kernels run on the default stream.

    Args:
        capacity, width, init: as :class:`~hpsray.kernels.table.HashTable`.
        threads_per_block: CUDA block size (default 256; 64 under the simulator), at most 1024.
    """

    def __init__(
        self, capacity: int, width: int, init: RowInit | None = None, threads_per_block: int | None = None
    ) -> None:
        super().__init__(capacity, width, init)
        if not cuda_available():
            raise RuntimeError("CudaHashTable needs a CUDA device (or numba's simulator: NUMBA_ENABLE_CUDASIM=1)")
        tpb = threads_per_block or (64 if simulator_enabled() else 256)
        if not 1 <= tpb <= MAX_TPB:
            raise ValueError(f"threads_per_block must be in 1..{MAX_TPB}, got {tpb}")
        self._tpb = int(tpb)
        nb = bucket_count(capacity)
        self._mask = nb - 1
        self._bkeys = cuda.to_device(np.full(nb, EMPTY, dtype=np.uint64))
        self._bslots = cuda.to_device(np.full(nb, -1, dtype=np.int64))
        self._rows = cuda.to_device(np.zeros((capacity, width), dtype=np.float32))
        self._row_keys = cuda.to_device(np.full(capacity, EMPTY, dtype=np.uint64))
        self._free = cuda.to_device(np.arange(capacity - 1, -1, -1, dtype=np.int64))  # pops 0, 1, 2 ...
        self._first = cuda.to_device(np.full(capacity, MAXI, dtype=np.int64))
        self._size = 0
        self._free_top = capacity
        self._scratch: dict[str, DeviceArray] = {}

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._size

    @property
    def rows(self) -> DeviceArray:
        """The arena itself (a device array; slots index it)."""
        return self._rows

    @property
    def row_keys(self) -> DeviceArray:
        """Each slot's key (a device array; ``EMPTY`` where free)."""
        return self._row_keys

    @property
    def threads_per_block(self) -> int:
        return self._tpb

    def _grid(self, n: int) -> tuple[int, int]:
        return ((n + self._tpb - 1) // self._tpb, self._tpb)

    def _buf(self, name: str, n: int, dtype: npt.DTypeLike) -> DeviceArray:
        """A reusable device scratch array of at least ``n`` elements (a view of ``n``)."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = cuda.device_array(max(n, 16, 0 if buf is None else 2 * buf.size), dtype=dtype)
            self._scratch[name] = buf
        return buf[:n]

    def _stat(self) -> DeviceArray:
        stat = self._buf("stat", 4, np.int64)
        k_zero[1, 4](stat)
        return stat

    def _scan(self, x: DeviceArray, out: DeviceArray, tot: DeviceArray, tot_index: int, level: int = 0) -> None:
        """Exclusive scan of int64 ``x`` into ``out``; the total goes to ``tot[tot_index]``."""
        n = x.size
        m = (n + CHUNK - 1) // CHUNK
        if m <= 1:
            k_serial_scan[1, 1](x, out, tot, tot_index)
            return
        part = self._buf(f"scan_part{level}", m, np.int64)
        offs = self._buf(f"scan_offs{level}", m, np.int64)
        k_chunk_sums[self._grid(m)](x, part)
        self._scan(part, offs, tot, tot_index, level + 1)
        k_chunk_scan[self._grid(m)](x, offs, out)

    def _find_dev(self, dkeys: DeviceArray) -> tuple[DeviceArray, DeviceArray]:
        """(device slots, stat) for device keys; stat[0] = 1 if any key is absent."""
        n = dkeys.size
        out = cuda.device_array(n, dtype=np.int64)
        stat = self._stat()
        if n:
            k_find[self._grid(n)](self._bkeys, self._bslots, self._mask, dkeys, out, stat)
        return out, stat

    def _insert_dev(
        self, dkeys: DeviceArray, host_keys: npt.NDArray[np.uint64] | None, initialise: bool = True
    ) -> DeviceArray:
        """Device slots of ``dkeys``, inserting absent ones (see the package docstring)."""
        n = dkeys.size
        out = cuda.device_array(n, dtype=np.int64)
        if n == 0:
            return out
        grid = self._grid(n)
        claim = self._buf("claim", n, np.int64)
        flags = self._buf("flags", n, np.int64)
        ranks = self._buf("ranks", n, np.int64)
        stat = self._stat()
        k_claim[grid](self._bkeys, self._bslots, self._mask, dkeys, out, claim, stat)
        k_new_flags[grid](self._bslots, claim, flags)
        self._scan(flags, ranks, stat, 2)
        reserved, overflow, n_new, _ = (int(v) for v in stat.copy_to_host())
        if reserved or overflow or n_new > self._free_top:
            k_rollback[grid](self._bkeys, self._bslots, claim)
            keys = host_keys if host_keys is not None else dkeys.copy_to_host()
            if reserved:
                raise ValueError("keys: key 0xFFFFFFFFFFFFFFFF is reserved as the empty marker")
            distinct = distinct_sorted(keys[out.copy_to_host() < 0]).size
            raise TableFullError(
                f"hash table full: capacity {self.capacity} rows, {self.size} used, "
                f"this call needs {distinct} more; nothing was inserted"
            )
        if n_new:
            new_slots = self._buf("new_slots", n_new, np.int64)
            k_commit_new[grid](
                self._bslots, self._row_keys, self._free, self._free_top, dkeys, claim, flags, ranks, new_slots
            )
            k_fill_claimed[grid](self._bslots, claim, out)
            init = self.init
            if initialise:
                k_init_rows[self._grid(n_new)](
                    self._rows,
                    self._row_keys,
                    new_slots,
                    init.dim,
                    np.float32(init.scale),
                    np.uint64(init.seed),
                    np.float32(init.state_value),
                )
            self._free_top -= n_new
            self._size += n_new
        return out

    def _group(
        self, slots: DeviceArray, n: int, op: str, dkeys: DeviceArray, host_keys: npt.NDArray[np.uint64] | None
    ) -> tuple[DeviceArray, DeviceArray] | None:
        """Group entries by slot. Returns ``None`` when all slots are distinct, else
        ``(order, starts)``: ``order`` lists input indices grouped by slot, each group in input
        order, groups in order of first occurrence; group ``r`` is ``order[starts[r]:starts[r+1]]``.
        Raises ``KeyError`` if a slot is negative (a missing key)."""
        grid = self._grid(n)
        stat = self._stat()
        flags = self._buf("flags", n, np.int64)
        ranks = self._buf("ranks", n, np.int64)
        k_first[grid](self._first, slots, stat)
        k_heads[grid](self._first, slots, flags)
        self._scan(flags, ranks, stat, 1)
        missing, d, _, _ = (int(v) for v in stat.copy_to_host())
        if missing or d == n:
            k_reset_first[grid](self._first, slots)
            if missing:
                keys = host_keys if host_keys is not None else dkeys.copy_to_host()
                raise missing_key_error(keys, slots.copy_to_host(), op)
            return None
        seg_a = self._buf("seg_a", n, np.int64)
        seg_b = self._buf("seg_b", n, np.int64)
        ord_a = self._buf("ord_a", n, np.int64)
        ord_b = self._buf("ord_b", n, np.int64)
        k_segment_ids[grid](self._first, slots, ranks, seg_a)
        k_reset_first[grid](self._first, slots)
        k_iota[grid](ord_a)
        # stable LSD radix sort of (segment id, input index), one bit per pass
        m = (n + CHUNK - 1) // CHUNK
        part = self._buf("radix_part", m, np.int64)
        zeros_before = self._buf("radix_offs", m, np.int64)
        for bit in range(max(1, (d - 1).bit_length())):
            k_count_zero_bits[self._grid(m)](seg_a, bit, part)
            self._scan(part, zeros_before, stat, 3)
            k_split_chunks[self._grid(m)](seg_a, ord_a, bit, zeros_before, stat[3:], seg_b, ord_b)
            seg_a, seg_b, ord_a, ord_b = seg_b, seg_a, ord_b, ord_a
        starts = self._buf("starts", d + 1, np.int64)
        k_segment_starts[grid](seg_a, starts)
        return ord_a, starts

    def _result(self, dev: DeviceArray, on_device: bool) -> np.ndarray | DeviceArray:
        return dev if on_device else dev.copy_to_host()

    # -- interface -----------------------------------------------------------------------------

    def find(self, keys: Keys) -> Slots:
        dkeys, on_device, _ = device_keys(keys)
        out, _ = self._find_dev(dkeys)
        return self._result(out, on_device)

    def find_or_insert(self, keys: Keys, initialise: bool = True) -> Slots:
        dkeys, on_device, host = device_keys(keys)
        return self._result(self._insert_dev(dkeys, host, initialise), on_device)

    def _checked_slots(self, slots: Slots, op: str) -> tuple[DeviceArray, bool]:
        """(device slots, whether they came as a device array); ``KeyError`` for a slot that is
        not a row (an absent key's -1)."""
        on_device = is_device_array(slots)
        if on_device:
            dslots = as_device(slots)
            if dslots.dtype != np.int64 or dslots.ndim != 1:
                raise TypeError(f"{op}: device slots must be 1-D int64, got {dslots.dtype} {dslots.shape}")
            if dslots.size:
                stat = self._stat()
                k_check_slots[self._grid(dslots.size)](dslots, self.capacity, stat)
                if stat.copy_to_host()[0]:
                    host = dslots.copy_to_host()
                    bad = host[(host < 0) | (host >= self.capacity)][0]
                    raise KeyError(f"{op}: slot {bad} is not a row of this table (an absent key gives -1)")
        else:
            host = np.ascontiguousarray(slots, dtype=np.int64)
            if host.size and (host.min() < 0 or host.max() >= self.capacity):
                bad = host[(host < 0) | (host >= self.capacity)][0]
                raise KeyError(f"{op}: slot {bad} is not a row of this table (an absent key gives -1)")
            dslots = cuda.to_device(host)
        return dslots, on_device

    def gather(self, slots: Slots, columns: int | None = None) -> Rows:
        dslots, on_device = self._checked_slots(slots, "gather")
        out = self._gather_dev(dslots, columns)
        return self._result(out, on_device)

    def put(self, slots: Slots, values: Values) -> None:
        dslots, _ = self._checked_slots(slots, "put")
        dvalues = device_values(values, dslots.size, self.width, "put values")
        self._scatter(dslots, dvalues, False, "put", dslots, None)

    def _gather_dev(self, dslots: DeviceArray, columns: int | None = None) -> DeviceArray:
        n, width = dslots.size, check_columns(columns, self.width)
        out = cuda.device_array((n, width), dtype=np.float32)
        if n * width:
            k_gather[self._grid(n * width)](self._rows, dslots, out)
        return out

    def _scatter(
        self,
        slots: DeviceArray,
        values: DeviceArray,
        add: bool,
        op: str,
        dkeys: DeviceArray,
        host_keys: npt.NDArray[np.uint64] | None,
    ) -> None:
        n = slots.size
        if n == 0:
            return
        groups = self._group(slots, n, op, dkeys, host_keys)
        if self.width == 0:
            return
        if groups is None:
            k_scatter_direct[self._grid(n * self.width)](self._rows, slots, values, add)
        else:
            order, starts = groups
            d = starts.size - 1
            k_scatter_segments[self._grid(d * self.width)](self._rows, slots, values, order, starts, add)

    def scatter_add(self, keys: Keys, values: Values) -> None:
        dkeys, _, host = device_keys(keys)
        n = dkeys.size
        dvalues = device_values(values, n, self.width, "scatter_add values")
        slots, _ = self._find_dev(dkeys)
        self._scatter(slots, dvalues, True, "scatter_add", dkeys, host)

    def assign(self, keys: Keys, values: Values) -> None:
        dkeys, _, host = device_keys(keys)
        n = dkeys.size
        dvalues = device_values(values, n, self.width, "assign values")
        slots, _ = self._find_dev(dkeys)
        self._scatter(slots, dvalues, False, "assign", dkeys, host)  # an absent key: KeyError, nothing written

    def insert_or_assign(self, keys: Keys, values: Values) -> None:
        dkeys, _, host = device_keys(keys)
        n = dkeys.size
        dvalues = device_values(values, n, self.width, "insert_or_assign values")
        slots = self._insert_dev(dkeys, host, initialise=False)  # every new row is written below
        self._scatter(slots, dvalues, False, "insert_or_assign", dkeys, host)

    def erase(self, keys: Keys) -> int:
        dkeys, _, _ = device_keys(keys)
        if dkeys.size == 0:
            return 0
        stat = self._stat()
        k_erase[1, 1](self._bkeys, self._bslots, self._mask, self._row_keys, self._free, self._free_top, dkeys, stat)
        removed = int(stat.copy_to_host()[0])
        self._free_top += removed
        self._size -= removed
        return removed

    def _held(self) -> tuple[DeviceArray, DeviceArray] | None:
        """(device slots, device keys) of every held row in slot order; ``None`` when empty."""
        cap = self.capacity
        flags = cuda.device_array(cap, dtype=np.int64)  # not cached: export is rare, tables large
        pos = cuda.device_array(cap, dtype=np.int64)
        stat = self._stat()
        grid = self._grid(cap)
        k_occupied[grid](self._row_keys, flags)
        self._scan(flags, pos, stat, 0)
        n = int(stat.copy_to_host()[0])
        if n == 0:
            return None
        slots = cuda.device_array(n, dtype=np.int64)
        k_compact[grid](flags, pos, slots)
        keys = cuda.device_array(n, dtype=np.uint64)
        k_gather_keys[self._grid(n)](self._row_keys, slots, keys)
        return slots, keys

    def export(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        held = self._held()
        if held is None:
            return np.empty(0, dtype=np.uint64), np.empty((0, self.width), dtype=np.float32)
        slots, keys = held
        return keys.copy_to_host(), self._gather_dev(slots).copy_to_host()

    def keys(self) -> npt.NDArray[np.uint64]:
        """All keys held, in slot order, without copying the rows out (a trainer's ``retain``
        asks every batch)."""
        held = self._held()
        return np.empty(0, dtype=np.uint64) if held is None else held[1].copy_to_host()

    def apply_gradients(self, keys: Keys, grads: Values, optimizer: SparseOptimizer, step: int) -> None:
        dkeys, _, host = device_keys(keys)
        dim = self.init.dim
        if dim + optimizer.state_width(dim) != self.width:
            raise ValueError(
                f"{type(optimizer).__name__} needs rows of width {dim + optimizer.state_width(dim)} "
                f"(dim {dim}), this table has width {self.width}"
            )
        n = dkeys.size
        dgrads = device_values(grads, n, dim, "apply_gradients grads")
        hp = cuda.to_device(optimizer.hyperparams(step))
        if n == 0:
            return
        slots, _ = self._find_dev(dkeys)
        groups = self._group(slots, n, "apply_gradients", dkeys, host)
        kind = optimizer.kind
        if groups is None:
            k_apply_direct[self._grid(n)](self._rows, slots, dgrads, kind, hp)
            return
        order, starts = groups
        d = starts.size - 1
        acc = self._buf("acc", d * dim, np.float32).reshape((d, dim)) if dim else cuda.device_array((d, 0), np.float32)
        if dim:
            k_sum_segments[self._grid(d * dim)](dgrads, order, starts, acc)
        k_apply_segments[self._grid(d)](self._rows, slots, order, starts, acc, kind, hp)

    # -- the fused sparse path (hpsray.kernels.cuda.fused) --------------------------------------

    def lookup_pool(
        self, unique_keys: Keys, inverse: npt.ArrayLike | DeviceArray, ends: npt.ArrayLike | DeviceArray, columns: int
    ) -> tuple[DeviceArray, DeviceArray]:
        """As :meth:`CpuHashTable.lookup_pool <hpsray.kernels.cpu.CpuHashTable.lookup_pool>`, on
        the device: ``(pooled, slots)`` as device arrays whatever the inputs."""
        from hpsray.kernels.cuda.fused import k_lookup_rows, k_pool

        columns = check_columns(columns, self.width)
        dkeys, _, host = device_keys(unique_keys)
        dinv, dends = device_index(inverse, "inverse"), device_index(ends, "ends")
        n, n_bags = dkeys.size, dends.size - 1
        slots = cuda.device_array(n, dtype=np.int64)
        rows = cuda.device_array((n, columns), dtype=np.float32)
        pooled = cuda.device_array((n_bags, columns), dtype=np.float32)
        if n:
            stat = self._stat()
            k_lookup_rows[self._grid(n)](self._bkeys, self._bslots, self._mask, dkeys, self._rows, slots, rows, stat)
            if int(stat.copy_to_host()[0]):
                keys = host if host is not None else dkeys.copy_to_host()
                raise missing_key_error(keys, slots.copy_to_host(), "lookup_pool")
        if n_bags:
            k_pool[self._grid(n_bags * columns)](rows, dinv, dends, pooled)
        return pooled, slots

    def pool_backward(
        self,
        grad_pooled: DeviceArray,
        ends: npt.ArrayLike | DeviceArray,
        inverse: npt.ArrayLike | DeviceArray,
        n_rows: int,
    ) -> DeviceArray:
        """As :func:`hpsray.kernels.fused.pool_backward`, on the device: ``float32[n_rows, dim]``."""
        from hpsray.kernels.cuda.fused import k_bag_of, k_pool_backward

        dends, dinv = device_index(ends, "ends"), device_index(inverse, "inverse")
        n_bags, nnz = dends.size - 1, dinv.size
        if n_rows > self.capacity:
            raise ValueError(f"pool_backward: {n_rows} rows, more than the table holds ({self.capacity})")
        dim = int(grad_pooled.shape[1])
        dgrad = device_values(grad_pooled, n_bags, dim, "pool_backward grad_pooled")
        acc = cuda.device_array((n_rows, dim), dtype=np.float32)
        if n_rows == 0 or dim == 0:
            return acc
        bag_of = self._buf("bag_of", nnz, np.int64)
        k_bag_of[self._grid(n_bags)](dends, bag_of)
        groups = self._group(dinv, nnz, "pool_backward", dinv, None)
        if groups is None:  # every row once
            order, starts = self._buf("iota", nnz, np.int64), self._buf("starts1", nnz + 1, np.int64)
            k_iota[self._grid(nnz)](order)
            k_iota[self._grid(nnz + 1)](starts)
        else:
            order, starts = groups
        k_pool_backward[self._grid((starts.size - 1) * dim)](dgrad, bag_of, dinv, order, starts, acc)
        return acc

    def apply_at_slots(
        self, slots: npt.ArrayLike | DeviceArray, grads: Values, optimizer: SparseOptimizer, step: int
    ) -> None:
        """:meth:`apply_gradients` for distinct ``slots`` already looked up (from :meth:`lookup_pool`)."""
        dim = self.init.dim
        if dim + optimizer.state_width(dim) != self.width:
            raise ValueError(
                f"{type(optimizer).__name__} needs rows of width {dim + optimizer.state_width(dim)} "
                f"(dim {dim}), this table has width {self.width}"
            )
        dslots = device_index(slots, "slots")
        n = dslots.size
        dgrads = device_values(grads, n, dim, "apply_at_slots grads")
        if n:
            hp = cuda.to_device(optimizer.hyperparams(step))
            k_apply_direct[self._grid(n)](self._rows, dslots, dgrads, optimizer.kind, hp)

    def keys_at(self, slots: npt.ArrayLike | DeviceArray) -> npt.NDArray[np.uint64]:
        """The keys held at ``slots`` (numpy)."""
        dslots = device_index(slots, "slots")
        out = cuda.device_array(dslots.size, dtype=np.uint64)
        if dslots.size:
            k_gather_keys[self._grid(dslots.size)](self._row_keys, dslots, out)
        return out.copy_to_host()

    def holds_at(self, slots: npt.ArrayLike | DeviceArray, keys: Keys) -> bool:
        """Whether slot ``slots[i]`` holds key ``keys[i]`` for every ``i``."""
        dkeys, _, host = device_keys(keys)
        return bool(np.array_equal(self.keys_at(slots), host if host is not None else dkeys.copy_to_host()))
