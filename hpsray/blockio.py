"""Parallel positioned reads of many small ranges, without Python per range (Ray-free).

Shared by serving's :mod:`~hpsray.serving.blockread` (rows of a point store) and SSD-PS partial
loads (:mod:`~hpsray.tiers.ssd.reads`): a caller plans its ranges (sorted by file and offset,
adjacent blocks merged), then :func:`read_parallel` issues them from numba loops that hold no GIL,
split among a thread pool, so several reads are in flight at once (an SSD's queue depth instead of
one page fault at a time). :func:`read_ranges` puts it together for ranges of many files: what the
page cache holds is copied at once (from a caller's mapping of the file where it keeps one and
``mincore`` finds the pages resident: no system call per range); the rest goes through this thread's
io_uring ring where it has one (:mod:`hpsray.uring`: up to ``DEPTH`` reads in flight from one
thread, a system call per refill; past the page cache where the caller asks). Where there is no ring
(or for the few ranges a ring leaves short), what the page cache holds is read by
``preadv2(RWF_NOWAIT)`` and the rest is split among the threads, each of which first asks the kernel
to start reading its whole share (``POSIX_FADV_WILLNEED``: asynchronous, so the device sees every
range at once), then reads it.
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

from hpsray import uring

__all__ = [
    "IOV_MAX",
    "MINCORE_GAP_PAGES",
    "MIN_RANGES_PER_THREAD",
    "MIN_RING_RANGES",
    "STAGE_BYTES",
    "copy_mapped",
    "copy_resident",
    "hinted_pread_ranges",
    "pread_ranges",
    "preadv_ranges",
    "queue_depth",
    "read_parallel",
    "read_ranges",
    "ring_read",
]

IOV_MAX = 1024  # Linux's limit of one preadv's vector
MIN_RANGES_PER_THREAD = 16  # fewer ranges than this per thread: the pool's hand-off costs more than it saves
MIN_RING_RANGES = 32  # fewer ranges to read than this: preadv2 and pread (a ring's round trip costs more)
STAGE_BYTES = 16 << 20  # a thread's bounce buffer for direct reads (the ring drains once per fill)
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


def queue_depth(threads: int) -> int:
    """The reads :func:`read_ranges` keeps in flight with ``threads`` I/O threads: the ring's
    depth where this thread has a ring, else the threads (each hinting its share)."""
    return uring.DEPTH if uring.thread_ring() is not None else max(1, threads)


def copy_resident(
    dest: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, mapped: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, int]:
    """The first step of :func:`read_ranges`, for a caller to run apart (on another thread than
    the reads, say): copy the ranges whose pages a mapping (``mapped``, as there) finds resident.
    Returns each range's state (1 copied, 2 a page not resident, 0 not mapped) and the copies."""
    done = np.zeros(int(offsets.size), np.uint8)
    if offsets.size == 0:
        return done, 0
    bases, sizes = mapped
    order = np.lexsort((offsets, bases))  # a file's key and row ranges interleave
    return done, int(copy_mapped(order, bases, sizes, offsets, lengths, dest, mmap.PAGESIZE, done))


def read_ranges(
    pool: Executor | None,
    threads: int,
    fds: np.ndarray,
    dest: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    mapped: tuple[np.ndarray, np.ndarray] | None = None,
    direct: bool = False,
    resident: tuple[np.ndarray, int] | None = None,
) -> tuple[int, int, int]:
    """Read ``lengths[r]`` bytes of file ``fds[r]`` at ``offsets[r]`` to address ``dest[r]``, for
    every range ``r`` (sorted by file and offset, so the device sees them in order): mapped and
    resident ones copied, the rest through the thread's ring or hinted then read in parallel
    (module docstring). ``mapped``: per range, the
    address and length of a read-only mapping of its file (address 0: none), kept by the caller
    for as long as this call runs. ``direct``: the ring reads past the page cache where the
    device takes it (:func:`ring_read`). ``resident``: what :func:`copy_resident` already copied
    (then ``mapped`` is not looked at). Returns the short reads, the ranges copied from mappings
    and those the ring read."""
    n = int(fds.size)
    if n == 0:
        return 0, 0, 0
    fds = np.ascontiguousarray(fds, np.int32)
    if resident is None:
        resident = copy_resident(dest, offsets, lengths, mapped) if mapped is not None else (np.zeros(n, np.uint8), 0)
    done, copied = resident
    if copied == n:
        return 0, copied, 0
    ring = uring.thread_ring() if n - copied >= MIN_RING_RANGES else None
    if ring is None:
        iov = np.empty((n, 2), np.uint64)
        iov[:, 0] = dest
        iov[:, 1] = lengths
        if _read_cached(fds, iov.ctypes.data, offsets, lengths, _NOWAIT, done) == n:
            return 0, copied, 0
    rest = np.flatnonzero(done != 1)
    fds, dest, offsets, lengths = fds[rest], dest[rest], offsets[rest], lengths[rest]
    ringed = 0
    if ring is not None:
        try:
            ok = ring_read(ring, fds, dest, offsets, lengths, direct)
        except OSError:
            uring.drop_thread_ring()
        else:
            again = np.flatnonzero(~ok)  # short or failed: read again the way below
            ringed = int(ok.size - again.size)
            fds, dest, offsets, lengths = fds[again], dest[again], offsets[again], lengths[again]
    args = (fds, 0, dest, offsets, lengths)
    return read_parallel(pool, threads, hinted_pread_ranges, args, int(fds.size)), copied, ringed


