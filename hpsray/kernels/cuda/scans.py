"""Scan and grouping kernels: exclusive scans, stream compaction, and the stable LSD radix sort
that groups a call's entries by slot.

Scans are reduce-then-scan over chunks of ``CHUNK`` consecutive elements, one thread per chunk:
no shared memory and no barriers (barriers are very slow in the simulator), O(n) work, and a
handful of launches (n / 32 per level); :meth:`CudaHashTable._scan` drives them. Grouping
(:meth:`CudaHashTable._group`) numbers each slot's first occurrence in input order (``k_first``,
``k_heads`` and a scan), gives every entry the number of its slot (``k_segment_ids``), sorts
(segment id, input index) one bit per pass (``k_count_zero_bits``, a scan, ``k_split_chunks``),
and marks where each group starts (``k_segment_starts``).
"""

from __future__ import annotations

import numpy as np

from hpsray.kernels.cuda.common import CHUNK, EMPTY, MAXI, cuda

# -- exclusive scan (int64) --------------------------------------------------------------------


@cuda.jit
def k_chunk_sums(x, part):
    t = cuda.grid(1)
    if t < part.size:
        a = t * CHUNK
        e = min(a + CHUNK, x.size)
        c = np.int64(0)
        for p in range(a, e):
            c += x[p]
        part[t] = c


@cuda.jit
def k_chunk_scan(x, offsets, out):
    t = cuda.grid(1)
    if t < offsets.size:
        a = t * CHUNK
        e = min(a + CHUNK, x.size)
        run = offsets[t]
        for p in range(a, e):
            v = x[p]
            out[p] = run
            run += v


@cuda.jit
def k_serial_scan(x, out, tot, tot_index):
    if cuda.grid(1) == 0:
        run = np.int64(0)
        for p in range(x.size):
            v = x[p]
            out[p] = run
            run += v
        tot[tot_index] = run


# -- fills and stream compaction ---------------------------------------------------------------


@cuda.jit
def k_occupied(row_keys, flags):
    s = cuda.grid(1)
    if s < row_keys.size:
        flags[s] = 1 if row_keys[s] != EMPTY else 0


@cuda.jit
def k_compact(flags, pos, out):
    i = cuda.grid(1)
    if i < flags.size and flags[i] != 0:
        out[pos[i]] = i


@cuda.jit
def k_zero(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = 0


@cuda.jit
def k_iota(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = i


# -- grouping of duplicate slots ---------------------------------------------------------------


@cuda.jit
def k_first(first, slots, stat):
    """``first[s]`` = smallest input index holding slot ``s``; stat[0] = 1 on a missing key."""
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        if s < 0:
            stat[0] = 1
        else:
            cuda.atomic.min(first, s, np.int64(i))


@cuda.jit
def k_heads(first, slots, flags):
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        flags[i] = 1 if s >= 0 and first[s] == i else 0


@cuda.jit
def k_segment_ids(first, slots, ranks, seg):
    """Segment id of each entry: the rank (in input order) of its slot's first occurrence."""
    i = cuda.grid(1)
    if i < slots.size:
        seg[i] = ranks[first[slots[i]]]


@cuda.jit
def k_reset_first(first, slots):
    i = cuda.grid(1)
    if i < slots.size:
        s = slots[i]
        if s >= 0:
            first[s] = MAXI


@cuda.jit
def k_count_zero_bits(keys, bit, part):
    """Radix pass, step 1: zero bits in each chunk of ``CHUNK`` consecutive keys."""
    t = cuda.grid(1)
    if t < part.size:
        a = t * CHUNK
        e = min(a + CHUNK, keys.size)
        c = 0
        for p in range(a, e):
            c += 1 - ((keys[p] >> bit) & 1)
        part[t] = c


@cuda.jit
def k_split_chunks(keys, vals, bit, zeros_before, tot, out_keys, out_vals):
    """Radix pass, step 2 (stable split): each thread walks its chunk in order; zeros go to
    ``zeros_before[t]`` on, ones after all ``tot[0]`` zeros and the ones of earlier chunks."""
    t = cuda.grid(1)
    if t < zeros_before.size:
        a = t * CHUNK
        e = min(a + CHUNK, keys.size)
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
def k_segment_starts(sorted_seg, starts):
    p = cuda.grid(1)
    n = sorted_seg.size
    if p < n:
        r = sorted_seg[p]
        if p == 0 or sorted_seg[p - 1] != r:
            starts[r] = p
        if p == n - 1:
            starts[r + 1] = n
