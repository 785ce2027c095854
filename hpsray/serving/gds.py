"""SSD rows straight into device memory: kvikio (GPUDirect Storage) where present, else parallel ``preadv``.

:class:`DeviceRowReader` reads rows of a :class:`~hpsray.serving.pointstore.PointStore` into rows
of a device array, a batch at a time, in the merged ranges of
:class:`~hpsray.serving.blockread.BlockReader` (rows of one block, or of neighbouring blocks, in
one read). With kvikio, each range is one ``CuFile.pread`` straight into a device staging buffer
(GDS DMA where the file system and driver allow it; kvikio's own POSIX path, through its bounce
buffers, where not) and the rows are picked out of it on the device. Without kvikio the ranges
are read by a thread pool of ``preadv`` calls whose I/O vectors put each row into its row of a
pinned host buffer, which goes to the device in one copy and is scattered to the output rows by
one kernel (``path`` says ``host``). No path reads one row per system call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpsray.kernels.cuda.common import cuda
from hpsray.serving.pointstore import PointStore

__all__ = ["DeviceRowReader", "kvikio_available"]


def kvikio_available() -> bool:
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


@cuda.jit
def _scatter_kernel(src, dst_rows, out, dim):
    i = cuda.grid(1)
    if i < dst_rows.size * dim:
        r = i // dim
        out[dst_rows[r], i % dim] = src[r, i % dim]


def scatter_rows(src: Any, dst_rows: Any, out: Any, dim: int) -> None:
    """``out[dst_rows[i]] = src[i]`` on the device (``src``: device float32[m, dim])."""
    m = int(dst_rows.shape[0])
    if m:
        threads = m * dim
        _scatter_kernel[-(-threads // 256), 256](src, dst_rows, out, dim)


class DeviceRowReader:
    """Reads point-store rows into device rows (see the module docstring)."""

    def __init__(self, store: PointStore, use_kvikio: bool | None = None) -> None:
        self.store = store
        self.use_kvikio = kvikio_available() if use_kvikio is None else use_kvikio
        self.blocks = store.block_reader()

    @property
    def path(self) -> str:
        return "kvikio" if self.use_kvikio else "host"

    @property
    def reads_per_row(self) -> float:
        """Reads (system calls or cuFile reads) per row read so far."""
        return self.blocks.reads_per_row

    def read(self, file_rows: np.ndarray, out: Any, out_rows: np.ndarray, want_host: bool = False) -> np.ndarray | None:
        """``out[out_rows[i]] = row file_rows[i]`` with ``out`` a device float32[m, dim]; ``file_rows`` distinct.

        ``want_host``: also return the rows read on the host, ``float32[n, dim]`` in the order of
        ``file_rows`` (for the host tier's admission): the pinned buffer on the host path; on the
        kvikio path the rows come back in one copy.
        """
        dim = self.store.dim
        if not file_rows.size:
            return np.empty((0, dim), np.float32) if want_host else None
        dst = cuda.to_device(np.ascontiguousarray(out_rows, np.int64))
        if self.use_kvikio:
            import cupy

            rows = self.blocks.read_device(file_rows, cupy)
            scatter_rows(rows, dst, out, dim)
            return cupy.asnumpy(rows) if want_host else None
        staging = cuda.pinned_array((file_rows.size, dim), np.float32)
        self.blocks.read_into(file_rows, staging, np.arange(file_rows.size, dtype=np.int64))
        scatter_rows(cuda.to_device(staging), dst, out, dim)
        return staging if want_host else None

    def close(self) -> None:
        self.blocks.close()
