"""Positioned reads of many small ranges through an io_uring ring, from a numba loop (Ray-free).

One ring per thread (:func:`thread_ring`), driven by the raw system calls: the loop writes read
requests into the submission queue, enters the kernel once per refill to submit them and wait for
at least one completion, and reaps the completion queue, so up to ``depth`` reads are in flight
from one thread and the kernel sees them in one call instead of one ``pread`` each
(docs/benchmarks.md, "io_uring reads": 5.2 µs of CPU per buffered read, 3.3 µs direct, against
8.2 µs for hinted ``pread`` on 4 threads). On unless ``$HPSRAY_IO_URING`` is ``0``
(docs/operations.md); where it is, and where the kernel has no io_uring or forbids it (``EPERM``,
``ENOSYS``: seccomp, ``kernel.io_uring_disabled``), :func:`thread_ring` returns ``None`` and
callers read with ``pread``. Whether a ring's reads go past the page cache is the caller's
choice (:func:`hpsray.blockio.ring_read`). A ring's bounce buffer (:meth:`Ring.staging`) is
registered with the kernel where it allows (``RLIMIT_MEMLOCK``), so reads into it skip pinning
their pages each time (``IORING_OP_READ_FIXED``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any

import numba as nb
import numpy as np
from numba import types as nbt

__all__ = ["DEPTH", "Ring", "drop_thread_ring", "thread_ring"]

DEPTH = 256
"""Reads a ring keeps in flight. This disk alone saturates at 128 (~90k reads/s), but beside the
training the reaping thread waits for a core, and 128 left ~81 at the device; 256 kept ~175 there
and loaded 6-8 % faster, 512 no faster (docs/benchmarks.md, Bigger than memory, 2026-12-07)."""
_ENTRIES = 2 * DEPTH  # submission slots: a full refill never waits for a slot
_SYS_SETUP, _SYS_ENTER = 425, 426  # the same numbers on every architecture since Linux 5.1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FEAT_SINGLE_MMAP = 1
_OP_READ, _OP_READ_FIXED = 22, 4
_REGISTER_BUFFERS, _UNREGISTER_BUFFERS = 0, 1
_SYS_REGISTER = 427
_ENTER_GETEVENTS = 1
_RETRIES = 1000  # failed enters in a row before the ring gives up
_i64 = nbt.int64
_syscall: Any = nbt.ExternalFunction("syscall", _i64(_i64, _i64, _i64, _i64, _i64, _i64, _i64))


class _Params(ctypes.Structure):
    """``struct io_uring_params``: the ring's sizes and the offsets of its fields."""

    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", ctypes.c_uint32 * 8),  # head, tail, ring_mask, ring_entries, flags, dropped, array, resv1
        ("sq_user_addr", ctypes.c_uint64),
        ("cq_off", ctypes.c_uint32 * 8),  # head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1
        ("cq_user_addr", ctypes.c_uint64),
    ]


class Ring:
    """One io_uring instance of ``entries`` submission slots (raises ``OSError`` where the kernel
    refuses one). Not shared between threads."""

    def __init__(self, entries: int = _ENTRIES) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        p = _Params()
        fd = libc.syscall(ctypes.c_long(_SYS_SETUP), ctypes.c_uint32(entries), ctypes.byref(p))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = int(fd)
        try:
            so, co = list(p.sq_off), list(p.cq_off)
            sq_len, cq_len = so[6] + p.sq_entries * 4, co[5] + p.cq_entries * 16
            single = bool(p.features & _FEAT_SINGLE_MMAP)
            if single:
                sq_len = cq_len = max(sq_len, cq_len)
            rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
            self._maps = [mmap.mmap(fd, sq_len, shared, rw, offset=_OFF_SQ_RING)]
            if not single:
                self._maps.append(mmap.mmap(fd, cq_len, shared, rw, offset=_OFF_CQ_RING))
            self._maps.append(mmap.mmap(fd, p.sq_entries * 64, shared, rw, offset=_OFF_SQES))
        except BaseException:
            os.close(fd)
            raise
        self.sq = np.frombuffer(self._maps[0], np.uint32)
        self.cq = np.frombuffer(self._maps[-2] if not single else self._maps[0], np.uint32)
        # word indices: the head, tail, mask, and the array of indices / the completions
        self.sq_at = np.array([so[0], so[1], so[2], so[6]], np.int64) // 4
        self.cq_at = np.array([co[0], co[1], co[2], co[5]], np.int64) // 4
        self.sqes = np.frombuffer(self._maps[-1], np.uint64).reshape(-1, 8)
        self.entries = int(p.sq_entries)
        self._stage = np.empty(0, np.uint8)  # a view of an anonymous mapping, freed with it
        self._libc = libc
        self.fixed = False  # whether the bounce buffer is registered (reads into it READ_FIXED)

    def read(
        self,
        fds: np.ndarray,
        dest: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        depth: int = DEPTH,
        staged: bool = False,
    ) -> np.ndarray:
        """Read ``lengths[r]`` bytes of file ``fds[r]`` at ``offsets[r]`` to address ``dest[r]``
        for every ``r``, at most ``depth`` at once; returns each read's result (bytes read, or a
        negative errno: a caller re-reads those that fall short its own way). ``staged``: every
        destination lies in the buffer of the last :meth:`staging` call (read with
        ``READ_FIXED`` where it is registered). Raises ``OSError`` when the ring itself fails
        (the reads' results are then unknown, and the ring unusable)."""
        res = np.zeros(fds.size, np.int64)
        if fds.size:
            err = _ring_read(
                self.fd, self.sq, self.sq_at, self.cq, self.cq_at, self.sqes, max(1, min(depth, self.entries)),
                np.ascontiguousarray(fds, np.int32), np.ascontiguousarray(dest, np.int64),
                np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(lengths, np.int64), res,
                _OP_READ_FIXED if staged and self.fixed else _OP_READ,
            )  # fmt: skip
            if err:
                raise OSError(-err, f"io_uring_enter: {os.strerror(-err)}")
        return res

    def staging(self, nbytes: int) -> int:
        """The address of this ring's page-aligned bounce buffer of at least ``nbytes`` (for
        ``O_DIRECT`` reads; valid until the next call), registered with the kernel where it
        allows (:attr:`fixed`)."""
        if self._stage.size < nbytes:
            self._register(None)
            self._stage = np.frombuffer(mmap.mmap(-1, max(nbytes, 2 * self._stage.size)), np.uint8)
            self._register(self._stage)
        return int(self._stage.ctypes.data)

    def _register(self, buf: np.ndarray | None) -> None:
        """Register ``buf`` as the ring's one fixed buffer (``None``: unregister the current
        one); :attr:`fixed` says whether one is registered (the kernel may refuse: memlock)."""
        sc = self._libc.syscall
        if buf is None:
            if self.fixed:
                sc(ctypes.c_long(_SYS_REGISTER), ctypes.c_uint(self.fd), ctypes.c_uint(_UNREGISTER_BUFFERS), None, 0)
            self.fixed = False
            return
        iov = (ctypes.c_uint64 * 2)(buf.ctypes.data, buf.size)
        got = sc(ctypes.c_long(_SYS_REGISTER), ctypes.c_uint(self.fd), ctypes.c_uint(_REGISTER_BUFFERS), iov, 1)
        self.fixed = got == 0

    def close(self) -> None:
        """Unmap the ring and close it (the views of its mappings go first: a mapping with views
        cannot close)."""
        self._register(None)
        self._stage = np.empty(0, np.uint8)
        self.sq = self.cq = np.empty(0, np.uint32)
        self.sqes = np.empty((0, 8), np.uint64)
        for m in self._maps:
            m.close()
        os.close(self.fd)


