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
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from hpsray.kernels.distinct import distinct_sorted
from hpsray.kernels.hashing import EMPTY_KEY, bucket_hash
from hpsray.kernels.init import RowInit, init_row
from hpsray.kernels.optim import SparseOptimizer, apply_row_update
from hpsray.kernels.table import (
    HashTable,
    TableFullError,
    as_keys,
    as_rows,
    bucket_count,
    check_columns,
    missing_key_error,
)

# A mini-batch's tables are small next to a GPU: numba's "grid size N will likely result in GPU
# under-utilization" warning would fire on most launches and say nothing a caller can act on.
numba.config.CUDA_LOW_OCCUPANCY_WARNINGS = False

_EMPTY = EMPTY_KEY
_BIG = np.int64(1 << 62)  # pending bucket slots hold (first input index - _BIG) < -1
_MAXI = np.int64(np.iinfo(np.int64).max)
_MAX_TPB = 1024
_CHUNK = 32  # elements per thread in scans and radix passes


def simulator_enabled() -> bool:
    """Whether numba.cuda runs under its simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(numba.config.ENABLE_CUDASIM)


def cuda_available() -> bool:
    """Whether :class:`CudaHashTable` can run here: a usable CUDA device, or the simulator."""
    try:
        return bool(cuda.is_available())
    except Exception:  # driver present but broken
        return False


if simulator_enabled():
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _SimArray
else:  # pragma: no cover - only without the simulator
    _SimArray = ()


def is_device_array(x) -> bool:
    """True for device arrays: numba device arrays, or anything with ``__cuda_array_interface__``."""
    return hasattr(x, "__cuda_array_interface__") or isinstance(x, _SimArray)


def _as_device(x):
    """A numba device-array view of a device array (zero copy)."""
    if isinstance(x, _SimArray) or getattr(x, "__cuda_ndarray__", False):
        return x
    return cuda.as_cuda_array(x)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@cuda.jit
def _k_find(bkeys, bslots, mask, keys, out, stat):
    """``out[i]`` = slot of ``keys[i]`` or -1; ``stat[0]`` = 1 if any is absent."""
    i = cuda.grid(1)
    if i < keys.size:
        k = keys[i]
        b = np.int64(bucket_hash(k) & np.uint64(mask))
        s = np.int64(-1)
        for _ in range(mask + 1):
            kk = bkeys[b]
            if kk == k:
                s = bslots[b]  # -1 for the reserved key, which matches an empty bucket
                break
            if kk == _EMPTY:
                break
            b = (b + 1) & mask
        out[i] = s
        if s < 0:
            stat[0] = 1


@cuda.jit
def _k_claim(bkeys, bslots, mask, keys, out, claim, stat):
    """Find or claim the bucket of each key; stat[0]: reserved key seen, stat[1]: no bucket."""
    i = cuda.grid(1)
    if i < keys.size:
        k = keys[i]
        out[i] = -1
        claim[i] = -1
        if k == _EMPTY:
            stat[0] = 1
            return
        b = np.int64(bucket_hash(k) & np.uint64(mask))
        for _ in range(mask + 1):
            kk = bkeys[b]
            if kk == _EMPTY:  # a plain read may be stale; the CAS tells the truth
                kk = cuda.atomic.cas(bkeys, b, _EMPTY, k)
                if kk == _EMPTY:
                    kk = k  # claimed by this thread
            if kk == k:
                s = bslots[b]
                if s >= 0:  # present before this call
                    out[i] = s
                else:  # claimed in this call; the smallest input index is its first occurrence
                    claim[i] = b
                    cuda.atomic.min(bslots, b, np.int64(i) - _BIG)
                return
            b = (b + 1) & mask
        stat[1] = 1  # every bucket probed: the table cannot take this key


@cuda.jit
def _k_new_flags(bslots, claim, flags):
    i = cuda.grid(1)
    if i < claim.size:
        b = claim[i]
        flags[i] = 1 if b >= 0 and bslots[b] == np.int64(i) - _BIG else 0


@cuda.jit
def _k_rollback(bkeys, bslots, claim):
    """Empty every bucket claimed in this call (all were empty before it)."""
    i = cuda.grid(1)
    if i < claim.size:
        b = claim[i]
        if b >= 0:
            bkeys[b] = _EMPTY
            bslots[b] = -1


@cuda.jit
def _k_commit_new(bslots, row_keys, free, free_top, keys, claim, flags, ranks, new_slots):
    """The first occurrence of new key number ``r`` pops free-stack entry ``r``."""
    i = cuda.grid(1)
    if i < claim.size and flags[i] != 0:
        r = ranks[i]
        s = free[free_top - 1 - r]
        bslots[claim[i]] = s
        row_keys[s] = keys[i]
        new_slots[r] = s


@cuda.jit
def _k_fill_claimed(bslots, claim, out):
    i = cuda.grid(1)
    if i < claim.size:
        b = claim[i]
        if b >= 0:
            out[i] = bslots[b]


@cuda.jit
def _k_init_rows(rows, row_keys, slots, dim, scale, seed, state_value):
    t = cuda.grid(1)
    if t < slots.size:
        s = slots[t]
        init_row(rows[s], row_keys[s], dim, rows.shape[1], scale, seed, state_value)


@cuda.jit
def _k_erase(bkeys, bslots, mask, row_keys, free, free_top, keys, stat):
    """One thread: the CPU backend's erase with backward-shift deletion. stat[0] = removed."""
    if cuda.grid(1) != 0:
        return
    top = free_top
    removed = 0
    for i in range(keys.size):
        k = keys[i]
        b = np.int64(bucket_hash(k) & np.uint64(mask))
        found = False
        for _ in range(mask + 1):
            kk = bkeys[b]
            if kk == _EMPTY:
                break
            if kk == k:
                found = True
                break
            b = (b + 1) & mask
        if not found:
            continue
        s = bslots[b]
        row_keys[s] = _EMPTY
        free[top] = s
        top += 1
        removed += 1
        hole = b
        j = b
        while True:
            j = (j + 1) & mask
            kj = bkeys[j]
            if kj == _EMPTY:
                break
            home = np.int64(bucket_hash(kj) & np.uint64(mask))
            # move j into the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
                bkeys[hole] = kj
                bslots[hole] = bslots[j]
                hole = j
        bkeys[hole] = _EMPTY
        bslots[hole] = -1
    stat[0] = removed


