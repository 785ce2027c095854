"""Sum-pooling of embedding rows per (example, slot) bag, in PyTorch, on the rows' device; a
slot's mean pooling is that sum over :func:`bag_divisor`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from hpsray.data.batch import Batch
from hpsray.kernels.arrays import distinct_inverse


@dataclass(frozen=True)
class BagLayout:
    """How a mini-batch's keys map onto its distinct rows and its pooling bags.

    ``unique_keys[inverse[i]]`` is key ``i`` (after sorting keys by bag); ``bag_offsets`` are
    the start of each of the ``B * n_slots`` bags in that order, as ``F.embedding_bag`` wants.
    The three arrays live in the array module ``xp`` the layout was made with: numpy, or CuPy
    on a GPU, where the keys are deduplicated on the device (the keys and offsets go in once).
    """

    unique_keys: Any  # uint64[U], sorted
    inverse: Any  # int64[nnz], into unique_keys, keys in bag order
    bag_offsets: Any  # int64[B * n_slots]
    n_examples: int
    n_slots: int

    @staticmethod
    def of(batch: Batch, xp: ModuleType = np) -> BagLayout:
        bag = batch.bag_index()
        keys = batch.keys
        if bag.size > 1 and np.any(bag[1:] < bag[:-1]):  # keys of an example not in slot order
            order = np.argsort(bag, kind="stable")
            bag, keys = bag[order], keys[order]
        unique_keys, inverse = distinct_inverse(xp, xp.asarray(keys))
        return BagLayout(unique_keys, inverse, xp.asarray(batch.bag_offsets(bag)), len(batch), batch.n_slots)


def pool_sum(rows: torch.Tensor, layout: BagLayout) -> torch.Tensor:
    """Sum-pooled embeddings ``[B, n_slots, dim]`` of ``rows`` (``[U, dim]``, one per distinct key).

    Differentiable in ``rows``; an empty bag pools to zeros. On CPU the gradient of ``rows``
    comes from :func:`_bag_grad` (one pass over the bags) instead of torch's dense
    embedding-bag backward, which sorts the indices first (~4x the time at 100 keys/example);
    on CUDA torch's own embedding-bag forward and backward run on the device.
    """
    if rows.requires_grad and not rows.is_cuda:
        pooled = _PoolSum.apply(rows, layout)
    else:
        pooled = F.embedding_bag(
            _index(layout.inverse, rows.device), rows, _index(layout.bag_offsets, rows.device), mode="sum"
        )
    return pooled.view(layout.n_examples, layout.n_slots, rows.shape[1])


def _index(a: Any, device: torch.device) -> torch.Tensor:
    """An index array (numpy or CuPy) as a tensor on ``device``, without a copy where it lives there."""
    return torch.as_tensor(a, device=device)


class _PoolSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, layout: BagLayout) -> torch.Tensor:
        ctx.layout, ctx.n_rows = layout, rows.shape[0]
        return F.embedding_bag(
            torch.from_numpy(layout.inverse), rows.detach(), torch.from_numpy(layout.bag_offsets), mode="sum"
        )

    @staticmethod
    def backward(ctx: Any, grad_pooled: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = grad_pooled.detach().contiguous().numpy()
        out = np.zeros((ctx.n_rows, g.shape[1]), dtype=g.dtype)
        _bag_grad(ctx.layout.inverse, ctx.layout.bag_offsets, g, out)
        return torch.from_numpy(out), None


@njit(cache=True, nogil=True)
def _bag_grad(inverse, offsets, grad_pooled, out):
    """``out[inverse[i]] += grad_pooled[bag of i]`` for every key position ``i`` (bags in order)."""
    n_bags, dim = grad_pooled.shape
    nnz = inverse.size
    for b in range(n_bags):
        end = offsets[b + 1] if b + 1 < n_bags else nnz
        for i in range(offsets[b], end):
            u = inverse[i]
            for j in range(dim):
                out[u, j] += grad_pooled[b, j]


def bag_divisor(bag_offsets: torch.Tensor, n_keys: int, n_examples: int, mean: torch.Tensor) -> torch.Tensor:
    """``float32[B, n_slots, 1]`` that turns sum-pooled bags into the pooling each slot asks for:
    a bag of a ``mean`` slot (``bool[n_slots]``) its key count (at least 1: an empty bag stays
    zeros), every other bag 1.0 (so dividing leaves its sum exactly as it was). ``bag_offsets``:
    the ``B * n_slots`` bag starts into ``n_keys`` keys, on ``mean``'s device; torch ops only,
    no read of the device."""
    ends = torch.cat([bag_offsets[1:], torch.full((1,), n_keys, dtype=bag_offsets.dtype, device=bag_offsets.device)])
    counts = (ends - bag_offsets).clamp_(min=1).to(torch.float32).view(n_examples, -1)
    return torch.where(mean, counts, torch.ones_like(counts)).unsqueeze(2)


def slot_columns(slot_dims: Sequence[int], dim: int) -> np.ndarray:
    """``int64``: the columns of a flattened ``[B, n_slots, dim]`` pooled tensor the model takes
    when the slots' widths differ: each slot's first ``slot_dims[s]``, in slot order (the
    reference's concatenation, ``[B, sum(slot_dims)]``)."""
    return np.concatenate([s * dim + np.arange(d, dtype=np.int64) for s, d in enumerate(slot_dims)])
