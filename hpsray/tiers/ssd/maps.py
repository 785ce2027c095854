"""Read-only mappings of the live parameter files, kept across partial loads.

A partial load copies the blocks the page cache holds straight from a mapping of their file
(:func:`hpsray.blockio.copy_mapped`: one ``mincore`` per cluster of nearby ranges instead of a
``preadv2`` per range); blocks not resident are read as before. Parameter files never change
once written, so a mapping never goes stale; a file is mapped the first time a partial load
reads it, and its mapping is dropped once the file has left the live set (compaction retired
it) and no load is running, since a mapping keeps an unlinked file's disk space until then.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Container

import numpy as np

__all__ = ["MAX_MAPPED_FILES", "FileMaps"]

MAX_MAPPED_FILES = 4096  # files mapped at once at most (the kernel's limit is ~65k mappings a process)


class FileMaps:
    """Mappings of parameter files by file number; loads bracket their use with :meth:`begin`
    and :meth:`end` (several may run at once)."""

    def __init__(self, limit: int = MAX_MAPPED_FILES) -> None:
        self.limit = limit
        self._maps: dict[int, tuple[mmap.mmap, int, int]] = {}  # file number -> (mapping, address, length)
        self._lock = threading.Lock()
        self._active = 0

    def begin(self, live: Container[int]) -> None:
        """A load starts; when none other runs, first drop the mappings of files not in ``live``."""
        with self._lock:
            if self._active == 0:
                for no in [no for no in self._maps if no not in live]:
                    self._maps.pop(no)[0].close()
            self._active += 1

    def end(self) -> None:
        """The load that called :meth:`begin` is done with every address it was given."""
        with self._lock:
            self._active -= 1

    def addresses(self, nos: list[int], fds: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(address, length)`` of the mapping of each file ``nos[i]`` (open as ``fds[i]``),
        mapped now where it is not yet; address 0 where it cannot be (an empty file, the limit
        reached). Valid until the caller's :meth:`end`."""
        base = np.zeros(len(nos), np.uint64)
        size = np.zeros(len(nos), np.int64)
        with self._lock:
            for i, (no, fd) in enumerate(zip(nos, fds)):
                got = self._maps.get(no)
                if got is None and len(self._maps) < self.limit:
                    got = self._map(fd)
                    if got is not None:
                        self._maps[no] = got
                if got is not None:
                    base[i], size[i] = got[1], got[2]
        return base, size

    @staticmethod
    def _map(fd: int) -> tuple[mmap.mmap, int, int] | None:
        length = os.fstat(fd).st_size
        if length == 0:
            return None
        m = mmap.mmap(fd, length, prot=mmap.PROT_READ)
        if hasattr(m, "madvise"):
            m.madvise(mmap.MADV_RANDOM)  # a page evicted after the check: fault in that page alone
        view = np.frombuffer(m, np.uint8)
        address = int(view.ctypes.data)
        del view  # no export left, so the mapping can be closed
        return m, address, length

    def close(self) -> None:
        """Drop every mapping (no load may be running)."""
        with self._lock:
            for m, _, _ in self._maps.values():
                m.close()
            self._maps.clear()
