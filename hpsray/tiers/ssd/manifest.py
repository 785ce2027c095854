"""The SSD-PS manifest: an append-only, checksummed log of which parameter files are live.

Record framing: ``u32 payload length, u32 crc32(payload), payload``. Payloads:

* ``META``  (type 1): format version, row width — always the first record;
* ``EDIT``  (type 2): next file number, files added, files deleted — one atomic change of the
  live set (a dump adds its files; a compaction adds its outputs and deletes its inputs in the
  same record, so a crash never leaves both or neither).

Every append is fsynced before the caller acknowledges anything. After a crash the last record
may be torn; replay stops there and truncates it away. A damaged record *followed by* further
data is not a torn append, so replay refuses it with :class:`CorruptFileError` rather than
silently dropping acknowledged edits. When the log grows long it is rewritten as one snapshot
(temporary file, fsync, atomic rename, directory fsync).
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Iterable

from hpsray.errors import CorruptFileError, SSDError
from hpsray.fileio import FULL_ERRNOS, Writer, fsync_dir, full_error, write_all

__all__ = ["FORMAT_VERSION", "NAME", "Manifest", "write_manifest"]

NAME = "MANIFEST"
FORMAT_VERSION = 1
_META, _EDIT = 1, 2
_FRAME = struct.Struct("<II")
_META_BODY = struct.Struct("<BII")
_EDIT_HEAD = struct.Struct("<BQII")
_MAX_RECORD = 1 << 30


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _meta(width: int) -> bytes:
    return _frame(_META_BODY.pack(_META, FORMAT_VERSION, width))


def _edit(next_file_no: int, add: Iterable[int], delete: Iterable[int]) -> bytes:
    add, delete = list(add), list(delete)
    body = _EDIT_HEAD.pack(_EDIT, next_file_no, len(add), len(delete))
    body += struct.pack(f"<{len(add)}Q", *add) + struct.pack(f"<{len(delete)}Q", *delete)
    return _frame(body)


class Manifest:
    """The open manifest of one store directory; tracks the live file set it has logged.

    Use :meth:`open`; it creates the manifest of a new store or replays an existing one.
    """

    def __init__(
        self, directory: str, width: int, fd: int, live: set[int], next_file_no: int, records: int, write: Writer
    ) -> None:
        self.directory = directory
        self.path = os.path.join(directory, NAME)
        self.width = width
        self.live = live
        self.next_file_no = next_file_no
        self.records = records
        self.torn_bytes_dropped = 0
        self._fd: int | None = fd  # None once closed
        self._write = write
        self._lock = threading.Lock()  # appends come from dumps and from the compaction thread

    # -- opening -------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str, width: int | None, write: Writer = os.write) -> Manifest:
        """Open (or create, when absent) the manifest of ``directory``.

        ``width=None`` takes the width recorded in an existing manifest.
        """
        path = os.path.join(directory, NAME)
        if not os.path.exists(path):
            if width is None:
                raise FileNotFoundError(f"{path}: no SSD-PS store here (give width= to create one)")
            cls._write_snapshot(directory, width, set(), 1, write)
        with open(path, "rb") as f:
            data = f.read()
        rec_width, live, next_no, records, good_end = cls.replay(data, path)
        if width is not None and rec_width != width:
            raise ValueError(f"{directory}: store holds rows of width {rec_width}, asked for width {width}")
        fd = os.open(path, os.O_WRONLY)
        m = cls(directory, rec_width, fd, live, next_no, records, write)
        if good_end < len(data):  # torn tail of an append interrupted by a crash
            os.ftruncate(fd, good_end)
            os.fsync(fd)
            m.torn_bytes_dropped = len(data) - good_end
        os.lseek(fd, good_end, os.SEEK_SET)
        return m

    @staticmethod
    def replay(data: bytes, path: str) -> tuple[int, set[int], int, int, int]:
        """Replay a manifest's bytes (``path`` names it in errors): ``(width, live file numbers,
        next file number, records, bytes up to the last whole record)``."""
        live: set[int] = set()
        pos, width, next_no, records = 0, None, 1, 0
        while pos < len(data):
            if pos + 8 > len(data):
                break  # torn frame header at the tail
            length, crc = _FRAME.unpack_from(data, pos)
            end = pos + 8 + length
            payload = data[pos + 8 : end]
            if 0 < length <= _MAX_RECORD and end <= len(data) and zlib.crc32(payload) == crc:
                pass
            elif end >= len(data) or data.count(0, pos) == len(data) - pos:
                break  # the last append was torn (cut short, or its blocks never written)
            else:
                raise CorruptFileError(
                    f"{path}: record at offset {pos} fails its checksum and {len(data) - end} bytes "
                    "follow it, so it is not a torn append; refusing to guess the live file set"
                )
            kind = payload[0]
            if kind == _META:
                _, version, width = _META_BODY.unpack_from(payload)
                if version != FORMAT_VERSION:
                    raise CorruptFileError(f"{path}: manifest format {version}, this build reads {FORMAT_VERSION}")
            elif kind == _EDIT:
                if width is None:
                    raise CorruptFileError(f"{path}: edit record before the META record")
                _, nxt, n_add, n_del = _EDIT_HEAD.unpack_from(payload)
                ids = struct.unpack_from(f"<{n_add + n_del}Q", payload, _EDIT_HEAD.size)
                live.update(ids[:n_add])
                live.difference_update(ids[n_add:])
                next_no = max(next_no, nxt)
            else:
                raise CorruptFileError(f"{path}: unknown record type {kind} at offset {pos}")
            records += 1
            pos = end
        if width is None:
            raise CorruptFileError(f"{path}: no valid META record; the manifest is damaged")
        return width, live, next_no, records, pos

    @staticmethod
    def _write_snapshot(directory: str, width: int, live: set[int], next_file_no: int, write: Writer) -> None:
        path = os.path.join(directory, NAME)
        tmp = path + ".tmp"
        data = _meta(width) + _edit(next_file_no, sorted(live), ())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, (data,), write)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            os.unlink(tmp)
            if e.errno in FULL_ERRNOS:
                raise full_error(e, directory, len(data), f"writing {path}", "the old manifest stays in place") from e
            raise
        os.close(fd)
        os.rename(tmp, path)
        fsync_dir(directory)

    # -- appending -----------------------------------------------------------------------

    def append(self, add: Iterable[int] = (), delete: Iterable[int] = (), next_file_no: int | None = None) -> None:
        """Durably log one edit of the live set (fsynced when this returns).

        On failure the log is truncated back to its previous end, so the edit did not happen.
        """
        with self._lock:
            self._append(list(add), list(delete), next_file_no)

    def _append(self, add: list[int], delete: list[int], next_file_no: int | None) -> None:
        if next_file_no is not None:
            self.next_file_no = max(self.next_file_no, next_file_no)
        record = _edit(self.next_file_no, add, delete)
        fd = self._fd
        assert fd is not None, f"{self.path}: append to a closed manifest"
        start = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            write_all(fd, (record,), self._write)
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
                os.lseek(fd, start, os.SEEK_SET)
            except OSError as e2:
                raise SSDError(
                    f"{self.path}: append failed ({e}) and the torn record could not be removed ({e2}); "
                    "reopen the store to recover"
                ) from e
            if e.errno in FULL_ERRNOS:
                raise full_error(
                    e, self.directory, len(record), f"appending to {self.path}", "the edit was not recorded"
                ) from e
            raise
        self.live.update(add)
        self.live.difference_update(delete)
        self.records += 1

    def maybe_rewrite(self, max_records: int = 4096) -> bool:
        """Replace a long log by a snapshot of the live set; returns whether it did.

        A failure (e.g. a full disk) leaves the old log in place and is not an error.
        """
        with self._lock:
            return self._maybe_rewrite(max_records)

    def _maybe_rewrite(self, max_records: int) -> bool:
        if self._fd is None or self.records <= max(max_records, 2 * len(self.live) // 64 + 2):
            return False
        try:
            self._write_snapshot(self.directory, self.width, self.live, self.next_file_no, self._write)
        except OSError:
            return False
        os.close(self._fd)
        fd = self._fd = os.open(self.path, os.O_WRONLY)
        os.lseek(fd, 0, os.SEEK_END)
        self.records = 2
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def write_manifest(directory: str, width: int, live: set[int], next_file_no: int, write: Writer = os.write) -> None:
    """Write a fresh manifest naming ``live`` files (temporary file, fsync, atomic rename,
    directory fsync): a store opened on ``directory`` then holds exactly those files' rows."""
    Manifest._write_snapshot(directory, width, live, next_file_no, write)
