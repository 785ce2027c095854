"""The mini-batch step in torch ops on the working-set arena (docs/architecture.md: The
mini-batch step).

The arena is the HBM-PS table's row array (``[w | optimizer state]`` per slot) seen as a torch
tensor without a copy. Per mini-batch of a :class:`~hpsray.training.layout.BatchIndex`:

1. :meth:`ArenaStep.gather`: the mini-batch's distinct rows, one ``index_select``;
2. :meth:`ArenaStep.pool`: their weights sum-pooled per bag, one ``embedding_bag``; the pooled
   tensor is the autograd leaf the dense model's backward pass fills;
3. :meth:`ArenaStep.row_grads`: each row's gradient, one ``embedding_bag`` over the pooled
   gradient in the order the index gives (bag order, from zero);
4. :meth:`ArenaStep.update`: the sparse optimizer on the gathered rows
   (:func:`~hpsray.training.sparse_update.update_rows`) and one ``index_copy_`` back.

Fused (``ArenaStep(..., fused=True)``, the default on the CPU), :meth:`ArenaStep.apply` does 3
and 4 as one op, ``hpsray::fused_sparse_update`` (:mod:`hpsray.training.fused_update`): each
distinct row's gradient summed from the pooled gradient and the optimizer applied where the row
lies in the arena, in one pass and the same bits. The unfused ops stay as its check (and for the
paths that exchange row gradients before updating).

Every op runs on the arena's device and none reads a result back, so on CUDA a mini-batch is a
stream of kernel launches. The same lines run on the CPU, where they are bit-equal to the
reference trainer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hpsray.kernels.optim import SparseOptimizer
from hpsray.training.fused_update import fused_sparse_update
from hpsray.training.layout import MiniBatchIndex
from hpsray.training.sparse_update import update_rows

__all__ = ["ArenaStep", "grown"]


def grown(buf: torch.Tensor, n: int) -> torch.Tensor:
    """Scratch of at least ``n`` rows: ``buf``, or a new one of ``buf``'s width and device (twice
    its rows, or ``n``). Scratch grows, never shrinks: large allocations fault pages in."""
    if buf.shape[0] >= n:
        return buf
    return torch.empty((max(n, 2 * buf.shape[0]), buf.shape[1]), dtype=buf.dtype, device=buf.device)


class ArenaStep:
    """The sparse half of a mini-batch step over ``arena`` (``float32[capacity, width]``, the
    first ``dim`` columns the weights), with reusable scratch for the gathered rows. ``fused``:
    whether :meth:`apply` runs the fused op (``None``: on the CPU, where it was measured faster,
    docs/benchmarks.md; the unfused ops on CUDA until measured there). ``row_lr(slots)``: the rows'
    own learning rates (``float32[n, 1]``; tables of their own lr), with the unfused ops."""

    def __init__(
        self,
        arena: torch.Tensor,
        dim: int,
        optimizer: SparseOptimizer,
        fused: bool | None = None,
        row_lr: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if arena.dim() != 2 or arena.dtype != torch.float32 or not arena.is_contiguous():
            raise ValueError(
                f"arena must be a contiguous float32 [capacity, width] tensor, got {arena.dtype}{tuple(arena.shape)}"
            )
        self.arena, self.dim, self.optimizer, self.row_lr = arena, dim, optimizer, row_lr
        self.fused = (not arena.is_cuda and row_lr is None) if fused is None else fused
        if self.fused and row_lr is not None:
            raise ValueError("the fused update takes one learning rate: row_lr needs fused=False")
        self._scratch = torch.empty((0, arena.shape[1]), dtype=torch.float32, device=arena.device)

    @property
    def width(self) -> int:
        """Floats per gathered row."""
        return int(self._scratch.shape[1])

    @property
    def capacity(self) -> int:
        """Slots of the arena: every slot is below it."""
        return int(self.arena.shape[0])

    def scratch(self, n: int) -> torch.Tensor:
        """``n`` rows of reusable scratch (valid until the next call)."""
        self._scratch = grown(self._scratch, n)
        return self._scratch[:n]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The arena's ``rows`` (slots), copied into scratch (valid until the next gather)."""
        out = self.scratch(rows.shape[0])
        torch.index_select(self.arena, 0, rows, out=out)
        return out

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The arena's rows of ``slots``, a new tensor."""
        return self.arena.index_select(0, slots)

    def pool(self, gathered: torch.Tensor, mb: MiniBatchIndex) -> torch.Tensor:
        """Sum-pooled weights ``[n_examples, n_slots, dim]`` of the mini-batch, a leaf that
        requires grad (its ``.grad`` after the backward pass is the pooled gradient)."""
        return self.pool_rows(gathered, mb, self.dim)

    @staticmethod
    def pool_rows(rows: torch.Tensor, mb: MiniBatchIndex, dim: int) -> torch.Tensor:
        """:meth:`pool` over any rows of the mini-batch's distinct keys (``[U, >= dim]``, in
        the index's row order)."""
        weights = rows[:, :dim].contiguous()
        pooled = F.embedding_bag(mb.inverse, weights, mb.bag_offsets, mode="sum")
        return pooled.view(mb.n_examples, mb.n_slots, dim).requires_grad_(True)

    @staticmethod
    def row_grads(mb: MiniBatchIndex, pooled: torch.Tensor) -> torch.Tensor:
        """``float32[U, dim]``: each distinct row's gradient, summed over its occurrences."""
        if pooled.grad is None:
            raise RuntimeError("row_grads before the backward pass: the pooled leaf has no gradient")
        grad = pooled.grad.view(-1, pooled.shape[2])
        return F.embedding_bag(mb.grad_bags, grad, mb.grad_offsets, mode="sum")

    def update(self, slots: torch.Tensor, gathered: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Apply the sparse optimizer (global step ``step``) to ``gathered``, the rows of the
        distinct ``slots``, for ``grads``, and write them back to the arena."""
        lr = self.row_lr(slots) if self.row_lr is not None else None
        update_rows(gathered, grads, self.optimizer, step, lr)
        self.arena.index_copy_(0, slots, gathered)

    def apply(self, mb: MiniBatchIndex, gathered: torch.Tensor, pooled: torch.Tensor, step: int) -> None:
        """After the backward pass of ``mb`` (``pooled``: the leaf :meth:`pool` gave, its
        gradient filled; ``gathered``: the rows it was pooled from), apply the sparse optimizer
        (global step ``step``) to the mini-batch's rows in the arena: fused, one
        ``hpsray::fused_sparse_update``; else :meth:`row_grads` and :meth:`update`."""
        if not self.fused:
            self.update(mb.rows, gathered, self.row_grads(mb, pooled), step)
            return
        if pooled.grad is None:
            raise RuntimeError("apply before the backward pass: the pooled leaf has no gradient")
        grad = pooled.grad.view(-1, pooled.shape[2])
        hp = [float(x) for x in self.optimizer.hyperparams(step)]
        fused_sparse_update(self.arena, mb.rows, mb.grad_bags, mb.grad_offsets, grad, self.optimizer.kind, hp)
