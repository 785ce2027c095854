"""Parallel positioned reads of many small ranges, without Python per range (Ray-free).

Shared by serving's :mod:`~hpsray.serving.blockread` (rows of a point store) and SSD-PS partial
loads (:mod:`~hpsray.tiers.ssd.reads`): a caller plans its ranges (sorted by file and offset,
adjacent blocks merged), then :func:`read_parallel` issues them from numba loops that hold no GIL,
split among a thread pool, so several reads are in flight at once (an SSD's queue depth instead
of one page fault at a time). :func:`read_ranges` puts it together for ranges of many files:
what the page cache holds is copied at once (from a caller's mapping of the file where it keeps
one and ``mincore`` finds the pages resident: no system call per range; else
``preadv2(RWF_NOWAIT)``); the rest is split among
the threads, each of which first asks the kernel to start reading its whole share
(``POSIX_FADV_WILLNEED``: asynchronous, so the device sees every range at once), then reads it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numba as nb
import numpy as np
from numba import types as nbt

__all__ = [
    "IOV_MAX",
    "MINCORE_GAP_PAGES",
    "MIN_RANGES_PER_THREAD",
    "copy_mapped",
    "hinted_pread_ranges",
    "pread_ranges",
    "preadv_ranges",
    "read_parallel",
    "read_ranges",
]

IOV_MAX = 1024  # Linux's limit of one preadv's vector
MIN_RANGES_PER_THREAD = 16  # fewer ranges than this per thread: the pool's hand-off costs more than it saves
MINCORE_GAP_PAGES = 32  # ranges this few pages apart share one mincore (a call costs about what ~16-32 pages do)

# libc's calls, linked by name (no address baked in, so the kernels below are cached on disk);
# pointers are passed as 64-bit integers (the same registers on the 64-bit ABIs)
_i32, _i64, _u64 = nbt.int32, nbt.int64, nbt.uint64
_preadv: Any = nbt.ExternalFunction("preadv", _i64(_i32, _u64, _i32, _i64))
_preadv2: Any = nbt.ExternalFunction("preadv2", _i64(_i32, _u64, _i32, _i64, _i32))
_pread: Any = nbt.ExternalFunction("pread", _i64(_i32, _u64, _u64, _i64))
_fadvise: Any = nbt.ExternalFunction("posix_fadvise", _i32(_i32, _i64, _i64, _i32))
_mincore: Any = nbt.ExternalFunction("mincore", _i32(_u64, _u64, _u64))
_memcpy: Any = nbt.ExternalFunction("memcpy", _u64(_u64, _u64, _u64))
_WILLNEED = int(getattr(os, "POSIX_FADV_WILLNEED", 3))
_NOWAIT = int(getattr(os, "RWF_NOWAIT", 8))


@nb.njit(nogil=True, cache=True)
def preadv_ranges(fd, iov_addr, first_iov, n_iov, offsets, lengths, lo, hi):
    """``preadv`` ranges ``lo..hi-1`` of one file: range ``r`` is ``n_iov[r]`` I/O vector entries
    (16 bytes each) from ``first_iov[r]`` at ``iov_addr``, read at ``offsets[r]``; returns how
    many came back short of ``lengths[r]``."""
    short = 0
    for r in range(lo, hi):
        got = _preadv(fd, iov_addr + 16 * first_iov[r], n_iov[r], offsets[r])
        if got != lengths[r]:
            short += 1
    return short


@nb.njit(nogil=True, cache=True)
def pread_ranges(fds, buf_addr, dest, offsets, lengths, lo, hi):
    """``pread`` ranges ``lo..hi-1``: ``lengths[r]`` bytes of file ``fds[r]`` at ``offsets[r]``
    into ``buf_addr + dest[r]``; returns how many came back short."""
    short = 0
    for r in range(lo, hi):
        done = 0
        while done < lengths[r]:
            got = _pread(fds[r], buf_addr + dest[r] + done, lengths[r] - done, offsets[r] + done)
            if got <= 0:
                break
            done += got
        if done != lengths[r]:
            short += 1
    return short


@nb.njit(nogil=True, cache=True)
def hinted_pread_ranges(fds, buf_addr, dest, offsets, lengths, lo, hi):
    """:func:`pread_ranges` after hinting ranges ``lo..hi-1`` (``WILLNEED``), so that the device
    sees them all while the reads wait for the first ones."""
    for r in range(lo, hi):
        _fadvise(fds[r], offsets[r], lengths[r], _WILLNEED)
    return pread_ranges(fds, buf_addr, dest, offsets, lengths, lo, hi)


@nb.njit(nogil=True, cache=True)
def _read_cached(fds, iov_addr, offsets, lengths, flags, done):
    """One ``preadv2(flags)`` per range whose ``done`` is 0 (``iov_addr``: one 16-byte vector
    entry each); marks in ``done`` the ranges read whole (1); returns how many are done now."""
    n = 0
    for r in range(fds.size):
        if done[r] == 0 and _preadv2(fds[r], iov_addr + 16 * r, 1, offsets[r], flags) == lengths[r]:
            done[r] = 1
        n += done[r] == 1
    return n


@nb.njit(nogil=True, cache=True)
def copy_mapped(order, bases, sizes, offsets, lengths, dest, page, done):
    """Copy the ranges whose file is mapped (``bases[r]``: the mapping's address, 0 for none;
    ``sizes[r]``: its length) and whose pages are all resident: one ``mincore`` per cluster of
    ranges of one mapping at most :data:`MINCORE_GAP_PAGES` apart, taken in ``order`` (by mapping,
    then offset), instead of a read per range; ``page``: the page size. Marks them in ``done``
    (1), and the ranges with a page not resident 2 (no use trying the page cache for them);
    returns how many were copied. A page evicted between the check and the copy is read by the
    fault (correct, only slower)."""
    n = order.size
    copied = 0
    vec = np.empty(0, np.uint8)
    i = 0
    while i < n:
        r = order[i]
        base = bases[r]
        lo = offsets[r] // page * page
        hi = offsets[r] + lengths[r]
        e = i + 1
        while e < n and bases[order[e]] == base and offsets[order[e]] // page - (hi - 1) // page <= MINCORE_GAP_PAGES:
            hi = max(hi, offsets[order[e]] + lengths[order[e]])
            e += 1
        if base != 0 and hi <= sizes[r]:
            pages = (hi - lo + page - 1) // page
            if vec.size < pages:
                vec = np.empty(max(pages, 2 * vec.size), np.uint8)
            if _mincore(base + lo, hi - lo, vec.ctypes.data) == 0:
                for j in range(i, e):
                    q = order[j]
                    ok = True
                    for p in range((offsets[q] - lo) // page, (offsets[q] + lengths[q] - 1 - lo) // page + 1):
                        if vec[p] & 1 == 0:
                            ok = False
                            break
                    if ok:
                        _memcpy(dest[q], base + offsets[q], lengths[q])
                        done[q] = 1
                        copied += 1
                    else:
                        done[q] = 2
        i = e
    return copied


def read_parallel(pool: Executor | None, threads: int, read: Callable[..., int], args: tuple, n: int) -> int:
    """Run ``read(*args, lo, hi)`` over ranges ``0..n-1``, split into up to ``threads`` slices on
    ``pool`` (in this thread when there are too few ranges to share, or no pool); returns the sum
    of what the calls return (short reads)."""
    workers = min(threads, n // MIN_RANGES_PER_THREAD)
    if pool is None or workers <= 1:
        return int(read(*args, 0, n)) if n else 0
    cuts = np.linspace(0, n, workers + 1).astype(np.int64)
    futures = [pool.submit(read, *args, int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    return sum(int(f.result()) for f in futures)


def read_ranges(
    pool: Executor | None,
    threads: int,
    fds: np.ndarray,
    dest: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    mapped: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[int, int]:
    """Read ``lengths[r]`` bytes of file ``fds[r]`` at ``offsets[r]`` to address ``dest[r]``, for
    every range ``r`` (sorted by file and offset, so the device sees them in order): cached ones
    at once, the rest hinted then read in parallel (module docstring). ``mapped``: per range, the
    address and length of a read-only mapping of its file (address 0: none), kept by the caller
    for as long as this call runs. Returns the short reads and the ranges copied from mappings."""
    n = int(fds.size)
    if n == 0:
        return 0, 0
    fds = np.ascontiguousarray(fds, np.int32)
    done = np.zeros(n, np.uint8)
    copied = 0
    if mapped is not None:
        bases, sizes = mapped
        order = np.lexsort((offsets, bases))  # a file's key and row ranges interleave
        copied = int(copy_mapped(order, bases, sizes, offsets, lengths, dest, mmap.PAGESIZE, done))
        if copied == n:
            return 0, copied
    iov = np.empty((n, 2), np.uint64)
    iov[:, 0] = dest
    iov[:, 1] = lengths
    if _read_cached(fds, iov.ctypes.data, offsets, lengths, _NOWAIT, done) == n:
        return 0, copied
    rest = np.flatnonzero(done != 1)
    fds, dest, offsets, lengths = fds[rest], dest[rest], offsets[rest], lengths[rest]
    args = (fds, 0, dest, offsets, lengths)
    return read_parallel(pool, threads, hinted_pread_ranges, args, int(rest.size)), copied
