"""GPU gathers of rows at their natural stride, from registered host memory (UVA zero-copy) or device memory.

The warm rows of a GPU replica stay in host memory: an arena allocated once (:func:`host_arena`,
anonymous memory with transparent huge pages asked for, ``MADV_HUGEPAGE``, where the kernel gives
them), the very array the host-side cache writes rows into, then registered with the device
(:func:`device_view`: ``cudaHostRegister`` with the *mapped* flag through CuPy, or numba's
``mempin`` without CuPy), so kernels read it in place over the bus, no staging copy. Rows stay
at their natural stride, ``dim * 4`` bytes (no padding: dim 20 takes 80 bytes, not 128).

Alignment is a property of the *access*, as GDRec does it (:func:`gather_rows`): a row is read
by a group of ``group_lanes(dim)`` lanes (the power of two at or above ``dim``, at most a warp of
32), each step of the group reading one window of ``group`` words aligned to its own size, so
every load a group issues lies inside one aligned 128-byte segment and the lanes of a warp load
neighbouring words; a lane keeps only the words of its row. A row of ``dim <= group`` words
spans at most two windows, a wider row ``ceil(dim / 32) + 1`` at most. The same kernel gathers
the device tier's rows (device to device). :func:`gather_rows_host` is its CPU twin (a NumPy
gather): the simulator tests (``NUMBA_ENABLE_CUDASIM=1``) check the kernel against it.
"""

from __future__ import annotations

import gc
import mmap
import weakref
from typing import Any

import numpy as np

from hpsray.kernels.cuda.common import config, cuda

__all__ = [
    "HUGE_PAGE_BYTES",
    "WARP",
    "device_view",
    "gather_rows",
    "gather_rows_host",
    "group_lanes",
    "host_arena",
    "release_view",
    "row_bytes_natural",
    "windows_per_row",
]

WARP = 32
TPB = 128  # threads per block: 4 warps
HUGE_PAGE_BYTES = 2 << 20
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2


def row_bytes_natural(dim: int) -> int:
    """Bytes of a row of ``dim`` float32 weights, unpadded."""
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    return 4 * dim


def group_lanes(dim: int) -> int:
    """Lanes reading one row: the power of two at or above ``dim``, at most a warp."""
    return min(WARP, 1 << max(0, int(dim) - 1).bit_length())


def windows_per_row(dim: int, row: np.ndarray) -> np.ndarray:
    """Aligned windows (of :func:`group_lanes` words) a group reads for each row number of ``row``."""
    g = group_lanes(dim)
    first = np.asarray(row, np.int64) * dim
    return (first + dim - 1) // g - first // g + 1


def host_arena(n: int, dim: int) -> np.ndarray:
    """``float32[n, dim]`` of zeros in anonymous host memory, huge pages asked for (``MADV_HUGEPAGE``;
    the kernel may or may not give them); the array keeps the mapping alive."""
    nbytes = max(1, n) * row_bytes_natural(dim)
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # transparent huge pages off: ordinary pages
            pass
    return np.frombuffer(buf, np.float32, count=max(1, n) * dim).reshape(max(1, n), dim)


_REGISTERED: dict[int, weakref.finalize] = {}  # device address of a device_view -> its unregistering


