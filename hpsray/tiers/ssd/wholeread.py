"""Whole-file loads in one pass: read a parameter file, verify its checksums and pick rows.

Contract of :func:`read_pick`: the same checks as :func:`~hpsray.tiers.ssd.paramfile.read_file`
(header, size, index, rows and block-table checksums, every byte of the file) and the same
errors, plus the key check of each picked row; it raises before returning whenever a check fails,
so a caller never uses rows of a damaged file. The index is read and verified first; the rows are
then read in chunks of about :data:`CHUNK_BYTES` (they stay in the core's cache while their
checksum runs and the requested rows are copied out), all in one numba loop that holds no GIL,
so the I/O threads verify and pick on every core. The requested positions of a file must come
sorted by chunk (:func:`chunk_rows_for`); the rows' destinations are prefetched a few rows ahead
(they land at random places of the output). The CRC-32 is called directly: libdeflate's
``libdeflate_crc32`` where the library is installed (the same checksum as zlib's, 2-3 times
faster: carry-less multiplies), else zlib's ``crc32`` (the one Python's ``zlib`` uses). Where
neither can be linked, :data:`ONE_PASS` is false and callers read whole files with ``read_file``.
"""

from __future__ import annotations

import ctypes.util
import os
from typing import Any

import llvmlite.binding as llb
import numba as nb
import numpy as np
from numba import types as nbt

from hpsray.errors import CorruptFileError
from hpsray.kernels.prefetch import prefetch as _prefetch
from hpsray.kernels.prefetch import prefetch_write
from hpsray.kernels.table import readonly
from hpsray.tiers.ssd.paramfile import HEADER_BYTES, check_shape, decode_header

__all__ = ["CHUNK_BYTES", "ONE_PASS", "Buffers", "chunk_rows_for", "read_pick"]

CHUNK_BYTES = 256 << 10  # rows read, verified and picked at a time: well inside a core's L2


_CRC32_SYMBOL = "hpsray_crc32"  # the kernels call this name; bound below (no address baked into cached code)


