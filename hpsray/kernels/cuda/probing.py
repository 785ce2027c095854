"""Probing kernels: find, claim (the lock-free insert), commit, rollback and erase of buckets.

The buckets are two device arrays, keys ``uint64[nb]`` and slots ``int64[nb]``, probed linearly
from ``bucket_hash(key) & mask``. The package docstring gives the insert protocol these kernels
run, launched in order by :meth:`CudaHashTable._insert_dev`: ``k_claim``, ``k_new_flags``, a scan
of the flags, then ``k_commit_new`` and ``k_fill_claimed`` (or ``k_rollback`` when the table is
full).
"""

from __future__ import annotations

import numpy as np

from hpsray.kernels.cuda.common import BIG, EMPTY, cuda
from hpsray.kernels.hashing import bucket_hash


@cuda.jit(device=True)
def probe(bkeys, bslots, mask, k):
    """The slot of key ``k`` or -1: the buckets probed linearly from ``bucket_hash(k) & mask``
    up to an empty one (the one lookup of :func:`k_find` and the fused ``k_lookup_rows``)."""
    b = np.int64(bucket_hash(k) & np.uint64(mask))
    for _ in range(mask + 1):
        kk = bkeys[b]
        if kk == k:
            return bslots[b]  # -1 for the reserved key, which matches an empty bucket
        if kk == EMPTY:
            break
        b = (b + 1) & mask
    return np.int64(-1)


@cuda.jit
def k_find(bkeys, bslots, mask, keys, out, stat):
    """``out[i]`` = slot of ``keys[i]`` or -1; ``stat[0]`` = 1 if any is absent."""
    i = cuda.grid(1)
    if i < keys.size:
        s = probe(bkeys, bslots, mask, keys[i])
        out[i] = s
        if s < 0:
            stat[0] = 1


@cuda.jit
def k_claim(bkeys, bslots, mask, keys, out, claim, stat):
    """Find or claim the bucket of each key; stat[0]: reserved key seen, stat[1]: no bucket."""
    i = cuda.grid(1)
    if i < keys.size:
        k = keys[i]
        out[i] = -1
        claim[i] = -1
        if k == EMPTY:
            stat[0] = 1
            return
        b = np.int64(bucket_hash(k) & np.uint64(mask))
        for _ in range(mask + 1):
            kk = bkeys[b]
            if kk == EMPTY:  # a plain read may be stale; the CAS tells the truth
                kk = cuda.atomic.cas(bkeys, b, EMPTY, k)
                if kk == EMPTY:
                    kk = k  # claimed by this thread
            if kk == k:
                s = bslots[b]
                if s >= 0:  # present before this call
                    out[i] = s
                else:  # claimed in this call; the smallest input index is its first occurrence
                    claim[i] = b
                    cuda.atomic.min(bslots, b, np.int64(i) - BIG)
                return
            b = (b + 1) & mask
        stat[1] = 1  # every bucket probed: the table cannot take this key


@cuda.jit
def k_new_flags(bslots, claim, flags):
    i = cuda.grid(1)
    if i < claim.size:
        b = claim[i]
        flags[i] = 1 if b >= 0 and bslots[b] == np.int64(i) - BIG else 0


@cuda.jit
def k_rollback(bkeys, bslots, claim):
    """Empty every bucket claimed in this call (all were empty before it)."""
    i = cuda.grid(1)
    if i < claim.size:
        b = claim[i]
        if b >= 0:
            bkeys[b] = EMPTY
            bslots[b] = -1


@cuda.jit
def k_commit_new(bslots, row_keys, free, free_top, keys, claim, flags, ranks, new_slots):
    """The first occurrence of new key number ``r`` pops free-stack entry ``r``."""
    i = cuda.grid(1)
    if i < claim.size and flags[i] != 0:
        r = ranks[i]
        s = free[free_top - 1 - r]
        bslots[claim[i]] = s
        row_keys[s] = keys[i]
        new_slots[r] = s


@cuda.jit
def k_fill_claimed(bslots, claim, out):
    i = cuda.grid(1)
    if i < claim.size:
        b = claim[i]
        if b >= 0:
            out[i] = bslots[b]


@cuda.jit
def k_erase(bkeys, bslots, mask, row_keys, free, free_top, keys, stat):
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
            if kk == EMPTY:
                break
            if kk == k:
                found = True
                break
            b = (b + 1) & mask
        if not found:
            continue
        s = bslots[b]
        row_keys[s] = EMPTY
        free[top] = s
        top += 1
        removed += 1
        hole = b
        j = b
        while True:
            j = (j + 1) & mask
            kj = bkeys[j]
            if kj == EMPTY:
                break
            home = np.int64(bucket_hash(kj) & np.uint64(mask))
            # move j into the hole unless its home lies cyclically in (hole, j]
            if (j > hole and (home <= hole or home > j)) or (j < hole and home <= hole and home > j):
                bkeys[hole] = kj
                bslots[hole] = bslots[j]
                hole = j
        bkeys[hole] = EMPTY
        bslots[hole] = -1
    stat[0] = removed
