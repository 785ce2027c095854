"""The sparse optimizers of :mod:`hpsray.kernels.optim` as torch ops on gathered rows.

:func:`update_rows` applies one step to ``rows`` (``float32[n, width]``: ``[w | state]``, one
row per distinct key) for their summed gradients ``grads`` (``float32[n, dim]``), in place, with
the float32 operations of :func:`~hpsray.kernels.optim.apply_row_update` in the same order, so
on the CPU the result is bit-equal to the table kernels' (tests/training/test_sparse_update.py);
on CUDA it is the same math within float32 rounding. The same lines run on both devices, a few
element-wise kernels per step, each writing into the caller's scratch buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from hpsray.kernels.optim import (
    HP_BC1,
    HP_BC2,
    HP_BETA1,
    HP_BETA2,
    HP_EPS,
    HP_LR,
    KIND_ADAGRAD,
    KIND_ADAGRAD_ROW,
    KIND_ADAM,
    KIND_SGD,
    SparseOptimizer,
)

__all__ = ["update_rows"]


def update_rows(
    rows: torch.Tensor, grads: torch.Tensor, optimizer: SparseOptimizer, step: int, lr: torch.Tensor | None = None
) -> None:
    """One step of ``optimizer`` (global step ``step``, 1-based) on ``rows`` for ``grads``.

    Hyper-parameters are the float32 values of ``optimizer.hyperparams(step)`` (Python floats
    that are exact float32 numbers, so a torch scalar operand rounds to the same value). ``lr``
    (``float32[n, 1]``, each row's own: tables of their own learning rate) replaces the
    optimizer's; a float32 operand per row gives the bits the scalar would."""
    dim = grads.shape[1]
    hp = [float(x) for x in optimizer.hyperparams(step)]
    kind = optimizer.kind
    lr_: float | torch.Tensor = hp[HP_LR] if lr is None else lr
    w = rows[:, :dim]
    if kind == KIND_SGD:
        w.sub_(grads * lr_)
        return
    eps = hp[HP_EPS]
    if kind == KIND_ADAGRAD:
        a = rows[:, dim : 2 * dim]
        a.add_(grads * grads)
        w.sub_((grads * lr_).div_(_sqrt(a).add_(eps)))
        return
    if kind == KIND_ADAGRAD_ROW:
        # the kernels' sum: the float32 squares in float64, in column order (a CPU cumsum is
        # sequential), rounded once; no loop over the columns
        s = (grads * grads).double().cumsum_(1)[:, -1].float()
        a = rows[:, dim]
        a.add_(s.div_(float(np.float32(dim))))
        scale = (torch.full_like(a, hp[HP_LR]) if lr is None else lr.reshape(-1).clone()).div_(_sqrt(a).add_(eps))
        w.sub_(grads * scale.unsqueeze(1))
        return
    if kind == KIND_ADAM:
        b1, b2, bc1, bc2 = hp[HP_BETA1], hp[HP_BETA2], hp[HP_BC1], hp[HP_BC2]
        one_b1 = float(np.float32(1.0) - np.float32(b1))
        one_b2 = float(np.float32(1.0) - np.float32(b2))
        m, v = rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
        m.mul_(b1).add_(grads * one_b1)
        v.mul_(b2).add_((grads * one_b2).mul_(grads))
        w.sub_((m / bc1).mul_(lr_).div_(_sqrt(v / bc2).add_(eps)))
        return
    raise ValueError(f"unknown sparse optimizer kind {kind}")


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """``sqrt(t)`` correctly rounded, as the kernels' ``math.sqrt``: CUDA's float sqrt is; torch's
    vectorised CPU float sqrt is not (13 % of results differ in the last bit), so on the CPU the
    root is taken in float64 and rounded once (exact: float64 has over twice float32's bits)."""
    if t.is_cuda:
        return t.sqrt()
    return t.double().sqrt_().float()