@nb.njit(nogil=True, cache=True)
def _copy_staged(stage, staged, skip, dest, lengths, got, need, ok):
    """After direct reads into the bounce buffer at ``stage``: copy each range whose read came
    back whole (``got[r] >= need[r]``) from ``stage + staged[r] + skip[r]`` to ``dest[r]``."""
    for r in range(dest.size):
        if got[r] >= need[r]:
            _memcpy(dest[r], stage + staged[r] + skip[r], lengths[r])
            ok[r] = True


def ring_read(
    ring: uring.Ring,
    fds: np.ndarray,
    dest: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    direct: bool,
) -> np.ndarray:
    """Read every range through ``ring``: with ``direct``, ``O_DIRECT`` where the file's device takes it (each
    range widened to its device's logical blocks, read into the ring's bounce buffer of at most
    ``STAGE_BYTES``, a share of the ranges at a time, and copied out: no page cache filled, none
    reclaimed), else buffered. Returns which ranges were read whole; raises ``OSError`` when the
    ring fails."""
    opened = _direct_fds(fds) if direct else None
    if opened is None:
        return ring.read(fds, dest, offsets, lengths) == lengths
    dfds, align = opened
    try:
        start = offsets // align * align
        need = offsets + lengths - start
        span = -(-need // align) * align
        end, skip = np.cumsum(span), offsets - start
        ok = np.zeros(fds.size, np.bool_)
        stage = ring.staging(min(int(end[-1]), max(STAGE_BYTES, int(span.max()))))
        lo = 0
        while lo < fds.size:  # the ranges whose spans fit the buffer together, from lo on
            base = int(end[lo] - span[lo])
            hi = max(lo + 1, int(np.searchsorted(end, base + STAGE_BYTES, side="right")))
            staged = end[lo:hi] - span[lo:hi] - base
            got = ring.read(dfds[lo:hi], stage + staged, start[lo:hi], span[lo:hi], staged=True)
            _copy_staged(stage, staged, skip[lo:hi], dest[lo:hi], lengths[lo:hi], got, need[lo:hi], ok[lo:hi])
            lo = hi
        return ok
    finally:
        for fd in np.unique(dfds).tolist():
            os.close(fd)


_DIRECT_ALIGN: dict[int, int] = {}  # st_dev -> its logical block size; 0: no O_DIRECT there


def _direct_fds(fds: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per range, a descriptor of its file opened again with ``O_DIRECT`` (the caller closes
    them) and the alignment its device needs; ``None`` where some file cannot be read so."""
    if not hasattr(os, "O_DIRECT"):
        return None
    distinct = np.unique(fds)
    opened: list[int] = []
    aligns = []
    try:
        for fd in distinct.tolist():
            dev = os.fstat(fd).st_dev
            align = _DIRECT_ALIGN.get(dev)
            if align is None:
                align = _DIRECT_ALIGN[dev] = _logical_block(dev)
            if align == 0:
                raise OSError("no O_DIRECT")
            opened.append(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT))
            aligns.append(align)
    except OSError:
        for d in opened:
            os.close(d)
        return None
    at = np.searchsorted(distinct, fds)
    return np.asarray(opened, np.int32)[at], np.asarray(aligns, np.int64)[at]


def _logical_block(dev: int) -> int:
    """The logical block size of the device ``dev`` is on (4096 when unknown: a multiple of
    every common one); 0 for a file system without devices (tmpfs, overlay's upper)."""
    if os.major(dev) == 0:
        return 0
    for rel in ("queue/logical_block_size", "../queue/logical_block_size"):
        try:
            with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/{rel}") as f:
                return max(512, int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return 4096
