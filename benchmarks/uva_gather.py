"""GPU only: the serving UVA gather (hpsray.serving.uva) against a NumPy gather + host-to-device copy.

    python benchmarks/uva_gather.py [ROWS] [GATHERED] [DIM]

Gathers GATHERED random rows of ROWS (dim DIM, at their natural stride) held in a host arena
registered with the device (hpsray.serving.uva.host_arena + device_view), straight into device
memory, and the same rows with ``host[rows]`` then ``cuda.to_device``; prints
rows/s of each (means of 10 repeats of the same row set) and their ratio. Needs numba.cuda and a GPU,
not Ray. docs/serving.md quotes its output.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from numba import cuda

from hpsray.serving.uva import device_view, gather_rows, host_arena


def main(n: int = 2_000_000, m: int = 200_000, dim: int = 16) -> None:
    host = host_arena(n, dim)
    host[:] = np.random.default_rng(0).random(host.shape, dtype=np.float32)
    src = device_view(host)
    rows = np.random.default_rng(1).integers(0, n, m).astype(np.int64)
    d_rows, d_dst = cuda.to_device(rows), cuda.to_device(np.arange(m, dtype=np.int64))
    out = cuda.device_array((m, dim), np.float32)
    gather_rows(src, d_rows, d_dst, out, dim)
    cuda.synchronize()
    assert np.array_equal(out.copy_to_host(), host[rows])
    t = time.perf_counter()
    for _ in range(10):
        gather_rows(src, d_rows, d_dst, out, dim)
    cuda.synchronize()
    uva = (time.perf_counter() - t) / 10
    t = time.perf_counter()
    for _ in range(10):
        cuda.to_device(host[rows])
    cuda.synchronize()
    copy = (time.perf_counter() - t) / 10
    print(
        f"UVA gather {m / uva / 1e6:.1f}M rows/s; numpy gather + copy {m / copy / 1e6:.1f}M rows/s; "
        f"ratio {copy / uva:.2f}"
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
