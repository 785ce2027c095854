"""SSD-PS parameter files: an immutable, checksummed block of rows.

Layout (little-endian)::

    offset  size         field
    0       8            magic  b"HPSPARAM"
    8       4            format version (1)
    12      4            width  (floats per row)
    16      8            n      (rows)
    24      8            file number (unique, increasing; also the file name)
    32      4            flags  (bit 0: written by compaction)
    36      4            crc32 of the index section (keys + versions)
    40      4            crc32 of the rows section
    44      16           reserved, zero
    60      4            crc32 of bytes 0..59
    64      8 n          keys      uint64[n]
    64+8n   8 n          versions  uint64[n]  (number of the dump file that produced the value)
    64+16n  4 n width    rows      float32[n, width]

A file is written once, under a temporary name, fsynced, then renamed; it is never modified.
The index section has its own checksum so that reopening a store reads only headers and
indexes, while a load (which reads the whole file anyway) verifies everything.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAGIC = b"HPSPARAM"
FORMAT_VERSION = 1
HEADER_BYTES = 64
FLAG_COMPACTED = 1
SUFFIX = ".hps"
TMP_SUFFIX = ".tmp"

_HEADER = struct.Struct("<8sIIQQIII16s")  # 60 bytes, followed by the header crc
assert _HEADER.size == 60


class SSDError(Exception):
    """Base class of SSD-PS errors."""


class CorruptFileError(SSDError):
    """A parameter file (or the manifest) fails its checks; the message names file and cause."""


class SSDFullError(SSDError, OSError):
    """The disk (or a file-size limit) refused a write; nothing of the failed operation was
    recorded and the store stays readable."""


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


def file_bytes(n: int, width: int) -> int:
    return HEADER_BYTES + n * record_bytes(width)


def _crc(*parts) -> int:
    c = 0
    for p in parts:
        c = zlib.crc32(p, c)
    return c


def encode_header(n: int, width: int, file_no: int, flags: int, index_crc: int, rows_crc: int) -> bytes:
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, width, n, file_no, flags, index_crc, rows_crc, b"\0" * 16)
    return head + struct.pack("<I", zlib.crc32(head))


@dataclass(frozen=True)
class Header:
    n: int
    width: int
    file_no: int
    flags: int
    index_crc: int
    rows_crc: int

    @property
    def size(self) -> int:
        return file_bytes(self.n, self.width)


def decode_header(buf, path: str) -> Header:
    if len(buf) < HEADER_BYTES:
        raise CorruptFileError(f"{path}: truncated header ({len(buf)} of {HEADER_BYTES} bytes)")
    head = bytes(buf[:60])
    (crc,) = struct.unpack("<I", bytes(buf[60:64]))
    magic, version, width, n, file_no, flags, index_crc, rows_crc, _ = _HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptFileError(f"{path}: not an hpsray parameter file (magic {magic!r})")
    if zlib.crc32(head) != crc:
        raise CorruptFileError(f"{path}: header checksum mismatch")
    if version != FORMAT_VERSION:
        raise CorruptFileError(f"{path}: unsupported format version {version} (this build reads {FORMAT_VERSION})")
    return Header(n, width, file_no, flags, index_crc, rows_crc)


Writer = Callable[[int, memoryview], int]


def _write_all(fd: int, parts, write: Writer) -> None:
    for part in parts:
        if isinstance(part, np.ndarray):
            part = part.reshape(-1).view(np.uint8)  # also fine for zero-width rows
        mv = memoryview(part).cast("B")
        while mv.nbytes:
            k = write(fd, mv)
            if k <= 0:  # a regular file only returns 0 when it cannot grow
                raise OSError(errno.ENOSPC, "short write")
            mv = mv[k:]


def write_tmp(
    directory: str,
    file_no: int,
    keys: np.ndarray,
    versions: np.ndarray,
    rows: np.ndarray,
    flags: int = 0,
    write: Writer = os.write,
    fsync: bool = True,
) -> tuple[str, int]:
    """Write a parameter file under its temporary name and (unless ``fsync=False``, when the
    caller fsyncs it before the rename) fsync it.

    Returns ``(tmp_path, size)``. On any error the temporary file is removed and the error
    re-raised (:class:`SSDFullError` for ENOSPC / EDQUOT / EFBIG).
    """
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    versions = np.ascontiguousarray(versions, dtype=np.uint64)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    n, width = rows.shape
    index_crc = _crc(keys, versions)
    rows_crc = _crc(rows)
    header = encode_header(n, width, file_no, flags, index_crc, rows_crc)
    tmp = os.path.join(directory, file_name(file_no) + TMP_SUFFIX)
    fd = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(fd, (header, keys, versions, rows), write)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        if fd is not None:
            os.close(fd)
            fd = None
        _unlink_quiet(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise SSDFullError(
                e.errno,
                f"SSD-PS: no space left writing {tmp} ({file_bytes(n, width)} bytes): {e.strerror}; "
                "nothing of this write was recorded and the store stays readable",
            ) from e
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return tmp, file_bytes(n, width)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable (a directory is fsynced like a file)."""
    fsync_path(directory)


