"""SSD misses read in batches: merged ranges of the point store's rows file, ``preadv`` from a thread pool.

A batch's missed rows (their row numbers in a :class:`~hpsray.serving.pointstore.PointStore`)
are sorted and cut into *ranges* (:func:`plan_ranges`): consecutive rows join a range while the
bytes between one row's end and the next row's start are at most ``max_gap_bytes`` (default
4 KiB: rows of the same or the next block) and the range holds at most ``max_range_rows``. Each
range is **one** ``preadv`` system call whose I/O vector puts every row straight into its row of
the caller's buffer (rows at their natural ``dim * 4`` bytes, no staging copy) and the bytes
between rows into a scratch buffer. The ranges are split among a pool of threads, each issuing
its calls from a numba loop without the GIL, so several reads are in flight at once (an SSD's
queue depth instead of one page fault at a time). So a batch costs ``reads`` system calls for
``rows`` rows: ``reads_per_missed_row`` below 1 whenever missed rows share blocks, never above.

Where kvikio (cuFile, GPUDirect Storage) is installed, :meth:`BlockReader.read_device` reads the
same ranges straight into device memory, one ``CuFile.pread`` per range, and picks the rows out
of them on the device (see :mod:`hpsray.serving.gds`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba as nb
import numpy as np

from hpsray.blockio import IOV_MAX, MIN_RANGES_PER_THREAD, preadv_ranges, read_parallel
from hpsray.errors import PrivateControlFlow, ServingError
from hpsray.serving.layout import BLOCK_BYTES

__all__ = ["BlockReader", "Ranges", "plan_ranges"]

MAX_RANGE_ROWS = IOV_MAX // 2  # a range of r rows takes at most 2r - 1 I/O vector entries


@nb.njit(nogil=True, cache=True)
def _plan(rows, stride, nbytes, max_gap, max_rows, starts):
    """Cut sorted distinct ``rows`` into ranges; ``starts[k]``: the first index of range ``k``. Returns
    the number of ranges (``starts[n_ranges] = rows.size``)."""
    n = 0
    first = 0
    for i in range(rows.size):
        if i == 0 or (rows[i] - rows[i - 1]) * stride - nbytes > max_gap or i - first >= max_rows:
            starts[n] = i
            n += 1
            first = i
    starts[n] = rows.size
    return n


@nb.njit(nogil=True, cache=True)
def _vectors(rows, dst, starts, n_ranges, out_addr, out_row_bytes, scratch_addr, stride, nbytes, iov, first_iov, n_iov):
    """The I/O vector of every range: each row into ``out`` row ``dst[i]``, each gap into the scratch."""
    k = 0
    for r in range(n_ranges):
        first_iov[r] = k
        for i in range(starts[r], starts[r + 1]):
            if i > starts[r]:
                gap = (rows[i] - rows[i - 1]) * stride - nbytes
                if gap > 0:
                    iov[k, 0] = scratch_addr
                    iov[k, 1] = gap
                    k += 1
            iov[k, 0] = out_addr + dst[i] * out_row_bytes
            iov[k, 1] = nbytes
            k += 1
        n_iov[r] = k - first_iov[r]


class _Repeated(PrivateControlFlow, ValueError):
    """A row asked for twice in one plan: :meth:`BlockReader.read_into` catches it and reads the
    distinct rows; to a caller of :func:`plan_ranges` it is the ``ValueError`` of a wrong argument."""


class Ranges:
    """The merged ranges of a batch of rows (see :func:`plan_ranges`)."""

    def __init__(self, rows: np.ndarray, order: np.ndarray, starts: np.ndarray, stride: int, nbytes: int) -> None:
        self.rows = rows  # int64[m], sorted, distinct
        self.order = order  # rows[j] is the caller's row order[j]
        self.starts = starts  # int64[n + 1]: range k holds rows[starts[k]:starts[k + 1]]
        first, last = rows[starts[:-1]], rows[starts[1:] - 1]
        self.offsets = first * stride  # file offset of each range
        self.lengths = (last - first) * stride + nbytes  # bytes of each range

    def __len__(self) -> int:
        return int(self.starts.size - 1)


def plan_ranges(
    file_rows: np.ndarray,
    stride: int,
    nbytes: int,
    max_gap_bytes: int = BLOCK_BYTES,
    max_range_rows: int = MAX_RANGE_ROWS,
) -> Ranges:
    """The ranges one batch of distinct row numbers is read in (see the module docstring)."""
    if max_gap_bytes < 0 or not 1 <= max_range_rows <= MAX_RANGE_ROWS:
        raise ValueError(f"max_gap_bytes must be >= 0 and max_range_rows in 1..{MAX_RANGE_ROWS}")
    file_rows = np.asarray(file_rows, np.int64)
    order = np.argsort(file_rows, kind="stable")
    rows = np.ascontiguousarray(file_rows[order])
    if rows.size > 1 and np.any(rows[1:] == rows[:-1]):
        raise _Repeated("file rows must be distinct (one per distinct key)")
    starts = np.empty(rows.size + 1, np.int64)
    n = _plan(rows, stride, nbytes, max_gap_bytes, max_range_rows, starts) if rows.size else 0
    starts[n] = rows.size
    return Ranges(rows, order, starts[: n + 1], stride, nbytes)


class BlockReader:
    """Rows of a point store's ``rows.f32`` by merged, parallel ``preadv`` (see the module docstring).

    ``threads``: reads in flight at once (default 8: enough to keep an SSD's queue busy; a range's
    call blocks only its thread). Counts ``reads`` (system calls, or cuFile reads) and ``rows``.
    Safe to call from several threads at once (each call has its own I/O vectors; the scratch
    buffer only ever receives the bytes between rows, which nobody reads).
    """

    def __init__(
        self,
        path: str,
        rows: int,
        dim: int,
        stride: int,
        threads: int = 8,
        max_gap_bytes: int = BLOCK_BYTES,
        max_range_rows: int = MAX_RANGE_ROWS,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.path, self.n_rows, self.dim, self.stride = path, rows, dim, stride
        self.threads, self.max_gap_bytes, self.max_range_rows = threads, max_gap_bytes, max_range_rows
        self._fd = os.open(path, os.O_RDONLY)
        self._scratch = np.empty(max(1, max_gap_bytes + stride), np.uint8)
        self._pool: ThreadPoolExecutor | None = None
        self._cufile: Any = None
        self._lock = threading.Lock()
        self.reads = 0
        self.rows = 0

    @property
    def reads_per_row(self) -> float:
        """System calls per row read so far (0 before any read)."""
        return self.reads / self.rows if self.rows else 0.0

    def _plan(self, file_rows: np.ndarray) -> Ranges:
        ranges = plan_ranges(file_rows, self.stride, 4 * self.dim, self.max_gap_bytes, self.max_range_rows)
        if ranges.rows.size and (ranges.rows[0] < 0 or ranges.rows[-1] >= self.n_rows):
            raise ValueError(f"rows out of range: file rows {ranges.rows[0]}..{ranges.rows[-1]} of {self.n_rows}")
        return ranges

    def read_into(self, file_rows: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> None:
        """``out[out_rows[i]] = row file_rows[i]``; ``out``: C-contiguous float32[m, dim] in host
        memory (pinned or not). A row asked for twice is read once and copied. Raises
        :class:`ServingError` on a short read."""
        if out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != self.dim or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32[m, {self.dim}], got {out.dtype} {out.shape}")
        out_rows = np.asarray(out_rows, np.int64)
        if out_rows.size != np.size(file_rows):
            raise ValueError(f"{np.size(file_rows)} file rows for {out_rows.size} output rows")
        if out_rows.size and (out_rows.min() < 0 or out_rows.max() >= out.shape[0]):
            raise ValueError(f"output rows out of range 0..{out.shape[0] - 1}")
        try:
            ranges = self._plan(file_rows)
        except _Repeated:
            rows, first, inverse = np.unique(np.asarray(file_rows, np.int64), return_index=True, return_inverse=True)
            self.read_into(rows, out, out_rows[first])
            out[out_rows] = out[out_rows[first][inverse]]
            return
        n = len(ranges)
        if not n:
            return
        dst = np.ascontiguousarray(out_rows[ranges.order])
        iov = np.empty((2 * ranges.rows.size, 2), np.uint64)
        first_iov, n_iov = np.empty(n, np.int64), np.empty(n, np.int64)
        _vectors(
            ranges.rows,
            dst,
            ranges.starts,
            n,
            out.ctypes.data,
            out.strides[0],
            self._scratch.ctypes.data,
            self.stride,
            4 * self.dim,
            iov,
            first_iov,
            n_iov,
        )
        args = (self._fd, iov.ctypes.data, first_iov, n_iov, ranges.offsets, ranges.lengths)
        if self.threads > 1 and n >= 2 * MIN_RANGES_PER_THREAD:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hpsray-blockread")
        short = read_parallel(self._pool, self.threads, preadv_ranges, args, n)
        self._count(n, int(ranges.rows.size))
        if short:
            raise ServingError(f"{self.path}: {short} short reads (file truncated?)")

    def read_device(self, file_rows: np.ndarray, xp: Any) -> Any:
        """``float32[m, dim]`` in device memory (``xp`` = CuPy): row ``file_rows[i]`` in row ``i``,
        read through kvikio (cuFile: GPUDirect Storage where the file system and driver allow it),
        one ``pread`` per merged range into a device staging buffer, rows picked out on the device."""
        import kvikio

        if self._cufile is None:
            self._cufile = kvikio.CuFile(self.path, "r")
        ranges = self._plan(file_rows)
        m = ranges.rows.size
        if not m:
            return xp.empty((0, self.dim), xp.float32)
        at = np.zeros(len(ranges) + 1, np.int64)  # where each range lands in the staging buffer
        np.cumsum(ranges.lengths, out=at[1:])
        staging = xp.empty(int(at[-1]), xp.uint8)
        futures = [
            self._cufile.pread(staging[int(a) : int(a) + int(n)], int(n), int(off))
            for a, n, off in zip(at[:-1], ranges.lengths, ranges.offsets)
        ]
        for fut, n in zip(futures, ranges.lengths):
            if fut.get() != n:
                raise ServingError(f"{self.path}: short read through kvikio")
        range_of = np.repeat(np.arange(len(ranges)), np.diff(ranges.starts))
        byte = at[range_of] + (ranges.rows - ranges.rows[ranges.starts[range_of]]) * self.stride
        words = xp.asarray(byte // 4)[:, None] + xp.arange(self.dim)[None, :]
        rows = staging.view(xp.float32)[words]  # rows in file order
        out = xp.empty((m, self.dim), xp.float32)
        out[xp.asarray(ranges.order)] = rows
        self._count(len(ranges), m)
        return out

    def _count(self, reads: int, rows: int) -> None:
        with self._lock:
            self.reads += reads
            self.rows += rows

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._cufile is not None:
            self._cufile.close()
            self._cufile = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
