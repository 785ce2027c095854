"""Reused memory for the outputs of SSD-PS loads (Ray-free).

A load's output is usually as big as the bytes it reads, and a fresh allocation of it costs a
page fault and the kernel's zeroing per page as the rows land, more where freed memory went back
to a VM's host (a balloon's free-page reporting) and must be backed again: several times the cost
of the reads that fill it. :class:`OutputPool` keeps the memory of the last large output and
hands it out again once nothing references it any more (the caller dropped the output and every
view of it), so loads whose caller lets go of each output before asking for the next write into
memory that is already mapped. Contract: an output is never handed out while any array, view or
buffer export of it lives; the pool holds one buffer, no bigger than the largest output it
handed out, and frees a kept buffer too small for the next output before allocating that one,
so a process's peak memory is what it would be without the pool.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["MIN_BYTES", "OutputPool"]

MIN_BYTES = 1 << 20  # smaller outputs are allocated as usual (the faults are few)


class OutputPool:
    """A float32 buffer for load outputs, reused once its caller lets go of it."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self._lock = threading.Lock()

    def rows(self, n: int, width: int) -> np.ndarray:
        """An uninitialised C-contiguous ``float32[n, width]``: a view of the kept buffer when no
        one references it and it is big enough, else newly allocated (and kept instead)."""
        need = n * width
        if 4 * need < MIN_BYTES:
            return np.empty((n, width), np.float32)
        with self._lock:
            # 2: the attribute's reference and getrefcount's argument; any output or view adds one
            if self._buf is not None and self._buf.size >= need and sys.getrefcount(self._buf) == 2:
                return self._buf[:need].reshape(n, width)
            self._buf = None  # freed now if no one holds it, before the new one is allocated
            buf = np.empty(need, np.float32)
            self._buf = buf
            return buf.reshape(n, width)

    def clear(self) -> None:
        """Drop the kept buffer (its memory is freed once no output references it)."""
        with self._lock:
            self._buf = None
