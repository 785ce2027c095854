"""Durable file I/O helpers shared by the SSD-PS, checkpoints and exports (Ray-free, numpy only).

Contracts: :func:`fsync_path` / :func:`fsync_dir` make a file's data or a directory's renames
durable; :func:`write_all` writes every byte or raises (``ENOSPC`` for a file that cannot grow);
:func:`write_json` replaces a JSON file atomically (the caller fsyncs the directory);
:func:`replacing` fills a staging directory that then replaces a final one whole;
:func:`put_file` uploads a file to a ``pyarrow.fs`` store and checks the size stored;
:func:`free_bytes` is what an unprivileged writer may still use; :func:`full_error` turns a write
refused for want of space (:data:`FULL_ERRNOS`) into an :class:`~hpsray.errors.SSDFullError`
naming the directory, the bytes needed and the bytes free.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hpsray.errors import SSDFullError

__all__ = [
    "FULL_ERRNOS",
    "Writer",
    "drop_cache",
    "free_bytes",
    "put_file",
    "fsync_dir",
    "fsync_path",
    "full_error",
    "replacing",
    "unlink_quiet",
    "write_all",
    "write_json",
]

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for want of space

Writer = Callable[[int, memoryview], int]
"""An ``os.write``-compatible function (fault injection in tests)."""


def write_all(fd: int, parts: Iterable[Any], write: Writer = os.write) -> None:
    """Write every byte of ``parts`` (numpy arrays or bytes-like) to ``fd``, in order."""
    for part in parts:
        if isinstance(part, np.ndarray):
            part = part.reshape(-1).view(np.uint8)  # also fine for zero-width rows
        mv = memoryview(part).cast("B")
        while mv.nbytes:
            k = write(fd, mv)
            if k <= 0:  # a regular file only returns 0 when it cannot grow
                raise OSError(errno.ENOSPC, "short write")
            mv = mv[k:]


def fsync_path(path: str) -> None:
    """fsync the file (or directory) at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(paths: Iterable[str | os.PathLike]) -> None:
    """Evict files from the page cache (they must be clean: written and fsynced; pages mapped
    into a process stay)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable (a directory is fsynced like a file)."""
    fsync_path(directory)


def free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``directory`` (``None``:
    unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def full_error(e: OSError, directory: str, needed: int, what: str, after: str) -> SSDFullError:
    """The :class:`SSDFullError` for a write of ``needed`` bytes into ``directory`` that the disk
    refused (``e``); call it after the failed write was cleaned up, so that "free" is what the
    store can use. ``what`` says what was written, ``after`` what state it left."""
    free = free_bytes(directory)
    return SSDFullError(
        e.errno or errno.ENOSPC,
        f"SSD-PS {directory}: no space left: {what} needs {needed} bytes, "
        f"{'an unknown number of' if free is None else free} bytes are free "
        f"({os.strerror(e.errno or errno.ENOSPC)}); {after}",
        directory=directory,
        needed=needed,
        free=free,
    )


def unlink_quiet(path: str) -> None:
    """Remove ``path`` if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_json(path: str, obj: Any, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` under a temporary name, fsync it and rename it over
    ``path``: a reader sees the old file or the whole new one (the caller fsyncs the directory)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def replacing(final: str | os.PathLike, staging: str | os.PathLike) -> Iterator[Path]:
    """Yield ``staging`` to fill; when the block ends, ``staging`` replaces ``final`` (an earlier
    ``final`` removed first); when it raises, ``staging`` is removed and ``final`` left as it was."""
    final, staging = Path(final), Path(staging)
    try:
        yield staging
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


PUT_CHUNK = 8 << 20


def put_file(fs: Any, local: str | os.PathLike, path: str) -> int:
    """Upload ``local`` to ``path`` of the ``pyarrow.fs`` file system ``fs``; returns the bytes
    sent. The store must then hold exactly that many bytes at ``path``: otherwise the object is
    deleted and ``OSError`` raised (an S3 server that kept an ``aws-chunked`` body as it came,
    as moto does for an unsigned upload from a host without credentials, would hand back
    another file than the one written)."""
    sent = 0
    with open(local, "rb") as src, fs.open_output_stream(path) as out:
        while chunk := src.read(PUT_CHUNK):
            out.write(chunk)
            sent += len(chunk)
    stored = fs.get_file_info(path).size
    if stored != sent:
        fs.delete_file(path)
        raise OSError(
            f"{path}: the store holds {stored} bytes after an upload of {sent} (deleted): the store "
            "did not keep the bytes sent (an unsigned upload, e.g. credentials missing on this host?)"
        )
    return sent
