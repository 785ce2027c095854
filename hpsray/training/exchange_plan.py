"""BSP's exchange resolved once per batch: which gathered gradient rows each global mini-batch
applies here, at which slots, summed how (docs/architecture.md: One training step).

Every node's keys of every global mini-batch are known when the batch is indexed, so one
all-gather of them per batch (and of their counts) lets each node find, for each global
mini-batch, the positions of the gathered rows whose keys it holds, their distinct slots
(sorted) and where each row sums in: the ``searchsorted``, masks and dedupe of
:meth:`~hpsray.training.engine.TrainerEngine.apply_updates`, done for the whole batch at once.
A mini-batch step then applies its gathered gradients with ``index_select``, ``index_add_``
and the sparse update: no sort, no dedupe, no read-back. The sums run in the gathered order
(rank order), as ``apply_updates`` does, so the rows are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from hpsray.training.engine import SparseExchange, TrainerEngine

__all__ = ["ExchangePlan"]


@dataclass(frozen=True)
class _Part:
    take: torch.Tensor  # int64: positions in the mini-batch's gathered rows held here
    inverse: torch.Tensor  # int64: each taken row's distinct slot
    slots: torch.Tensor  # int64: the distinct slots, sorted


class ExchangePlan:
    """Per global mini-batch ``k``, what :meth:`apply` takes of the gathered gradients."""

    def __init__(self, engine: TrainerEngine, parts: list[_Part | None], per_rank: np.ndarray) -> None:
        self.engine, self.parts, self.per_rank = engine, parts, per_rank
        self.no_keys = torch.empty(0, dtype=torch.int64, device=engine.device.torch)

    def counts(self, k: int) -> list[int]:
        """Every node's number of gradient rows in global mini-batch ``k``, in rank order: the
        lengths of its all-gather, known here, so it exchanges no sizes."""
        return [int(n) for n in self.per_rank[:, k]]

    @classmethod
    def of(cls, engine: TrainerEngine, own: list[torch.Tensor], n_mb: int, group: SparseExchange) -> ExchangePlan:
        """The plan of a batch of ``n_mb`` global mini-batches whose gradient rows this node
        sends in the order of ``own[k]`` (``int64`` key bits on the device; mini-batches past
        ``len(own)`` send none): two all-gathers of known lengths (every node's counts per global
        mini-batch, then its keys), the counts read once and one read of the per-mini-batch bounds."""
        dev = engine.device
        keys = torch.cat(own) if own else torch.empty(0, dtype=torch.int64, device=dev.torch)
        counts = np.zeros(n_mb, np.uint64)
        counts[: len(own)] = [k.numel() for k in own]
        xp = dev.xp
        world = engine.n_nodes
        all_counts, _ = group.allgather_sparse(xp.asarray(counts), xp.empty((n_mb, 0), xp.float32), [n_mb] * world)
        per_rank = np.asarray(_host(all_counts), dtype=np.int64).reshape(world, n_mb)
        all_keys, _ = group.allgather_sparse(
            engine.exchange_array(keys, keys=True), xp.empty((keys.numel(), 0), xp.float32), per_rank.sum(1).tolist()
        )
        resident = engine.resident
        if resident is None or resident[0].numel() == 0 or n_mb == 0:
            return cls(engine, [None] * n_mb, per_rank)
        # the gathered rows, mini-batch by mini-batch (each in rank order, as a step gathers them)
        starts = np.concatenate([[0], np.cumsum(per_rank.sum(1))])[:-1]
        within = np.cumsum(per_rank, 1) - per_rank
        order = [
            np.arange(n, dtype=np.int64) + s + w
            for k in range(n_mb)
            for s, w, n in zip(starts, within[:, k], per_rank[:, k], strict=True)
        ]
        flat = np.concatenate(order) if order else np.empty(0, np.int64)
        per_mb = per_rank.sum(0)
        gathered = torch.as_tensor(all_keys.view(xp.int64), device=dev.torch).index_select(
            0, torch.from_numpy(flat).to(dev.torch)
        )
        res_keys, res_slots = resident
        at = torch.searchsorted(res_keys, gathered).clamp_(max=res_keys.numel() - 1)
        held = res_keys.index_select(0, at) == gathered
        where = torch.nonzero(held).squeeze(1)  # once per batch
        mb_of = torch.from_numpy(np.repeat(np.arange(n_mb, dtype=np.int64), per_mb)).to(dev.torch)
        first = torch.from_numpy(np.concatenate([[0], np.cumsum(per_mb)])[:-1]).to(dev.torch)
        mb_held = mb_of.index_select(0, where)
        take = where - first.index_select(0, mb_held)
        slots = res_slots.index_select(0, at.index_select(0, where))
        span = engine.arena.capacity + 1
        distinct, inverse = torch.unique(mb_held * span + slots, return_inverse=True)
        n_taken = torch.bincount(mb_held, minlength=n_mb)
        n_distinct = torch.bincount(torch.div(distinct, span, rounding_mode="floor"), minlength=n_mb)
        bounds = torch.stack([n_taken, n_distinct]).cumsum(1).tolist()  # the one read of the bounds
        d_first = [0, *bounds[1][:-1]]
        parts: list[_Part | None] = []
        lo = 0
        for k in range(n_mb):
            hi = bounds[0][k]
            if hi == lo:
                parts.append(None)
                continue
            d0, d1 = d_first[k], bounds[1][k]
            parts.append(_Part(take[lo:hi], inverse[lo:hi] - d0, distinct[d0:d1] - k * span))
            lo = hi
        return cls(engine, parts, per_rank)

    def apply(self, k: int, grads: torch.Tensor, step: int) -> None:
        """Apply global mini-batch ``k``'s gathered ``grads`` (every node's rows, rank order) to
        the rows held here, at the current ``step``."""
        part = self.parts[k]
        if part is None:
            return
        g = grads.index_select(0, part.take)
        summed = torch.zeros((part.slots.numel(), g.shape[1]), dtype=g.dtype, device=g.device).index_add_(
            0, part.inverse, g
        )
        arena = self.engine.arena
        arena.update(part.slots, arena.gather(part.slots), summed, step)


def _host(a: object) -> np.ndarray:
    """A gathered count array on the host (a CuPy array is read once per batch)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)