@nb.njit(nogil=True, cache=True)
def _ring_read(ring_fd, sq, sq_at, cq, cq_at, sqes, depth, fds, dest, offsets, lengths, res, op):
    """The read loop of :meth:`Ring.read` (``op``: READ, or READ_FIXED of buffer 0): returns 0,
    or the negative errno of a failed enter."""
    n = fds.size
    sq_head, sq_tail, sq_mask, sq_array = sq_at[0], sq_at[1], sq[sq_at[2]], sq_at[3]
    cq_head, cq_tail, cq_mask, cqes = cq_at[0], cq_at[1], cq[cq_at[2]], cq_at[3]
    nxt = done = inflight = failed = 0
    tail = sq[sq_tail]
    while done < n:
        while inflight < depth and nxt < n:
            slot = tail & sq_mask
            e = sqes[slot]
            e[0] = np.uint64(op) | (np.uint64(np.uint32(fds[nxt])) << np.uint64(32))  # opcode, fd
            e[1] = np.uint64(offsets[nxt])
            e[2] = np.uint64(dest[nxt])
            e[3] = np.uint64(lengths[nxt])  # the length; no read flags
            e[4] = np.uint64(nxt)  # user data: the range
            e[5] = e[6] = e[7] = 0  # a fixed read's buffer index (0) is e[5]'s low 16 bits
            sq[sq_array + slot] = slot
            tail += np.uint32(1)
            nxt += 1
            inflight += 1
        sq[sq_tail] = tail  # the kernel reads the queue only inside the call below
        got = _syscall(_SYS_ENTER, ring_fd, np.int64(np.uint32(tail - sq[sq_head])), 1, _ENTER_GETEVENTS, 0, 0)
        if got < 0:  # syscall() returns -1, errno unread here: EINTR (a signal) is the usual one; retried
            failed += 1
            if failed == _RETRIES:
                return -5  # EIO
            continue
        failed = 0
        head, ctail = cq[cq_head], cq[cq_tail]
        while head != ctail:
            c = cqes + 4 * (head & cq_mask)
            r = np.int64(cq[c]) | (np.int64(cq[c + 1]) << 32)
            res[r] = np.int32(cq[c + 2])
            head += np.uint32(1)
            inflight -= 1
            done += 1
        cq[cq_head] = head
    return 0


_local = threading.local()


def thread_ring() -> Ring | None:
    """This thread's ring, made on first use unless ``$HPSRAY_IO_URING`` is ``0``; ``None`` where
    it is, or io_uring is unavailable (module docstring): then always ``None`` in this thread."""
    if not hasattr(_local, "ring"):
        _local.ring = None
        if os.environ.get("HPSRAY_IO_URING", "1").strip() != "0":
            try:
                _local.ring = Ring()
            except OSError:
                pass
    ring: Ring | None = _local.ring
    return ring


def drop_thread_ring() -> None:
    """After the ring failed (:meth:`Ring.read` raised): this thread reads without one from now."""
    ring = getattr(_local, "ring", None)
    _local.ring = None
    if ring:
        ring.close()