def _read_exact(fd: int, buf: np.ndarray, offset: int, path: str) -> None:
    mv = memoryview(buf)
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


def _split(buf: np.ndarray, h: Header, with_rows: bool) -> ParamFile:
    n, w = h.n, h.width
    keys = buf[HEADER_BYTES : HEADER_BYTES + 8 * n].view(np.uint64)
    versions = buf[HEADER_BYTES + 8 * n : HEADER_BYTES + 16 * n].view(np.uint64)
    rows = None
    if with_rows:
        rows = buf[HEADER_BYTES + 16 * n : HEADER_BYTES + 16 * n + 4 * n * w].view(np.float32).reshape(n, w)
    return ParamFile(h, keys, versions, rows)


def read_file(path: str, fd: int | None = None, expect_width: int | None = None, buf: np.ndarray | None = None) -> ParamFile:
    """Read a whole parameter file with one read and verify all its checksums.

    ``buf`` (``uint8``, at least the file's size) is used instead of a new buffer; the
    returned arrays are then views into it.
    """
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = np.empty(size, dtype=np.uint8) if buf is None or buf.size < size else buf[:size]
        _read_exact(fd, buf, 0, path)
    finally:
        if own:
            os.close(fd)
    h = decode_header(buf, path)
    _check_shape(h, size, path, expect_width)
    n = h.n
    if zlib.crc32(buf[HEADER_BYTES : HEADER_BYTES + 16 * n]) != h.index_crc:
        raise CorruptFileError(f"{path}: index checksum mismatch (keys/versions damaged)")
    if zlib.crc32(buf[HEADER_BYTES + 16 * n :]) != h.rows_crc:
        raise CorruptFileError(f"{path}: rows checksum mismatch (row data damaged)")
    return _split(buf, h, True)


def read_index(path: str, expect_width: int | None = None) -> ParamFile:
    """Read header, keys and versions of a parameter file (not the rows) and verify them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = np.empty(min(size, HEADER_BYTES), dtype=np.uint8)
        _read_exact(fd, head, 0, path)
        h = decode_header(head, path)
        _check_shape(h, size, path, expect_width)
        buf = np.empty(HEADER_BYTES + 16 * h.n, dtype=np.uint8)
        buf[:HEADER_BYTES] = head
        _read_exact(fd, buf[HEADER_BYTES:], HEADER_BYTES, path)
    finally:
        os.close(fd)
    if zlib.crc32(buf[HEADER_BYTES:]) != h.index_crc:
        raise CorruptFileError(f"{path}: index checksum mismatch (keys/versions damaged)")
    return _split(buf, h, False)


def _check_shape(h: Header, size: int, path: str, expect_width: int | None) -> None:
    if expect_width is not None and h.width != expect_width:
        raise CorruptFileError(f"{path}: rows of width {h.width}, the store has width {expect_width}")
    if size != h.size:
        raise CorruptFileError(f"{path}: size {size} bytes, header says {h.size} ({h.n} rows of width {h.width})")
