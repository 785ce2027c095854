"""GPU gathers of rows from pinned host memory mapped into the device (UVA zero-copy).

The hot rows of a GPU replica stay in host memory, pinned and mapped into the device's address
space (:func:`mapped_rows`); a numba.cuda kernel (:func:`gather_rows`) reads a batch's rows
straight over the bus into device memory, no staging copy. Rows are laid out with the stride of
:func:`hpsray.serving.layout.row_stride` (a power of two up to 128 bytes, a multiple of 128
beyond), so each row lies in whole aligned 128-byte segments: a warp of 32 lanes reads one
segment per step, i.e. ``32 // stride_words`` rows of up to 32 words at once, or one wider row in
``stride_words // 32`` segments (GDRec's coalescing and aligning). Works under numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``), which is how the tests check it without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from hpsray.serving.layout import row_stride

__all__ = ["WARP", "gather_rows", "host_view", "mapped_rows", "stride_words"]

WARP = 32
TPB = 128  # threads per block: 4 warps


def stride_words(dim: int) -> int:
    """float32 words per stored row of ``dim`` weights (see :func:`row_stride`)."""
    return row_stride(dim) // 4


def mapped_rows(n: int, dim: int) -> np.ndarray:
    """``float32[n, stride_words(dim)]`` in pinned host memory mapped into the current device."""
    return cuda.mapped_array((n, stride_words(dim)), dtype=np.float32)


def host_view(mapped: Any) -> np.ndarray:
    """The host side of :func:`mapped_rows` as a plain ``np.ndarray`` (for numba's CPU code, e.g.
    a :class:`~hpsray.serving.cache.HotCache` writing rows in): a view of the same memory on a
    GPU (a mapped array is an ``ndarray`` subclass), the array it wraps in the CUDA simulator."""
    return np.ndarray.view(mapped, np.ndarray) if isinstance(mapped, np.ndarray) else mapped._ary


@cuda.jit
def _gather_kernel(src, stride, src_rows, dst_rows, out, dim):
    # src: float32[n_src, stride] (row-major: row r's words are contiguous); out: float32[m, dim]
    tid = cuda.grid(1)
    n_threads = cuda.gridsize(1)
    warp = tid // WARP
    lane = tid % WARP
    n_warps = n_threads // WARP
    m = src_rows.size
    if stride <= WARP:
        per_warp = WARP // stride  # rows one 128-byte segment holds
        sub = lane // stride
        word = lane % stride
        r = warp * per_warp + sub
        while r < m:
            v = src[src_rows[r], word]  # one aligned 128-byte segment per warp step
            if word < dim:
                out[dst_rows[r], word] = v
            r += n_warps * per_warp
    else:
        r = warp
        while r < m:
            row = src_rows[r]
            for seg in range(stride // WARP):
                word = seg * WARP + lane
                v = src[row, word]
                if word < dim:
                    out[dst_rows[r], word] = v
            r += n_warps


def gather_rows(src, src_rows, dst_rows, out, dim: int, stream=None) -> None:
    """``out[dst_rows[i], :dim] = src[src_rows[i], :dim]`` on the device.

    ``src``: float32[n, stride_words(dim)] (mapped host rows or a device array; C-contiguous);
    ``src_rows``/``dst_rows``: int64 device (or host) arrays of equal length; ``out``: a device
    float32[m, dim].
    """
    m = int(src_rows.shape[0])
    if not m:
        return
    stride = int(src.shape[1])
    if stride != stride_words(dim):
        raise ValueError(f"src rows have {stride} words; dim {dim} needs the aligned stride {stride_words(dim)}")
    per_warp = WARP // stride if stride <= WARP else 1
    warps = -(-m // per_warp)
    blocks = max(1, min(-(-warps * WARP // TPB), 4096))
    launch = _gather_kernel[blocks, TPB] if stream is None else _gather_kernel[blocks, TPB, stream]
    launch(src, stride, src_rows, dst_rows, out, dim)  # a mapped src is read in place (zero-copy)
