"""The sparse backward and optimizer of a mini-batch as one torch op on the arena.

``torch.ops.hpsray.fused_sparse_update(arena, rows, grad_bags, grad_offsets, grad_pooled, kind,
hp)`` (defined with ``torch.library``; it mutates ``arena`` in place and returns nothing):
for each distinct slot ``rows[u]``, the row's gradient is summed from ``grad_pooled``
(``float32[n_bags, dim]``) over its bags ``grad_bags[grad_offsets[u]:grad_offsets[u + 1]]`` in
bag order from zero, and optimizer ``kind`` (:mod:`hpsray.kernels.optim`, float32
hyper-parameters ``hp``) updates the row where it lies: no gather, no copy back. The arguments
are a :class:`~hpsray.training.layout.MiniBatchIndex`'s (``rows`` int64, the others int32).

CPU: :func:`hpsray.kernels.fused_update.fused_rows_update` (numba, threads over the rows), bit
for bit the unfused torch path and the reference trainer for every optimizer (the same
:func:`~hpsray.kernels.optim.apply_row_update`). CUDA:
:func:`hpsray.kernels.cuda.fused_update.k_fused_rows_update` on the current torch stream,
for ``dim <= MAX_DIM``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

import hpsray.kernels.fused_update as cpu_kernels  # looked up per call (tests count numba calls)

__all__ = ["OP", "fused_sparse_update", "warm_fused_update"]


OP = "hpsray::fused_sparse_update"
# Registered with torch.library's low-level verbs, not ``torch.library.custom_op``: a custom op's
# kernels are wrapped to keep TorchDynamo out, and that wrapper imports TorchDynamo on the first
# call (~1 s of CPU in each trainer's start, docs/benchmarks.md: The start). The op takes no
# part in autograd: its arguments are gradients and an arena no graph records.


def _fused_sparse_update_cpu(
    arena: torch.Tensor,
    rows: torch.Tensor,
    grad_bags: torch.Tensor,
    grad_offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    kind: int,
    hp: list[float],
) -> None:
    _check(arena, rows, grad_bags, grad_offsets, grad_pooled)
    cpu_kernels.fused_rows_update(
        arena.numpy(),
        rows.numpy(),
        grad_bags.numpy(),
        grad_offsets.numpy(),
        grad_pooled.numpy(),
        kind,
        np.asarray(hp, dtype=np.float32),
        8 * numba.get_num_threads(),
    )


# the schema from the CPU implementation's signature, as ``custom_op`` derives it
torch.library.define(OP, torch.library.infer_schema(_fused_sparse_update_cpu, mutates_args=("arena",)))
torch.library.impl(OP, "cpu", _fused_sparse_update_cpu)


def fused_sparse_update(
    arena: torch.Tensor,
    rows: torch.Tensor,
    grad_bags: torch.Tensor,
    grad_offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    kind: int,
    hp: list[float],
) -> None:
    """See the module docstring: ``torch.ops.hpsray.fused_sparse_update`` on these arguments."""
    torch.ops.hpsray.fused_sparse_update(arena, rows, grad_bags, grad_offsets, grad_pooled, kind, hp)


@torch.library.impl(OP, "cuda")
def _fused_sparse_update_cuda(
    arena: torch.Tensor,
    rows: torch.Tensor,
    grad_bags: torch.Tensor,
    grad_offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    kind: int,
    hp: list[float],
) -> None:  # pragma: no cover - needs a GPU (the kernel itself runs under the simulator in tests)
    from hpsray.kernels.cuda.common import cuda
    from hpsray.kernels.cuda.fused_update import MAX_DIM, k_fused_rows_update

    _check(arena, rows, grad_bags, grad_offsets, grad_pooled)
    if grad_pooled.shape[1] > MAX_DIM:
        raise ValueError(f"fused_sparse_update on CUDA: dim {grad_pooled.shape[1]} > {MAX_DIM}")
    n = rows.shape[0]
    if n == 0:
        return
    stream = cuda.external_stream(torch.cuda.current_stream(arena.device).cuda_stream)
    hp_dev = torch.tensor(hp, dtype=torch.float32).to(arena.device, non_blocking=True)
    args = [cuda.as_cuda_array(t) for t in (arena, rows, grad_bags, grad_offsets, grad_pooled)]
    k_fused_rows_update[(n + 127) // 128, 128, stream](*args, kind, cuda.as_cuda_array(hp_dev))


@torch.library.register_fake(OP)
def _(arena, rows, grad_bags, grad_offsets, grad_pooled, kind, hp) -> None:  # type: ignore[no-untyped-def]
    return None


def _check(
    arena: torch.Tensor, rows: torch.Tensor, grad_bags: torch.Tensor, grad_offsets: torch.Tensor, grad: torch.Tensor
) -> None:
    ok = (
        arena.dtype == torch.float32
        and arena.dim() == 2
        and arena.is_contiguous()
        and grad.dtype == torch.float32
        and grad.dim() == 2
        and grad.is_contiguous()
        and grad.shape[1] <= arena.shape[1]
        and rows.dtype == torch.int64
        and grad_bags.dtype == torch.int32
        and grad_offsets.dtype == torch.int32
        and rows.shape == grad_offsets.shape
    )
    if not ok:
        raise ValueError(
            "fused_sparse_update: need float32 contiguous arena [capacity, width] and grad_pooled "
            "[n_bags, dim <= width], int64 rows and int32 grad_offsets of one length, int32 grad_bags; got "
            f"arena {arena.dtype}{tuple(arena.shape)}, grad_pooled {grad.dtype}{tuple(grad.shape)}, "
            f"rows {rows.dtype}{tuple(rows.shape)}, grad_offsets {grad_offsets.dtype}{tuple(grad_offsets.shape)}, "
            f"grad_bags {grad_bags.dtype}"
        )


def warm_fused_update() -> None:
    """Compile (or load from numba's cache) the CPU kernel for every optimizer kind, on a
    throwaway arena, with the dtypes a mini-batch passes."""
    arena = torch.zeros((4, 12), dtype=torch.float32)
    rows = torch.tensor([2, 0], dtype=torch.int64)
    bags, offsets = torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    grad = torch.ones((2, 4), dtype=torch.float32)
    for kind in range(4):
        fused_sparse_update(arena, rows, bags, offsets, grad, kind, [0.1, 1e-8, 0.9, 0.999, 0.1, 0.001])
