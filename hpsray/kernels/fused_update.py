"""A mini-batch's sparse backward and optimizer in one pass over its distinct rows (numba).

For each distinct row ``u`` of a mini-batch (arena slot ``rows[u]``): its gradient is the sum,
from zero in float32, of the pooled gradient's bags ``grad_bags[grad_offsets[u]:grad_offsets[u+1]]``
(the row's occurrences in bag order, as :func:`~hpsray.models.pooling._bag_grad` sums them), and
the optimizer, :func:`~hpsray.kernels.optim.apply_row_update`, updates the row in place in the
arena: no gather and no copy back. The rows are distinct, so each is written by one thread:
race-free, and the result is the same bits for any thread count.

:func:`fused_rows_update` is the CPU kernel (``prange`` over blocks of rows, one float32 scratch
gradient per block); :mod:`hpsray.kernels.cuda.fused_update` is its CUDA twin from the same
definition (one thread per row).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from hpsray.kernels.optim import apply_row_update

__all__ = ["fused_rows_update"]

# apply_row_update is inlined into this file's cached kernel: numba's cache keys on this file only,
# so a change of its math comes with a change here (docs/architecture.md: One definition of the math)


@njit(cache=True, parallel=True, nogil=True)
def fused_rows_update(arena, rows, grad_bags, grad_offsets, grad_pooled, kind, hp, blocks):
    """Apply one optimizer step (``kind``, float32 hyper-parameters ``hp``) in place to the
    ``arena`` rows ``rows`` (distinct slots) for their gradients summed from ``grad_pooled``;
    the rows are split into ``blocks`` runs (a few per thread), one scratch gradient each."""
    n = rows.size
    nnz = grad_bags.size
    dim = grad_pooled.shape[1]
    blocks = max(1, min(n, blocks))
    for c in prange(blocks):
        g = np.empty(dim, dtype=np.float32)
        for u in range(c * n // blocks, (c + 1) * n // blocks):
            for j in range(dim):
                g[j] = np.float32(0.0)
            end = grad_offsets[u + 1] if u + 1 < n else nnz
            for i in range(grad_offsets[u], end):
                b = grad_bags[i]
                for j in range(dim):
                    g[j] += grad_pooled[b, j]
            apply_row_update(kind, arena[rows[u]], g, dim, hp)
