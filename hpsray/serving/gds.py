"""SSD rows straight into device memory: kvikio (GPUDirect Storage) where present, else a host copy.

:class:`DeviceRowReader` reads rows of a :class:`~hpsray.serving.pointstore.PointStore` into rows
of a device array. With kvikio, each row is one ``CuFile.pread`` into its device row (GDS DMA
where the file system and driver allow it; kvikio's own POSIX fallback, through its bounce
buffers, where they do not). Without kvikio, the rows are copied from the point store's mapped
file (:meth:`~hpsray.serving.pointstore.PointStore.read_into`) into a pinned host buffer and
scattered to their device rows by one copy and one kernel (``path`` says ``host``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from numba import cuda

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


def scatter_rows(src, dst_rows, out, dim: int) -> None:
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
        self._file = None
        if self.use_kvikio:
            import kvikio

            self._file = kvikio.CuFile(os.path.join(store.directory, "rows.f32"), "r")

    @property
    def path(self) -> str:
        return "kvikio" if self.use_kvikio else "host"

    def read(self, file_rows: np.ndarray, out: Any, out_rows: np.ndarray, want_host: bool = False) -> np.ndarray | None:
        """``out[out_rows[i]] = row file_rows[i]`` with ``out`` a device float32[m, dim].

        ``want_host``: also return the rows read on the host, ``float32[n, dim]`` in the order of
        ``file_rows`` (for the host tier's admission): the staging buffer on the host path; on the
        kvikio path the rows are packed on the device by one kernel and copied back in one copy.
        """
        if not file_rows.size:
            return np.empty((0, self.store.dim), np.float32) if want_host else None
        dim, nbytes = self.store.dim, 4 * self.store.dim
        if self._file is not None:
            order = np.argsort(file_rows, kind="stable")
            futures = [
                self._file.pread(out[int(d)], nbytes, int(f) * self.store.stride)
                for f, d in zip(file_rows[order], out_rows[order])
            ]
            for fut in futures:
                if fut.get() != nbytes:
                    raise OSError(f"{self.store.directory}/rows.f32: short read through kvikio")
            if not want_host:
                return None
            from hpsray.serving.device_cache import copy_rows

            packed = cuda.device_array((file_rows.size, dim), np.float32)
            idx = np.ascontiguousarray(out_rows, np.int64)
            copy_rows(out, cuda.to_device(idx), packed, cuda.to_device(np.arange(idx.size, dtype=np.int64)), dim)
            return packed.copy_to_host()
        staging = cuda.pinned_array((file_rows.size, dim), np.float32)
        self.store.read_into(file_rows, staging, np.arange(file_rows.size, dtype=np.int64))
        scatter_rows(cuda.to_device(staging), cuda.to_device(np.ascontiguousarray(out_rows, np.int64)), out, dim)
        return staging if want_host else None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
