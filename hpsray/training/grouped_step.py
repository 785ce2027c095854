"""The mini-batch step over a working set of rows of several layouts (tables of their own width
or sparse optimizer, :class:`~hpsray.tiers.rowgroups.RowGroups`).

Each group's rows live in their own arena at the group's width (:class:`~hpsray.tiers.grouped_hbm.GroupedHbmPS`);
a slot is global, group ``g``'s slots ``[bases[g], bases[g + 1])``. :class:`GroupedArenaStep`
is the :class:`~hpsray.training.step.ArenaStep` of such arenas: :meth:`~GroupedArenaStep.gather`
puts a mini-batch's rows side by side at the widest width (a narrower row's columns past its
width zero), pooled as ArenaStep pools them at the widest dim (the model takes each slot's first
``dim`` columns, :func:`~hpsray.models.pooling.slot_columns`); :meth:`~GroupedArenaStep.update`
steps each group's rows with the group's optimizer on its first ``dims[g]`` gradient columns,
each row at its table's learning rate, and writes them back to the group's arena. Every
operation is column-wise, so each row's bits are those of a step over its table alone (the
reference trainer's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hpsray.kernels.optim import SparseOptimizer
from hpsray.tiers.rowgroups import RowGroups
from hpsray.training.sparse_update import update_rows
from hpsray.training.step import ArenaStep, grown

__all__ = ["GroupedArenaStep"]


class GroupedArenaStep(ArenaStep):
    """ArenaStep over one arena per group of ``groups`` (module docstring). ``arenas[g]``:
    group ``g``'s rows (``float32[capacity_g, widths[g]]``); ``bases``: the global slots' bounds
    (``len(groups) + 1``); ``optimizers[g]``: group ``g``'s sparse optimizer; ``row_lr(g,
    local_slots)``: the learning rate of each of group ``g``'s rows (``float32[n, 1]``)."""

    def __init__(
        self,
        arenas: Sequence[torch.Tensor],
        bases: Sequence[int],
        groups: RowGroups,
        optimizers: Sequence[SparseOptimizer],
        row_lr: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if len(arenas) != len(groups) or len(bases) != len(groups) + 1:
            raise ValueError(f"{len(groups)} groups need as many arenas and one more base, got {len(arenas)}, {bases}")
        for g, a in enumerate(arenas):
            if a.dim() != 2 or a.shape[1] != groups.widths[g] or a.shape[0] != bases[g + 1] - bases[g]:
                n = bases[g + 1] - bases[g]
                raise ValueError(f"{groups.describe(g)} needs an arena of {n} rows, got {tuple(a.shape)}")
        width = max(groups.widths)
        super().__init__(
            torch.empty((0, width), dtype=torch.float32, device=arenas[0].device),
            max(groups.dims),
            optimizers[0],
            fused=False,
        )
        self.arenas, self.bases, self.groups = list(arenas), list(bases), groups
        self.optimizers, self.group_lr = tuple(optimizers), row_lr
        self._bounds = torch.as_tensor(self.bases[1:-1], dtype=torch.int64, device=arenas[0].device)
        self._last: tuple[torch.Tensor, list] | None = None  # the last slots split, and their split
        self._parts = [torch.empty((0, w), dtype=torch.float32, device=arenas[0].device) for w in groups.widths]

    @property
    def capacity(self) -> int:
        return self.bases[-1]

    def _split(self, slots: torch.Tensor) -> list[tuple[slice | torch.Tensor, torch.Tensor]]:
        """Per group, where its slots are among ``slots`` (a slice when ``slots`` are sorted, as
        a mini-batch's rows are when the trainer indexes the batch; else their positions) and its
        own (local) slots. The last split is kept: a step gathers and updates the same slots."""
        if self._last is not None and self._last[0] is slots:
            return self._last[1]
        out: list[tuple[slice | torch.Tensor, torch.Tensor]] = []
        n = slots.shape[0]
        if n < 2 or bool((slots[1:] >= slots[:-1]).all()):  # one read: ranges, no masks
            cuts = [0, *torch.searchsorted(slots, self._bounds).tolist(), n]
            for g, base in enumerate(self.bases[:-1]):
                out.append((slice(cuts[g], cuts[g + 1]), slots[cuts[g] : cuts[g + 1]] - base))
        else:
            group = torch.bucketize(slots, self._bounds, right=True)
            for g, base in enumerate(self.bases[:-1]):
                at = torch.nonzero(group == g).squeeze(1)
                out.append((at, slots.index_select(0, at) - base))
        self._last = (slots, out)
        return out

    def _fill(self, out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        out.zero_()
        for g, (at, local) in enumerate(self._split(slots)):
            self._parts[g] = grown(self._parts[g], local.shape[0])  # group g's rows, gathered first
            part = self._parts[g][: local.shape[0]]
            torch.index_select(self.arenas[g], 0, local, out=part)
            out[at, : self.groups.widths[g]] = part
        return out

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of ``rows`` (global slots) at the widest width, in scratch (valid until the
        next gather)."""
        return self._fill(self.scratch(rows.shape[0]), rows)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self._fill(torch.empty((slots.shape[0], self.width), dtype=torch.float32, device=slots.device), slots)

    def update(self, slots: torch.Tensor, gathered: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Each group's rows of ``slots`` (``gathered``: their rows) stepped by the group's
        optimizer for their first ``dims[g]`` gradient columns, written back to its arena."""
        for g, (at, local) in enumerate(self._split(slots)):
            if local.numel() == 0:
                continue
            w, d = self.groups.widths[g], self.groups.dims[g]
            if isinstance(at, slice):  # the group's rows in place in ``gathered``
                rows, grad = gathered[at, :w], grads[at, :d]
            else:
                rows, grad = gathered.index_select(0, at)[:, :w], grads.index_select(0, at)[:, :d]
            lr = self.group_lr(g, local) if self.group_lr is not None else None
            update_rows(rows, grad, self.optimizers[g], step, lr)
            self.arenas[g].index_copy_(0, local, rows)
