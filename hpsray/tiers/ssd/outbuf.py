"""Reused memory for the outputs of SSD-PS loads (Ray-free).

A load's output is usually as big as the bytes it reads, and a fresh allocation of it costs a
page fault and the kernel's zeroing per page as the rows land, more where freed memory went back
to a VM's host (a balloon's free-page reporting) and must be backed again: several times the cost
of the reads that fill it. :class:`OutputPool` keeps the memory of the last :data:`KEEP` large
outputs, and hands it out again once nothing references it any more (the caller dropped the
output and every view of it), so a steady run of loads writes into memory that is already
mapped. Contract: the store holds at most ``KEEP`` such buffers beyond what callers hold; an
output is never handed out while any array, view or buffer export of it lives.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["KEEP", "MIN_BYTES", "OutputPool"]

KEEP = 2  # buffers kept: a caller holding one output while it asks for the next still reuses
MIN_BYTES = 1 << 20  # smaller outputs are allocated as usual (the faults are few)


class OutputPool:
    """Float32 buffers for load outputs, reused once their callers let go of them."""

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()

    def rows(self, n: int, width: int) -> np.ndarray:
        """An uninitialised C-contiguous ``float32[n, width]``: a view of a kept buffer that no
        one references and is big enough, or newly allocated (and kept, dropping the oldest)."""
        need = n * width
        if 4 * need < MIN_BYTES:
            return np.empty((n, width), np.float32)
        with self._lock:
            for i in range(len(self._bufs)):
                # 2: the list's reference and getrefcount's argument; any output or view adds one
                if self._bufs[i].size >= need and sys.getrefcount(self._bufs[i]) == 2:
                    buf = self._bufs.pop(i)
                    self._bufs.append(buf)  # most recently used last
                    return buf[:need].reshape(n, width)
            buf = np.empty(need, np.float32)
            self._bufs.append(buf)
            del self._bufs[:-KEEP]
            return buf.reshape(n, width)

    def clear(self) -> None:
        """Drop the kept buffers (their memory is freed once no output references it)."""
        with self._lock:
            self._bufs.clear()