def _link_crc32() -> str | None:
    """Bind :data:`_CRC32_SYMBOL` to libdeflate's ``libdeflate_crc32`` or else zlib's ``crc32``;
    returns the library's name, or None when neither loads. Both take ``(crc, buffer, length)``
    and return the CRC-32 in the low 32 bits; the kernels pass 64-bit integers whose values fit
    both prototypes (crc < 2**32, length <= 2**30) and mask the result."""
    for lib, fn in (
        ("libdeflate.so.0", "libdeflate_crc32"),
        (ctypes.util.find_library("deflate"), "libdeflate_crc32"),
        ("libz.so.1", "crc32"),
        (ctypes.util.find_library("z"), "crc32"),
    ):
        if not lib:
            continue
        try:
            addr = ctypes.cast(getattr(ctypes.CDLL(lib), fn), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if addr:
            llb.add_symbol(_CRC32_SYMBOL, addr)
            return lib
    return None


CRC32_LIBRARY = _link_crc32()
"""The library whose CRC-32 :func:`read_pick` calls (None: none could be linked)."""
ONE_PASS = CRC32_LIBRARY is not None
"""Whether a CRC-32 is linked, so :func:`read_pick` can run."""

_crc32: Any = nbt.ExternalFunction(_CRC32_SYMBOL, nbt.uint64(nbt.uint64, nbt.uint64, nbt.uint64))
_pread: Any = nbt.ExternalFunction("pread", nbt.int64(nbt.int32, nbt.uint64, nbt.uint64, nbt.int64))

_AHEAD = 32  # picked rows whose destination is prefetched ahead of the copy

_OK, _SHORT, _INDEX, _ROWS, _TABLE, _KEY = 0, 1, 2, 3, 4, 5


def chunk_rows_for(width: int) -> int:
    """Rows of a chunk (:data:`CHUNK_BYTES` of row data)."""
    return max(1, CHUNK_BYTES // max(4 * width, 1))


@nb.njit(cache=True, nogil=True, inline="always")
def _read_at(fd, addr, nbytes, offset):
    """``pread`` exactly ``nbytes``; False on end of file or an error."""
    done = 0
    while done < nbytes:
        k = _pread(fd, addr + done, nbytes - done, offset + done)
        if k <= 0:
            return False
        done += k
    return True


@nb.njit(cache=True, nogil=True, inline="always")
def _crc(addr, nbytes, c):
    while nbytes > 0:
        k = min(nbytes, 1 << 30)
        c = _crc32(c, addr, k) & np.uint64(0xFFFFFFFF)
        addr += k
        nbytes -= k
    return c


@nb.njit(cache=True, nogil=True)
def _read_pick(fd, n, width, n_blocks, sums, index, chunk, table, chunk_rows, idx, pos, keys, out):
    """Read, verify and pick (see :func:`read_pick`); returns ``(status, j)``: j is the first
    entry whose key does not match (status ``_KEY``)."""
    if not _read_at(fd, index.ctypes.data, 16 * n, HEADER_BYTES):
        return _SHORT, 0
    if _crc(index.ctypes.data, 16 * n, np.uint64(0)) != sums[0]:
        return _INDEX, 0
    row_bytes = 4 * width
    out_addr = out.ctypes.data
    base = HEADER_BYTES + 16 * n
    c = np.uint64(0)
    bad = -1
    j = 0
    m = idx.size
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        nbytes = (hi - lo) * row_bytes
        if not _read_at(fd, chunk.ctypes.data, nbytes, base + lo * row_bytes):
            return _SHORT, 0
        c = _crc(chunk.ctypes.data, nbytes, c)
        while bad < 0 and j < m and pos[j] < hi:
            if j + _AHEAD < m:  # the rows land at random places of out: overlap their misses
                i2 = idx[j + _AHEAD]
                _prefetch(keys, i2)
                a = out_addr + i2 * row_bytes
                for off in range(0, row_bytes, 64):
                    prefetch_write(a + off)
                prefetch_write(a + row_bytes - 1)
            p = pos[j]
            i = idx[j]
            if p < lo or index[p] != keys[i]:  # p < lo: not sorted by chunk
                bad = j
                break
            for k in range(width):
                out[i, k] = chunk[p - lo, k]
            j += 1
    if c != sums[1]:
        return _ROWS, 0
    if n_blocks > 0:
        if not _read_at(fd, table.ctypes.data, 4 * n_blocks, base + n * row_bytes):
            return _SHORT, 0
        if _crc(table.ctypes.data, 4 * n_blocks, np.uint64(0)) != sums[2]:
            return _TABLE, 0
    if bad < 0 and j < m:  # positions beyond the file
        bad = j
    if bad >= 0:
        return _KEY, bad
    return _OK, 0


class Buffers:
    """One thread's reusable buffers (index, one chunk of rows, block table)."""

    def __init__(self) -> None:
        self.index = np.empty(0, np.uint64)
        self.chunk = np.empty((0, 0), np.float32)
        self.table = np.empty(0, np.uint32)

    def fit(self, n: int, width: int, chunk_rows: int, n_blocks: int) -> None:
        if self.index.size < 2 * n:
            self.index = np.empty(max(2 * n, 1 << 16), np.uint64)
        if self.chunk.shape != (chunk_rows, width):
            self.chunk = np.empty((chunk_rows, width), np.float32)
        if self.table.size < n_blocks:
            self.table = np.empty(max(n_blocks, 1 << 12), np.uint32)


def read_pick(
    path: str,
    fd: int,
    width: int,
    bufs: Buffers,
    idx: np.ndarray,
    pos: np.ndarray,
    keys: np.ndarray,
    out: np.ndarray,
) -> int:
    """Read the parameter file ``path`` (open as ``fd``) whole, verify every checksum, and set
    ``out[idx[j]]`` to its row at position ``pos[j]`` (``pos`` sorted by chunk) after checking
    that the file holds ``keys[idx[j]]`` there. Returns the file's size; raises
    :class:`CorruptFileError` naming the file and the damage."""
    head = os.pread(fd, HEADER_BYTES, 0)
    h = decode_header(head, path)
    size = os.fstat(fd).st_size
    check_shape(h, size, path, width)
    cr = chunk_rows_for(width)
    nb_ = h.n_blocks if h.block_rows else 0
    bufs.fit(h.n, width, cr, nb_)
    sums = np.array([h.index_crc, h.rows_crc, h.table_crc], np.uint64)
    status, j = _read_pick(
        fd, h.n, width, nb_, sums, bufs.index, bufs.chunk, bufs.table, cr, idx, pos, readonly(keys), out
    )
    if status == _SHORT:
        raise CorruptFileError(f"{path}: truncated (a read came back short of the {size} bytes)")
    if status == _INDEX:
        raise CorruptFileError(f"{path}: index checksum mismatch (keys/versions damaged: its {h.n} rows at stake)")
    if status == _ROWS:
        raise CorruptFileError(f"{path}: rows checksum mismatch (row data damaged: its {h.n} rows at stake)")
    if status == _TABLE:
        raise CorruptFileError(f"{path}: block table checksum mismatch")
    if status == _KEY:
        raise CorruptFileError(f"{path}: row {int(pos[j])} does not hold key {int(keys[idx[j]])} as the mapping says")
    return h.size
