"""SSD-PS parameter files: an immutable, checksummed block of rows (layout: docs/tiers.md,
Parameter file).

Contract: a file is written once, under a temporary name, fsynced, then renamed, and never
modified; readers verify what they use (a whole-file read: header, index, rows and block table;
a partial read: every block it touches) and raise ``CorruptFileError`` naming the file and the
damaged part. Formats 1 and 2 are still read, always whole. One concept, the on-disk format (its
writer, its readers and their checks), so one module though it is over 500 lines: split, a
reader and the writer it must match would live apart.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from hpsray.errors import CorruptFileError
from hpsray.fileio import FULL_ERRNOS, Writer, full_error, unlink_quiet, write_all

__all__ = [
    "BLOCK_BYTES",
    "FLAG_COMPACTED",
    "FLAG_TOMBSTONE",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "PARTIAL_VERSIONS",
    "READABLE_VERSIONS",
    "SUFFIX",
    "TMP_SUFFIX",
    "Header",
    "ParamFile",
    "block_rows_for",
    "block_sums",
    "check_shape",
    "decode_header",
    "encode_header",
    "file_bytes",
    "file_name",
    "n_blocks",
    "parse_file_name",
    "read_file",
    "read_index",
    "record_bytes",
    "span_sum",
    "write_tmp",
]

MAGIC = b"HPSPARAM"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
PARTIAL_VERSIONS = (3,)  # formats whose block tables partial loads use (format 2 files load whole)
BLOCK_BYTES = 512  # target bytes of row data per checksummed block
HEADER_BYTES = 64
FLAG_COMPACTED = 1
FLAG_TOMBSTONE = 2  # every row is a deletion (zeros): the key is absent from this version on
SUFFIX = ".hps"
TMP_SUFFIX = ".tmp"

_HEADER = struct.Struct("<8sIIQQIIIII8s")  # 60 bytes, followed by the header crc
assert _HEADER.size == 60


def file_name(file_no: int) -> str:
    return f"{file_no:016x}{SUFFIX}"


def parse_file_name(name: str) -> int | None:
    """File number of a parameter file name, ``None`` for any other name."""
    if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


def record_bytes(width: int) -> int:
    """On-disk bytes per row: key + version + ``width`` floats."""
    return 16 + 4 * width


def block_rows_for(width: int) -> int:
    """Rows per checksummed block: about :data:`BLOCK_BYTES` of row data, at least one row. A
    partial load reads and verifies a missed row's whole block, so a wide row's block holds few
    rows (width 64: 2 rows; width 128 and wider: one row, read without its key, which the
    checksum covers: :func:`pick_known`; until 2026-11-28 at least 8 rows, 4 KiB at width 128);
    the block table costs 4 bytes per block. Files keep the block size they were written with:
    one of another size loads whole."""
    return max(1, BLOCK_BYTES // max(4 * width, 1))


def n_blocks(n: int, block_rows: int) -> int:
    return -(-n // block_rows) if block_rows else 0


def file_bytes(n: int, width: int, block_rows: int | None = None) -> int:
    """Bytes of a file of ``n`` rows (format 2 with the default block size unless
    ``block_rows=0``, format 1)."""
    br = block_rows_for(width) if block_rows is None else block_rows
    return HEADER_BYTES + n * record_bytes(width) + 4 * n_blocks(n, br)


_P = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection of 64-bit words
_S = np.uint64(29)


@njit(cache=True, nogil=True, inline="always")
def _lanes(h, words, lo, hi):
    """Fold ``words[lo:hi]`` (``uint32``, taken in pairs as 64-bit words) into ``h`` over four
    independent lanes (multiply-xorshift each), so the CPU overlaps their multiplies: ~3x the
    speed of one serial chain. Every step is a bijection of the lane state, so a changed or
    moved word changes the lane and thus the result (up to the final 32-bit fold)."""
    h0 = h
    h1 = h ^ np.uint64(0x243F6A8885A308D3)
    h2 = h ^ np.uint64(0x13198A2E03707344)
    h3 = h ^ np.uint64(0xA4093822299F31D0)
    i = lo
    while i + 8 <= hi:
        h0 = (h0 ^ (np.uint64(words[i]) | (np.uint64(words[i + 1]) << np.uint64(32)))) * _P
        h1 = (h1 ^ (np.uint64(words[i + 2]) | (np.uint64(words[i + 3]) << np.uint64(32)))) * _P
        h2 = (h2 ^ (np.uint64(words[i + 4]) | (np.uint64(words[i + 5]) << np.uint64(32)))) * _P
        h3 = (h3 ^ (np.uint64(words[i + 6]) | (np.uint64(words[i + 7]) << np.uint64(32)))) * _P
        h0 ^= h0 >> _S
        h1 ^= h1 >> _S
        h2 ^= h2 >> _S
        h3 ^= h3 >> _S
        i += 8
    while i < hi:
        h0 = (h0 ^ np.uint64(words[i])) * _P
        h0 ^= h0 >> _S
        i += 1
    h = (h0 * _P) ^ h1
    h = (h * _P) ^ h2
    return (h * _P) ^ h3


@njit(cache=True, nogil=True)
def _block_sum(keys_u32, rows_u32, b, block_rows, width):
    """Checksum of block ``b`` (format 3): a 4-lane 64-bit multiply-xorshift hash of its key
    words then its row words, folded to 32 bits (detects flipped bits and misplaced data; not
    cryptographic). Format 2 used one serial chain over 32-bit words; its tables are checked as
    a whole (crc32) but not used for partial reads."""
    n = keys_u32.size // 2
    lo = b * block_rows
    return span_sum(keys_u32, lo, rows_u32, lo, min(n, lo + block_rows) - lo, b, width)


@njit(cache=True, nogil=True, inline="always")
def span_sum(keys_u32, klo, rows_u32, rlo, n, b, width):
    """Checksum of block ``b`` of ``n`` rows whose keys are keys ``klo..`` and whose rows are
    rows ``rlo..`` of the arrays given (the file's own, or staging copies of its blocks)."""
    h = np.uint64(0xCBF29CE484222325) ^ np.uint64(b)
    h = _lanes(h, keys_u32, 2 * klo, 2 * (klo + n))
    h = _lanes(h, rows_u32, rlo * width, (rlo + n) * width)
    return np.uint32((h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF))


@njit(cache=True, nogil=True)
def _block_sums(keys_u32, rows_u32, block_rows, width, out):
    for b in range(out.size):
        out[b] = _block_sum(keys_u32, rows_u32, b, block_rows, width)


def block_sums(keys: np.ndarray, rows: np.ndarray, block_rows: int) -> np.ndarray:
    """``uint32`` checksum of each block of ``block_rows`` rows (keys and row values)."""
    n, width = rows.shape
    out = np.empty(n_blocks(n, block_rows), dtype=np.uint32)
    _block_sums(
        np.ascontiguousarray(keys).view(np.uint32),
        np.ascontiguousarray(rows).reshape(-1).view(np.uint32),
        block_rows,
        width,
        out,
    )
    return out


def _crc(*parts: Any) -> int:
    c = 0
    for p in parts:
        c = zlib.crc32(p, c)
    return c


def encode_header(
    n: int, width: int, file_no: int, flags: int, index_crc: int, rows_crc: int, block_rows: int = 0, table_crc: int = 0
) -> bytes:
    """The 64-byte header (format 2; ``block_rows=0`` means no block table)."""
    head = _HEADER.pack(
        MAGIC, FORMAT_VERSION, width, n, file_no, flags, index_crc, rows_crc, block_rows, table_crc, b"\0" * 8
    )
    return head + struct.pack("<I", zlib.crc32(head))


@dataclass(frozen=True)
class Header:
    n: int
    width: int
    file_no: int
    flags: int
    index_crc: int
    rows_crc: int
    block_rows: int = 0  # 0: no block table (format 1)
    table_crc: int = 0
    version: int = FORMAT_VERSION

    @property
    def n_blocks(self) -> int:
        return n_blocks(self.n, self.block_rows)

    @property
    def table_offset(self) -> int:
        return HEADER_BYTES + self.n * record_bytes(self.width)

    @property
    def size(self) -> int:
        return file_bytes(self.n, self.width, self.block_rows)


def decode_header(buf: np.ndarray | bytes, path: str) -> Header:
    if len(buf) < HEADER_BYTES:
        raise CorruptFileError(f"{path}: truncated header ({len(buf)} of {HEADER_BYTES} bytes)")
    head = bytes(buf[:60])
    (crc,) = struct.unpack("<I", bytes(buf[60:64]))
    magic, version, width, n, file_no, flags, index_crc, rows_crc, block_rows, table_crc, _ = _HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptFileError(f"{path}: not an hpsray parameter file (magic {magic!r})")
    if zlib.crc32(head) != crc:
        raise CorruptFileError(f"{path}: header checksum mismatch")
    if version not in READABLE_VERSIONS:
        raise CorruptFileError(f"{path}: unsupported format version {version} (this build reads {READABLE_VERSIONS})")
    if version == 1:
        block_rows = table_crc = 0
    return Header(n, width, file_no, flags, index_crc, rows_crc, block_rows, table_crc, version)


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks in one request, so the file system lays it out as one
    contiguous extent (written piecewise by delayed allocation, a 9 MiB file came out as two
    distant extents on ext4, and cold whole-file reads paid a seek for each)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in FULL_ERRNOS:
            raise
        # EOPNOTSUPP / EINVAL (file systems without fallocate): plain writes still work


def write_tmp(
    directory: str,
    file_no: int,
    keys: np.ndarray,
    versions: np.ndarray,
    rows: np.ndarray,
    flags: int = 0,
    write: Writer = os.write,
    fsync: bool = True,
) -> tuple[str, int, np.ndarray]:
    """Write a parameter file under its temporary name and (unless ``fsync=False``, when the
    caller fsyncs it before the rename) fsync it.

    Returns ``(tmp_path, size, block table)``. On any error the temporary file is removed and the error
    re-raised (:class:`SSDFullError` for ENOSPC / EDQUOT / EFBIG).
    """
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    versions = np.ascontiguousarray(versions, dtype=np.uint64)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, width = rows.shape
    index_crc = _crc(keys, versions)
    rows_crc = _crc(rows)
    br = block_rows_for(width)
    table = block_sums(keys, rows, br)
    header = encode_header(n, width, file_no, flags, index_crc, rows_crc, br, _crc(table))
    tmp = os.path.join(directory, file_name(file_no) + TMP_SUFFIX)
    fd = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _preallocate(fd, file_bytes(n, width))
        write_all(fd, (header, keys, versions, rows, table), write)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        if fd is not None:
            os.close(fd)
            fd = None
        unlink_quiet(tmp)
        if e.errno in FULL_ERRNOS:
            after = "nothing of this write was recorded and the store stays readable"
            raise full_error(e, directory, file_bytes(n, width), f"writing {tmp}", after) from e
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return tmp, file_bytes(n, width), table


def _read_exact(fd: int, buf: np.ndarray, offset: int, path: str) -> None:
    mv = buf.data  # a memoryview of the array's bytes
    done = 0
    while done < buf.nbytes:
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k == 0:
            raise CorruptFileError(f"{path}: truncated (read {done} of {buf.nbytes} bytes at offset {offset})")
        done += k


@dataclass
class ParamFile:
    """A parameter file read into memory (arrays are views into one buffer)."""

    header: Header
    keys: np.ndarray
    versions: np.ndarray
    rows: np.ndarray | None  # None when only the index was read
    blocks: np.ndarray | None = None  # block checksums (format 2)


def _split(buf: np.ndarray, h: Header, with_rows: bool, blocks: np.ndarray | None = None) -> ParamFile:
    n, w = h.n, h.width
    keys = buf[HEADER_BYTES : HEADER_BYTES + 8 * n].view(np.uint64)
    versions = buf[HEADER_BYTES + 8 * n : HEADER_BYTES + 16 * n].view(np.uint64)
    rows = None
    if with_rows:
        rows = buf[HEADER_BYTES + 16 * n : HEADER_BYTES + 16 * n + 4 * n * w].view(np.float32).reshape(n, w)
        if h.block_rows:
            blocks = buf[h.table_offset : h.size].view(np.uint32)
    return ParamFile(h, keys, versions, rows, blocks)


def _check_table(table: np.ndarray, h: Header, path: str) -> None:
    if zlib.crc32(table.data) != h.table_crc:
        raise CorruptFileError(f"{path}: block table checksum mismatch")


def read_file(
    path: str, fd: int | None = None, expect_width: int | None = None, buf: np.ndarray | None = None
) -> ParamFile:
    """Read a whole parameter file with one read and verify all its checksums.

    ``buf`` (``uint8``, at least the file's size) is used instead of a new buffer; the
    returned arrays are then views into it.
    """
    own = fd is None
    f = os.open(path, os.O_RDONLY) if fd is None else fd
    try:
        size = os.fstat(f).st_size
        buf = np.empty(size, dtype=np.uint8) if buf is None or buf.size < size else buf[:size]
        _read_exact(f, buf, 0, path)
    finally:
        if own:
            os.close(f)
    h = decode_header(buf, path)
    check_shape(h, size, path, expect_width)
    n = h.n
    if zlib.crc32(buf[HEADER_BYTES : HEADER_BYTES + 16 * n].data) != h.index_crc:
        raise CorruptFileError(f"{path}: index checksum mismatch (keys/versions damaged: its {n} rows at stake)")
    if zlib.crc32(buf[HEADER_BYTES + 16 * n : h.table_offset].data) != h.rows_crc:
        raise CorruptFileError(f"{path}: rows checksum mismatch (row data damaged: its {n} rows at stake)")
    if h.block_rows:
        _check_table(buf[h.table_offset : h.size], h, path)
    return _split(buf, h, True)


def read_index(path: str, expect_width: int | None = None) -> ParamFile:
    """Read header, keys and versions of a parameter file (not the rows) and verify them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = np.empty(min(size, HEADER_BYTES), dtype=np.uint8)
        _read_exact(fd, head, 0, path)
        h = decode_header(head, path)
        check_shape(h, size, path, expect_width)
        buf = np.empty(HEADER_BYTES + 16 * h.n, dtype=np.uint8)
        buf[:HEADER_BYTES] = head
        _read_exact(fd, buf[HEADER_BYTES:], HEADER_BYTES, path)
        table = None
        if h.block_rows:
            table = np.empty(h.n_blocks, dtype=np.uint32)
            _read_exact(fd, table.view(np.uint8), h.table_offset, path)
    finally:
        os.close(fd)
    if zlib.crc32(buf[HEADER_BYTES:].data) != h.index_crc:
        raise CorruptFileError(f"{path}: index checksum mismatch (keys/versions damaged)")
    if table is not None:
        _check_table(table, h, path)
    return _split(buf, h, False, table)


def check_shape(h: Header, size: int, path: str, expect_width: int | None) -> None:
    """Raise :class:`CorruptFileError` unless the file has ``expect_width`` (if given) and its header's size."""
    if expect_width is not None and h.width != expect_width:
        raise CorruptFileError(f"{path}: rows of width {h.width}, the store has width {expect_width}")
    if size != h.size:
        raise CorruptFileError(f"{path}: size {size} bytes, header says {h.size} ({h.n} rows of width {h.width})")
