"""Reading rows by key from a point store (see :mod:`hpsray.serving.layout`) on CPU.

Keys are found by a binary search of the memory-mapped ``keys.u64``. Rows are copied by a numba
loop from the memory-mapped ``rows.f32`` (``MADV_RANDOM``: a page fault reads the one 4 KiB page
that holds the row, no read-ahead) straight into the caller's output buffer, in file order: one
copy, no system call per row. Rows in the page cache cost a memory copy (0.04 µs of CPU per row
here); the previous design, one ``pread`` per row, cost 0.34-0.5 µs each in system calls, half of
a tiered lookup's CPU (docs/serving.md, Figures). :meth:`PointStore.pread_rows` keeps the
``pread`` path (explicit reads, e.g. to measure against). Rows that are not in the page cache
fault in one page at a time on this path; :meth:`PointStore.block_reader` reads a batch's rows in
merged ranges from a thread pool instead (:mod:`hpsray.serving.blockread`), the tiered lookup's
default.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numba as nb
import numpy as np

from hpsray.errors import ServingError
from hpsray.serving.blockread import BlockReader
from hpsray.serving.layout import read_meta

__all__ = ["PointStore"]

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pread.restype = ctypes.c_ssize_t


@nb.njit(nogil=True, cache=True)
def _copy_rows(src, file_rows, out, out_rows, dim):
    """``out[out_rows[i], :dim] = src[file_rows[i], :dim]``."""
    for i in range(file_rows.size):
        r, o = file_rows[i], out_rows[i]
        for j in range(dim):
            out[o, j] = src[r, j]


@nb.njit(nogil=True)  # not cached: it calls libc's pread through a ctypes pointer
def _pread_rows(fd, out_addr, out_stride, file_rows, out_rows, stride, nbytes):
    """``pread`` row ``file_rows[i]`` into output row ``out_rows[i]``; returns the failures."""
    failed = 0
    for i in range(file_rows.size):
        got = _pread(fd, out_addr + out_rows[i] * out_stride, nbytes, file_rows[i] * stride)
        if got != nbytes:
            failed += 1
    return failed


class PointStore:
    """Rows by key from a point store directory; one instance per process (holds a descriptor)."""

    def __init__(self, directory: str) -> None:
        meta = read_meta(directory)
        self.directory = directory
        self.dim, self.rows, self.stride = int(meta["dim"]), int(meta["rows"]), int(meta["stride"])
        keys_path = os.path.join(directory, "keys.u64")
        if self.rows:
            self.keys: np.ndarray = np.memmap(keys_path, dtype=np.uint64, mode="r", shape=(self.rows,))
        else:
            self.keys = np.empty(0, np.uint64)
        self._fd = os.open(os.path.join(directory, "rows.f32"), os.O_RDONLY)
        self._map = None
        self._rows = np.empty((0, self.stride // 4), np.float32)
        if self.rows:
            self._map = mmap.mmap(self._fd, self.rows * self.stride, prot=mmap.PROT_READ)
            if hasattr(self._map, "madvise"):
                self._map.madvise(mmap.MADV_RANDOM)
            self._rows = np.frombuffer(self._map, np.float32).reshape(self.rows, self.stride // 4)

    def __len__(self) -> int:
        return self.rows

    @property
    def rows_path(self) -> str:
        """The rows file (``rows.f32``)."""
        return os.path.join(self.directory, "rows.f32")

    def block_reader(self, threads: int = 8) -> BlockReader:
        """A :class:`~hpsray.serving.blockread.BlockReader` of this store's rows (its own descriptor)."""
        return BlockReader(self.rows_path, self.rows, self.dim, self.stride, threads=threads)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """``int64[n]``: each key's row number in the store, ``-1`` where the store lacks it."""
        keys = np.asarray(keys, np.uint64)
        if not self.rows:
            return np.full(keys.size, -1, np.int64)
        pos = np.searchsorted(self.keys, keys)
        pos[pos == self.rows] = 0
        return np.where(self.keys[pos] == keys, pos, -1).astype(np.int64)

    def _check(self, file_rows: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if out.dtype != np.float32 or out.ndim != 2 or out.shape[1] != self.dim or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous float32[m, {self.dim}], got {out.dtype} {out.shape}")
        order = np.argsort(file_rows, kind="stable")
        src = np.ascontiguousarray(file_rows[order], np.int64)
        dst = np.ascontiguousarray(out_rows[order], np.int64)
        if src.size and (src[0] < 0 or src[-1] >= self.rows or dst.min() < 0 or dst.max() >= out.shape[0]):
            raise ValueError(f"rows out of range: file rows {src[0]}..{src[-1]} of {self.rows}")
        return src, dst

    def read_into(self, file_rows: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> None:
        """``out[out_rows[i]] = row file_rows[i]`` (``out``: C-contiguous float32[m, dim]).

        Copies go in file order (sorted positions) for locality; each lands in its output row.
        """
        src, dst = self._check(file_rows, out, out_rows)
        if src.size:
            _copy_rows(self._rows, src, out, dst, self.dim)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found bool[n], float32[n, dim])``: the rows of ``keys`` (zeros for keys not stored)."""
        pos = self.find(keys)
        found = pos >= 0
        out = np.zeros((keys.size, self.dim), np.float32)
        self.read_into(pos[found], out, np.flatnonzero(found))
        return found, out

    def pread_rows(self, file_rows: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> None:
        """:meth:`read_into` by one ``pread`` per row (issued from a numba loop, in file order)."""
        src, dst = self._check(file_rows, out, out_rows)
        failed = _pread_rows(self._fd, out.ctypes.data, out.strides[0], src, dst, self.stride, 4 * self.dim)
        if failed:
            raise ServingError(f"{self.directory}/rows.f32: {failed} short reads (file truncated?)")

    def read_all(self) -> np.ndarray:
        """Every row (``float32[rows, dim]``), for a model held all in memory."""
        if not self.rows:
            return np.empty((0, self.dim), np.float32)
        raw = np.fromfile(
            os.path.join(self.directory, "rows.f32"), dtype=np.float32, count=self.rows * self.stride // 4
        )
        return np.ascontiguousarray(raw.reshape(self.rows, self.stride // 4)[:, : self.dim])

    def close(self) -> None:
        self._rows = np.empty((0, self.stride // 4), np.float32)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view of it is still alive somewhere: the GC unmaps it later
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
