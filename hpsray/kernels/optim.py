"""Sparse optimizers whose state lives in the row, after the ``dim`` weights.

Row layout: ``[w_0 .. w_{dim-1} | state]``. The update math is one ``register_jitable``
function, :func:`apply_row_update`, compiled into the CPU kernels, the CUDA kernels and the
reference trainer alike, so every backend applies the same float32 operations.

========================  ===============  ==============================================
optimizer                 state per row    update for summed gradient ``g``
========================  ===============  ==============================================
``SGD``                   none             ``w -= lr * g``
``Adagrad``               ``dim``          ``a += g*g;  w -= lr * g / (sqrt(a) + eps)``
``Adagrad(per_row)``      1                ``a += mean(g*g);  w -= lr * g / (sqrt(a) + eps)``
                                           (the squares summed in float64)
``Adam`` (lazy)           ``2 * dim``      moments of touched rows only;
                                           ``w -= lr * (m/bc1) / (sqrt(v/bc2) + eps)``
                                           with bias corrections ``bc`` of the global
                                           step (``torch.optim.SparseAdam`` instead adds
                                           ``eps`` to ``sqrt(v)`` before correcting, which
                                           differs when gradients are near ``eps``)
========================  ===============  ==============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit
from numba.extending import register_jitable

KIND_SGD = 0
KIND_ADAGRAD = 1
KIND_ADAGRAD_ROW = 2
KIND_ADAM = 3

# Hyper-parameter vector passed to kernels (float32): indices into it.
HP_LR, HP_EPS, HP_BETA1, HP_BETA2, HP_BC1, HP_BC2 = range(6)
HP_SIZE = 6


@register_jitable
def apply_row_update(kind, row, g, dim, hp):
    """Apply one optimizer step to ``row`` (float32[width]) for the summed gradient ``g``."""
    lr = hp[0]
    if kind == 0:  # SGD
        for j in range(dim):
            row[j] = row[j] - lr * g[j]
    elif kind == 1:  # Adagrad, accumulator per element
        eps = hp[1]
        for j in range(dim):
            a = row[dim + j] + g[j] * g[j]
            row[dim + j] = a
            row[j] = row[j] - lr * g[j] / (np.float32(math.sqrt(a)) + eps)
    elif kind == 2:  # Adagrad, one accumulator per row
        eps = hp[1]
        s = 0.0  # the float32 squares summed in float64, in column order, rounded once
        for j in range(dim):
            s += np.float64(g[j] * g[j])
        a = row[dim] + np.float32(s) / np.float32(dim)
        row[dim] = a
        scale = lr / (np.float32(math.sqrt(a)) + eps)
        for j in range(dim):
            row[j] = row[j] - scale * g[j]
    else:  # lazy Adam
        eps, b1, b2, bc1, bc2 = hp[1], hp[2], hp[3], hp[4], hp[5]
        one = np.float32(1.0)
        for j in range(dim):
            m = b1 * row[dim + j] + (one - b1) * g[j]
            v = b2 * row[2 * dim + j] + (one - b2) * g[j] * g[j]
            row[dim + j] = m
            row[2 * dim + j] = v
            row[j] = row[j] - lr * (m / bc1) / (np.float32(math.sqrt(v / bc2)) + eps)


@dataclass(frozen=True)
class SparseOptimizer:
    """Base of the sparse optimizers: a kind, hyper-parameters and the state they keep."""

    lr: float = 0.01

    kind: int = -1  # overridden by subclasses

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"{type(self).__name__}.lr must be a positive number, got {self.lr}")

    def state_width(self, dim: int) -> int:
        """Number of float32 state values stored after the weights."""
        raise NotImplementedError

    def state_init(self) -> float:
        """Initial value of every state element of a new row."""
        return 0.0

    def hyperparams(self, step: int) -> np.ndarray:
        """The float32 hyper-parameter vector for global step ``step`` (1-based)."""
        hp = np.zeros(HP_SIZE, dtype=np.float32)
        hp[HP_LR] = self.lr
        return hp


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Plain stochastic gradient descent; no state."""

    kind: int = KIND_SGD

    def state_width(self, dim: int) -> int:
        return 0


@dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Adagrad with an accumulator per element, or per row with ``per_row=True``."""

    eps: float = 1e-8
    initial_accumulator: float = 0.0
    per_row: bool = False
    kind: int = KIND_ADAGRAD

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "kind", KIND_ADAGRAD_ROW if self.per_row else KIND_ADAGRAD)
        if self.eps <= 0 or self.initial_accumulator < 0:
            raise ValueError(
                f"Adagrad: eps must be > 0 and initial_accumulator >= 0, got {self.eps}, {self.initial_accumulator}"
            )

    def state_width(self, dim: int) -> int:
        return 1 if self.per_row else dim

    def state_init(self) -> float:
        return self.initial_accumulator

    def hyperparams(self, step: int) -> np.ndarray:
        hp = super().hyperparams(step)
        hp[HP_EPS] = self.eps
        return hp


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy Adam: only rows present in a gradient update their moments."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    kind: int = KIND_ADAM

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError(
                f"Adam: need 0 <= beta1, beta2 < 1 and eps > 0, got {self.beta1}, {self.beta2}, {self.eps}"
            )

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def hyperparams(self, step: int) -> np.ndarray:
        if step < 1:
            raise ValueError(f"Adam step must be >= 1, got {step}")
        hp = super().hyperparams(step)
        hp[HP_EPS] = self.eps
        hp[HP_BETA1] = self.beta1
        hp[HP_BETA2] = self.beta2
        hp[HP_BC1] = 1.0 - self.beta1**step
        hp[HP_BC2] = 1.0 - self.beta2**step
        return hp


SPARSE_OPTIMIZERS = ("sgd", "adagrad", "adagrad_row", "adam")
"""The row optimizers :func:`make_optimizer` builds, by name."""


def make_optimizer(name: str, **params: Any) -> SparseOptimizer:
    """Build an optimizer by name: ``sgd``, ``adagrad``, ``adagrad_row`` or ``adam``; ``params`` are
    its dataclass fields by name (``lr``, ``eps``, ...: fields of several types, hence ``Any``)."""
    name = name.lower()
    if name == "sgd":
        return SGD(**params)
    if name == "adagrad":
        return Adagrad(**params)
    if name == "adagrad_row":
        return Adagrad(per_row=True, **params)
    if name == "adam":
        return Adam(**params)
    raise ValueError(f"unknown sparse optimizer {name!r}; choose sgd, adagrad, adagrad_row or adam")


@njit(cache=True)
def _apply_each_row(rows, grads, kind, hp):
    dim = grads.shape[1]
    for i in range(rows.shape[0]):
        apply_row_update(kind, rows[i], grads[i], dim, hp)


def apply_to_rows(rows: np.ndarray, grads: np.ndarray, optimizer: SparseOptimizer, step: int) -> None:
    """Apply one step in place to distinct rows ``float32[n, width]`` with gradients
    ``float32[n, dim]``: the same math the table kernels run, without a table."""
    if rows.dtype != np.float32 or grads.dtype != np.float32 or rows.shape[0] != grads.shape[0]:
        raise ValueError(
            "apply_to_rows: need float32 rows [n, width] and grads [n, dim], "
            f"got {rows.dtype}{rows.shape}, {grads.dtype}{grads.shape}"
        )
    dim = grads.shape[1]
    if rows.shape[1] != dim + optimizer.state_width(dim):
        raise ValueError(
            f"apply_to_rows: {type(optimizer).__name__} needs width {dim + optimizer.state_width(dim)}, "
            f"rows have {rows.shape[1]}"
        )
    _apply_each_row(rows, np.ascontiguousarray(grads), optimizer.kind, optimizer.hyperparams(step))