@cuda.jit
def _k_check_slots(slots, capacity, stat):
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        if s < 0 or s >= capacity:
            stat[0] = 1


@cuda.jit
def _k_gather(rows, slots, out):
    """One thread per element; consecutive threads read consecutive columns of a row."""
    t = cuda.grid(1)
    width = out.shape[1]
    if t < slots.size * width:
        i = t // width
        j = t - i * width
        out[i, j] = rows[slots[i], j]


@cuda.jit
def _k_gather_keys(row_keys, slots, out):
    i = cuda.grid(1)
    if i < slots.size:
        out[i] = row_keys[slots[i]]


@cuda.jit
def _k_occupied(row_keys, flags):
    s = cuda.grid(1)
    if s < row_keys.size:
        flags[s] = 1 if row_keys[s] != _EMPTY else 0


@cuda.jit
def _k_compact(flags, pos, out):
    i = cuda.grid(1)
    if i < flags.size and flags[i] != 0:
        out[pos[i]] = i


@cuda.jit
def _k_zero(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = 0


@cuda.jit
def _k_iota(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = i


# -- grouping of duplicate slots ---------------------------------------------------------------


@cuda.jit
def _k_first(first, slots, stat):
    """``first[s]`` = smallest input index holding slot ``s``; stat[0] = 1 on a missing key."""
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        if s < 0:
            stat[0] = 1
        else:
            cuda.atomic.min(first, s, np.int64(i))


@cuda.jit
def _k_heads(first, slots, flags):
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        flags[i] = 1 if s >= 0 and first[s] == i else 0


@cuda.jit
def _k_segment_ids(first, slots, ranks, seg):
    """Segment id of each entry: the rank (in input order) of its slot's first occurrence."""
    i = cuda.grid(1)
    if i < slots.size:
        seg[i] = ranks[first[slots[i]]]


@cuda.jit
def _k_reset_first(first, slots):
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        if s >= 0:
            first[s] = _MAXI


@cuda.jit
def _k_count_zero_bits(keys, bit, part):
    """Radix pass, step 1: zero bits in each chunk of ``_CHUNK`` consecutive keys."""
    t = cuda.grid(1)
    if t < part.size:
        a = t * _CHUNK
        e = min(a + _CHUNK, keys.size)
        c = 0
        for p in range(a, e):
            c += 1 - ((keys[p] >> bit) & 1)
        part[t] = c


@cuda.jit
def _k_split_chunks(keys, vals, bit, zeros_before, tot, out_keys, out_vals):
    """Radix pass, step 2 (stable split): each thread walks its chunk in order; zeros go to
    ``zeros_before[t]`` on, ones after all ``tot[0]`` zeros and the ones of earlier chunks."""
    t = cuda.grid(1)
    if t < zeros_before.size:
        a = t * _CHUNK
        e = min(a + _CHUNK, keys.size)
        z = zeros_before[t]
        o = tot[0] + a - z
        for p in range(a, e):
            k = keys[p]
            if (k >> bit) & 1:
                q = o
                o += 1
            else:
                q = z
                z += 1
            out_keys[q] = k
            out_vals[q] = vals[p]


@cuda.jit
def _k_segment_starts(sorted_seg, starts):
    p = cuda.grid(1)
    n = sorted_seg.size
    if p < n:
        r = sorted_seg[p]
        if p == 0 or sorted_seg[p - 1] != r:
            starts[r] = p
        if p == n - 1:
            starts[r + 1] = n


# -- updates -----------------------------------------------------------------------------------


@cuda.jit
def _k_scatter_direct(rows, slots, values, add):
    """No duplicates: one thread per element."""
    t = cuda.grid(1)
    width = values.shape[1]
    if t < slots.size * width:
        i = t // width
        j = t - i * width
        if add:
            rows[slots[i], j] += values[i, j]
        else:
            rows[slots[i], j] = values[i, j]


@cuda.jit
def _k_scatter_segments(rows, slots, values, order, starts, add):
    """One thread per (distinct row, column), walking its duplicates in input order."""
    t = cuda.grid(1)
    width = values.shape[1]
    n_seg = starts.size - 1
    if t < n_seg * width:
        r = t // width
        j = t - r * width
        a = starts[r]
        e = starts[r + 1]
        s = slots[order[a]]
        if add:
            v = rows[s, j]
            for p in range(a, e):
                v += values[order[p], j]
            rows[s, j] = v
        else:
            rows[s, j] = values[order[e - 1], j]


@cuda.jit
def _k_apply_direct(rows, slots, grads, kind, hp):
    i = cuda.grid(1)
    if i < slots.size:
        apply_row_update(kind, rows[slots[i]], grads[i], grads.shape[1], hp)


@cuda.jit
def _k_sum_segments(grads, order, starts, acc):
    """``acc[r]`` = the gradients of segment ``r`` summed in input order (as the CPU does)."""
    t = cuda.grid(1)
    dim = grads.shape[1]
    n_seg = starts.size - 1
    if t < n_seg * dim:
        r = t // dim
        j = t - r * dim
        a = starts[r]
        v = grads[order[a], j]
        for p in range(a + 1, starts[r + 1]):
            v += grads[order[p], j]
        acc[r, j] = v


@cuda.jit
def _k_apply_segments(rows, slots, order, starts, acc, kind, hp):
    r = cuda.grid(1)
    if r < acc.shape[0]:
        apply_row_update(kind, rows[slots[order[starts[r]]]], acc[r], acc.shape[1], hp)


# -- exclusive scan (int64) --------------------------------------------------------------------
# Reduce-then-scan over chunks of _CHUNK consecutive elements, one thread per chunk: no shared
# memory and no barriers (barriers are very slow in the simulator), O(n) work, and a handful of
# launches (n / 32 per level).


@cuda.jit
def _k_chunk_sums(x, part):
    t = cuda.grid(1)
    if t < part.size:
        a = t * _CHUNK
        e = min(a + _CHUNK, x.size)
        c = np.int64(0)
        for p in range(a, e):
            c += x[p]
        part[t] = c


@cuda.jit
def _k_chunk_scan(x, offsets, out):
    t = cuda.grid(1)
    if t < offsets.size:
        a = t * _CHUNK
        e = min(a + _CHUNK, x.size)
        run = offsets[t]
        for p in range(a, e):
            v = x[p]
            out[p] = run
            run += v


@cuda.jit
def _k_serial_scan(x, out, tot, tot_index):
    if cuda.grid(1) == 0:
        run = np.int64(0)
        for p in range(x.size):
            v = x[p]
            out[p] = run
            run += v
        tot[tot_index] = run


# ---------------------------------------------------------------------------------------------


class CudaHashTable(HashTable):
    """numba.cuda hash table; see the module docstring for the design.

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
            raise RuntimeError(
                "CudaHashTable needs a CUDA device (or numba's simulator: NUMBA_ENABLE_CUDASIM=1)"
            )
        tpb = threads_per_block or (64 if simulator_enabled() else 256)
        if not 1 <= tpb <= _MAX_TPB:
            raise ValueError(f"threads_per_block must be in 1..{_MAX_TPB}, got {tpb}")
        self._tpb = int(tpb)
        nb = bucket_count(capacity)
        self._mask = nb - 1
        self._bkeys = cuda.to_device(np.full(nb, _EMPTY, dtype=np.uint64))
        self._bslots = cuda.to_device(np.full(nb, -1, dtype=np.int64))
        self._rows = cuda.to_device(np.zeros((capacity, width), dtype=np.float32))
        self._row_keys = cuda.to_device(np.full(capacity, _EMPTY, dtype=np.uint64))
        self._free = cuda.to_device(np.arange(capacity - 1, -1, -1, dtype=np.int64))  # pops 0, 1, 2 ...
        self._first = cuda.to_device(np.full(capacity, _MAXI, dtype=np.int64))
        self._size = 0
        self._free_top = capacity
        self._scratch: dict[str, object] = {}

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._size

    @property
    def rows(self):
        """The arena itself (a device array; slots index it)."""
        return self._rows

    @property
    def threads_per_block(self) -> int:
        return self._tpb

    def _grid(self, n: int) -> tuple[int, int]:
        return ((n + self._tpb - 1) // self._tpb, self._tpb)

    def _buf(self, name: str, n: int, dtype) -> object:
        """A reusable device scratch array of at least ``n`` elements (a view of ``n``)."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = cuda.device_array(max(n, 16, 0 if buf is None else 2 * buf.size), dtype=dtype)
            self._scratch[name] = buf
        return buf[:n]

    def _stat(self):
        stat = self._buf("stat", 4, np.int64)
        _k_zero[1, 4](stat)
        return stat

    def _keys(self, keys):
        """(device uint64 keys, on_device, host keys or None)."""
        if is_device_array(keys):
            d = _as_device(keys)
            if d.ndim != 1:
                raise ValueError(f"keys: expected a 1-D array, got shape {d.shape}")
            if d.dtype == np.int64:
                d = d.view(np.uint64)
            elif d.dtype != np.uint64:
                raise TypeError(f"keys: device keys must be uint64 or int64, got dtype {d.dtype}")
            return d, True, None
        host = as_keys(keys)
        return cuda.to_device(host), False, host

    @staticmethod
    def _values(values, n: int, width: int, name: str):
        if is_device_array(values):
            d = _as_device(values)
            if d.dtype != np.float32:
                raise TypeError(f"{name}: device values must be float32, got dtype {d.dtype}")
            if tuple(d.shape) != (n, width):
                raise ValueError(f"{name}: expected shape ({n}, {width}), got {tuple(d.shape)}")
            if not d.is_c_contiguous():
                raise ValueError(f"{name}: device values must be C-contiguous")
            return d
        return cuda.to_device(as_rows(values, n, width, name))

    def _scan(self, x, out, tot, tot_index: int, level: int = 0) -> None:
        """Exclusive scan of int64 ``x`` into ``out``; the total goes to ``tot[tot_index]``."""
        n = x.size
        m = (n + _CHUNK - 1) // _CHUNK
        if m <= 1:
            _k_serial_scan[1, 1](x, out, tot, tot_index)
            return
        part = self._buf(f"scan_part{level}", m, np.int64)
        offs = self._buf(f"scan_offs{level}", m, np.int64)
        _k_chunk_sums[self._grid(m)](x, part)
        self._scan(part, offs, tot, tot_index, level + 1)
        _k_chunk_scan[self._grid(m)](x, offs, out)

    def _find_dev(self, dkeys):
        """(device slots, stat) for device keys; stat[0] = 1 if any key is absent."""
        n = dkeys.size
        out = cuda.device_array(n, dtype=np.int64)
        stat = self._stat()
        if n:
            _k_find[self._grid(n)](self._bkeys, self._bslots, self._mask, dkeys, out, stat)
        return out, stat

    def _insert_dev(self, dkeys, host_keys):
        """Device slots of ``dkeys``, inserting absent ones (see the module docstring)."""
        n = dkeys.size
        out = cuda.device_array(n, dtype=np.int64)
        if n == 0:
            return out
        grid = self._grid(n)
        claim = self._buf("claim", n, np.int64)
        flags = self._buf("flags", n, np.int64)
        ranks = self._buf("ranks", n, np.int64)
        stat = self._stat()
        _k_claim[grid](self._bkeys, self._bslots, self._mask, dkeys, out, claim, stat)
        _k_new_flags[grid](self._bslots, claim, flags)
        self._scan(flags, ranks, stat, 2)
        reserved, overflow, n_new, _ = (int(v) for v in stat.copy_to_host())
        if reserved or overflow or n_new > self._free_top:
            _k_rollback[grid](self._bkeys, self._bslots, claim)
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
            _k_commit_new[grid](
                self._bslots, self._row_keys, self._free, self._free_top, dkeys, claim, flags, ranks, new_slots
            )
            _k_fill_claimed[grid](self._bslots, claim, out)
            init = self.init
            _k_init_rows[self._grid(n_new)](
                self._rows, self._row_keys, new_slots, init.dim,
                np.float32(init.scale), np.uint64(init.seed), np.float32(init.state_value),
            )
            self._free_top -= n_new
            self._size += n_new
        return out

    def _group(self, slots, n: int, op: str, dkeys, host_keys):
        """Group entries by slot. Returns ``None`` when all slots are distinct, else
        ``(order, starts)``: ``order`` lists input indices grouped by slot, each group in input
        order, groups in order of first occurrence; group ``r`` is ``order[starts[r]:starts[r+1]]``.
        Raises ``KeyError`` if a slot is negative (a missing key)."""
        grid = self._grid(n)
        stat = self._stat()
        flags = self._buf("flags", n, np.int64)
        ranks = self._buf("ranks", n, np.int64)
        _k_first[grid](self._first, slots, stat)
        _k_heads[grid](self._first, slots, flags)
        self._scan(flags, ranks, stat, 1)
        missing, d, _, _ = (int(v) for v in stat.copy_to_host())
        if missing or d == n:
            _k_reset_first[grid](self._first, slots)
            if missing:
                keys = host_keys if host_keys is not None else dkeys.copy_to_host()
                raise missing_key_error(keys, slots.copy_to_host(), op)
            return None
        seg_a = self._buf("seg_a", n, np.int64)
        seg_b = self._buf("seg_b", n, np.int64)
        ord_a = self._buf("ord_a", n, np.int64)
        ord_b = self._buf("ord_b", n, np.int64)
        _k_segment_ids[grid](self._first, slots, ranks, seg_a)
        _k_reset_first[grid](self._first, slots)
        _k_iota[grid](ord_a)
        # stable LSD radix sort of (segment id, input index), one bit per pass
        m = (n + _CHUNK - 1) // _CHUNK
        part = self._buf("radix_part", m, np.int64)
        zeros_before = self._buf("radix_offs", m, np.int64)
        for bit in range(max(1, (d - 1).bit_length())):
            _k_count_zero_bits[self._grid(m)](seg_a, bit, part)
            self._scan(part, zeros_before, stat, 3)
            _k_split_chunks[self._grid(m)](seg_a, ord_a, bit, zeros_before, stat[3:], seg_b, ord_b)
            seg_a, seg_b, ord_a, ord_b = seg_b, seg_a, ord_b, ord_a
        starts = self._buf("starts", d + 1, np.int64)
        _k_segment_starts[grid](seg_a, starts)
        return ord_a, starts

    def _result(self, dev, on_device: bool):
        return dev if on_device else dev.copy_to_host()

    # -- interface -----------------------------------------------------------------------------

    def find(self, keys):
        dkeys, on_device, _ = self._keys(keys)
        out, _ = self._find_dev(dkeys)
        return self._result(out, on_device)

    def find_or_insert(self, keys):
        dkeys, on_device, host = self._keys(keys)
        return self._result(self._insert_dev(dkeys, host), on_device)

    def gather(self, slots, columns: int | None = None):
        on_device = is_device_array(slots)
        if on_device:
            dslots = _as_device(slots)
            if dslots.dtype != np.int64 or dslots.ndim != 1:
                raise TypeError(f"gather: device slots must be 1-D int64, got {dslots.dtype} {dslots.shape}")
            if dslots.size:
                stat = self._stat()
                _k_check_slots[self._grid(dslots.size)](dslots, self.capacity, stat)
                if stat.copy_to_host()[0]:
                    host = dslots.copy_to_host()
                    bad = host[(host < 0) | (host >= self.capacity)][0]
                    raise KeyError(f"gather: slot {bad} is not a row of this table (an absent key gives -1)")
        else:
            host = np.ascontiguousarray(slots, dtype=np.int64)
            if host.size and (host.min() < 0 or host.max() >= self.capacity):
                bad = host[(host < 0) | (host >= self.capacity)][0]
                raise KeyError(f"gather: slot {bad} is not a row of this table (an absent key gives -1)")
            dslots = cuda.to_device(host)
        out = self._gather_dev(dslots, columns)
        return self._result(out, on_device)

    def _gather_dev(self, dslots, columns: int | None = None):
        n, width = dslots.size, check_columns(columns, self.width)
        out = cuda.device_array((n, width), dtype=np.float32)
        if n * width:
            _k_gather[self._grid(n * width)](self._rows, dslots, out)
        return out

    def _scatter(self, slots, values, add: bool, op: str, dkeys, host_keys) -> None:
        n = slots.size
        if n == 0:
            return
        groups = self._group(slots, n, op, dkeys, host_keys)
        if self.width == 0:
            return
        if groups is None:
            _k_scatter_direct[self._grid(n * self.width)](self._rows, slots, values, add)
        else:
            order, starts = groups
            d = starts.size - 1
            _k_scatter_segments[self._grid(d * self.width)](self._rows, slots, values, order, starts, add)

    def scatter_add(self, keys, values) -> None:
        dkeys, _, host = self._keys(keys)
        n = dkeys.size
        dvalues = self._values(values, n, self.width, "scatter_add values")
        slots, _ = self._find_dev(dkeys)
        self._scatter(slots, dvalues, True, "scatter_add", dkeys, host)

    def assign(self, keys, values) -> None:
        dkeys, _, host = self._keys(keys)
        n = dkeys.size
        dvalues = self._values(values, n, self.width, "assign values")
        slots = self._insert_dev(dkeys, host)
        self._scatter(slots, dvalues, False, "assign", dkeys, host)

    def erase(self, keys) -> int:
        dkeys, _, _ = self._keys(keys)
        if dkeys.size == 0:
            return 0
        stat = self._stat()
        _k_erase[1, 1](self._bkeys, self._bslots, self._mask, self._row_keys, self._free, self._free_top, dkeys, stat)
        removed = int(stat.copy_to_host()[0])
        self._free_top += removed
        self._size -= removed
        return removed

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        cap = self.capacity
        flags = cuda.device_array(cap, dtype=np.int64)  # not cached: export is rare, tables large
        pos = cuda.device_array(cap, dtype=np.int64)
        stat = self._stat()
        grid = self._grid(cap)
        _k_occupied[grid](self._row_keys, flags)
        self._scan(flags, pos, stat, 0)
        n = int(stat.copy_to_host()[0])
        if n == 0:
            return np.empty(0, dtype=np.uint64), np.empty((0, self.width), dtype=np.float32)
        slots = cuda.device_array(n, dtype=np.int64)
        _k_compact[grid](flags, pos, slots)
        keys = cuda.device_array(n, dtype=np.uint64)
        _k_gather_keys[self._grid(n)](self._row_keys, slots, keys)
        return keys.copy_to_host(), self._gather_dev(slots).copy_to_host()

    def apply_gradients(self, keys, grads, optimizer: SparseOptimizer, step: int) -> None:
        dkeys, _, host = self._keys(keys)
        dim = self.init.dim
        if dim + optimizer.state_width(dim) != self.width:
            raise ValueError(
                f"{type(optimizer).__name__} needs rows of width {dim + optimizer.state_width(dim)} "
                f"(dim {dim}), this table has width {self.width}"
            )
        n = dkeys.size
        dgrads = self._values(grads, n, dim, "apply_gradients grads")
        hp = cuda.to_device(optimizer.hyperparams(step))
        if n == 0:
            return
        slots, _ = self._find_dev(dkeys)
        groups = self._group(slots, n, "apply_gradients", dkeys, host)
        kind = optimizer.kind
        if groups is None:
            _k_apply_direct[self._grid(n)](self._rows, slots, dgrads, kind, hp)
            return
        order, starts = groups
        d = starts.size - 1
        acc = self._buf("acc", d * dim, np.float32).reshape((d, dim)) if dim else cuda.device_array((d, 0), np.float32)
        if dim:
            _k_sum_segments[self._grid(d * dim)](dgrads, order, starts, acc)
        _k_apply_segments[self._grid(d)](self._rows, slots, order, starts, acc, kind, hp)