def device_view(arena: np.ndarray) -> Any:
    """``arena`` registered with the current CUDA device (pinned, mapped) and seen from it: a CuPy
    array over the device pointer of the same memory (numba's mapped device array without CuPy);
    writes on either side are seen by the other. In numba's CUDA simulator, the arena itself.
    :func:`release_view` unregisters it."""
    if config.ENABLE_CUDASIM:
        return arena
    if not arena.flags.c_contiguous:
        raise ValueError("the arena must be C-contiguous")
    try:
        import cupy
    except ImportError:
        from numba.cuda.cudadrv import devicearray

        pinned = cuda.current_context().mempin(arena, arena.ctypes.data, arena.nbytes, mapped=True)
        return devicearray.DeviceNDArray(arena.shape, arena.strides, arena.dtype, gpu_data=pinned)
    ptr = arena.ctypes.data
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    try:
        cupy.cuda.runtime.hostRegister(ptr, arena.nbytes, flags)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if "AlreadyRegistered" not in str(e):
            raise
        gc.collect()  # an arena unreachable but not yet collected still holds its registration
        cupy.cuda.runtime.hostRegister(ptr, arena.nbytes, flags)
    try:
        get = getattr(cupy.cuda.runtime, "hostGetDevicePointer", None)
        dptr = get(ptr, 0) if get is not None else ptr  # under UVA a registered page's device address is its own
        mem = cupy.cuda.UnownedMemory(dptr, arena.nbytes, arena)
        view = cupy.ndarray(arena.shape, cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    except BaseException:
        cupy.cuda.runtime.hostUnregister(ptr)
        raise
    # unregistered by release_view, or else when the arena goes (its pages may be mapped again);
    # cupy arrays take no attributes, so release_view finds the finaliser by the view's address
    _REGISTERED[int(view.data.ptr)] = weakref.finalize(arena, _unregister, ptr)
    return view


def _unregister(ptr: int) -> None:
    import cupy

    try:
        cupy.cuda.runtime.hostUnregister(ptr)
    except cupy.cuda.runtime.CUDARuntimeError:  # the context is gone (interpreter exit): nothing to free
        pass


def release_view(view: Any) -> None:
    """Unregister the host memory behind a :func:`device_view` (no-op for the others)."""
    address = getattr(getattr(view, "data", None), "ptr", None)
    finaliser = _REGISTERED.pop(int(address), None) if address is not None else None
    if finaliser is not None:
        finaliser()  # runs once: the arena's own end then does nothing


@cuda.jit
def _gather_kernel(flat, dim, group, src_rows, dst_rows, out):
    # flat: float32[n * dim], row r at words r*dim .. r*dim+dim-1; out: float32[m, dim]
    tid = cuda.grid(1)
    lane = tid % group
    g = tid // group
    n_groups = cuda.gridsize(1) // group
    m = src_rows.size
    r = g
    while r < m:
        if src_rows[r] < 0:  # a row this source does not hold: left as it is
            r += n_groups
            continue
        first = src_rows[r] * dim
        end = first + dim
        d = dst_rows[r]
        w = (first // group) * group + lane  # the row's first aligned window
        while w < end:
            if w >= first:
                out[d, w - first] = flat[w]
            w += group
        r += n_groups


def gather_rows(src: Any, src_rows: Any, dst_rows: Any, out: Any, dim: int, stream: Any = None) -> None:
    """``out[dst_rows[i], :] = src[src_rows[i], :]`` on the device where ``src_rows[i] >= 0``
    (see the module docstring); rows with ``src_rows[i] < 0`` are left as they are.

    ``src``: float32[n, dim], C-contiguous, rows at their natural stride (a :func:`device_view`
    of host memory, or device memory); ``src_rows``/``dst_rows``: int64 device arrays of equal
    length; ``out``: device float32[m, dim].
    """
    m = int(src_rows.shape[0])
    if not m:
        return
    if len(src.shape) != 2 or int(src.shape[1]) != dim or int(out.shape[1]) != dim:
        raise ValueError(f"src and out must be float32[*, {dim}] (rows at their natural stride), got {src.shape}")
    group = group_lanes(dim)
    flat = src.reshape(int(src.shape[0]) * dim)
    threads = m * group
    blocks = max(1, min(-(-threads // TPB), 4096))
    launch = _gather_kernel[blocks, TPB] if stream is None else _gather_kernel[blocks, TPB, stream]
    launch(flat, dim, group, src_rows, dst_rows, out)  # a registered host src is read in place (zero-copy)


def gather_rows_host(src: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray, out: np.ndarray) -> None:
    """The CPU twin of :func:`gather_rows`: ``out[dst_rows] = src[src_rows]`` where ``src_rows >= 0``
    (fixed sizes, no mask: the twin of a device array module's lines)."""
    held = (src_rows >= 0)[:, None]
    out[dst_rows] = np.where(held, src[np.maximum(src_rows, 0)], out[dst_rows])
