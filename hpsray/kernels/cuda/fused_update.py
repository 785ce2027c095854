"""The CUDA twin of :func:`hpsray.kernels.fused_update.fused_rows_update`: one thread per
distinct row sums the row's bags of the pooled gradient in bag order from zero and applies
:func:`~hpsray.kernels.optim.apply_row_update` to the row in place in the arena. The same float
operations in the same order, so the simulator gives the CPU kernel's bits; on a GPU only the
optimizer's FMA contraction may differ in the last bits, as in the table's other kernels."""

from __future__ import annotations

import numpy as np

from hpsray.kernels.cuda.common import cuda
from hpsray.kernels.optim import apply_row_update

__all__ = ["MAX_DIM", "k_fused_rows_update"]

MAX_DIM = 256  # the per-thread gradient's length (a compile-time constant of the kernel)


@cuda.jit
def k_fused_rows_update(arena, rows, grad_bags, grad_offsets, grad_pooled, kind, hp):
    """Row ``u = grid(1)`` of ``rows``: see the module docstring (``dim <= MAX_DIM``)."""
    u = cuda.grid(1)
    n = rows.size
    if u < n:
        dim = grad_pooled.shape[1]
        g = cuda.local.array(MAX_DIM, np.float32)
        for j in range(dim):
            g[j] = np.float32(0.0)
        end = grad_offsets[u + 1] if u + 1 < n else grad_bags.size
        for i in range(grad_offsets[u], end):
            b = grad_bags[i]
            for j in range(dim):
                g[j] += grad_pooled[b, j]
        apply_row_update(kind, arena[rows[u]], g, dim, hp)
