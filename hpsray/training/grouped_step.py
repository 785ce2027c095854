"""The mini-batch step over a working set of rows of several layouts (tables of their own width
or sparse optimizer, :class:`~hpsray.tiers.rowgroups.RowGroups`).

The working set's arena holds every row at the widest group's width (a row of group ``g``: its
``dims[g]`` weights, its optimizer's state, zeros to the end). :class:`GroupedArenaStep` is the
:class:`~hpsray.training.step.ArenaStep` of such an arena: it gathers and pools as ArenaStep
does, at the widest dim (a narrower row's columns past its dim are pooled but never read: the
model takes each slot's first ``dim`` columns, :func:`~hpsray.models.pooling.slot_columns`), and updates each group's
rows with the group's optimizer on the group's first ``dims[g]`` gradient columns, each row at
its table's learning rate. Every operation is column-wise, so each row's bits are those of a
step over its table alone (the reference trainer's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hpsray.kernels.optim import SparseOptimizer
from hpsray.tiers.rowgroups import RowGroups
from hpsray.training.sparse_update import update_rows
from hpsray.training.step import ArenaStep

__all__ = ["GroupedArenaStep"]


class GroupedArenaStep(ArenaStep):
    """ArenaStep over an arena of rows of ``groups``' layouts (module docstring).
    ``optimizers[g]``: group ``g``'s sparse optimizer; ``group_of(slots)``: the group of each
    arena slot (an ``int64`` tensor); ``row_lr(slots)``: each row's learning rate."""

    def __init__(
        self,
        arena: torch.Tensor,
        groups: RowGroups,
        optimizers: Sequence[SparseOptimizer],
        group_of: Callable[[torch.Tensor], torch.Tensor],
        row_lr: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        if arena.shape[1] < max(groups.widths):
            raise ValueError(f"arena rows of {arena.shape[1]} floats hold no row of {groups.describe(0)}")
        super().__init__(arena, max(groups.dims), optimizers[0], fused=False, row_lr=row_lr)
        self.groups, self.optimizers, self.group_of = groups, tuple(optimizers), group_of

    def update(self, slots: torch.Tensor, gathered: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Each group's rows of ``slots`` (``gathered``: their rows) stepped by the group's
        optimizer for their first ``dims[g]`` gradient columns, written back to the arena."""
        group = self.group_of(slots)
        for g, d in enumerate(self.groups.dims):
            at = torch.nonzero(group == g).squeeze(1)
            if at.numel() == 0:
                continue
            mine = slots.index_select(0, at)
            rows = gathered.index_select(0, at)
            lr = self.row_lr(mine) if self.row_lr is not None else None
            update_rows(rows, grads.index_select(0, at)[:, :d], self.optimizers[g], step, lr)
            self.arena.index_copy_(0, mine, rows)
