"""Sum-pooling of embedding rows per (example, slot) bag, in PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

from hpsray.data.batch import Batch


@dataclass(frozen=True)
class BagLayout:
    """How a mini-batch's keys map onto its distinct rows and its pooling bags.

    ``unique_keys[inverse[i]]`` is key ``i`` (after sorting keys by bag); ``bag_offsets`` are
    the start of each of the ``B * n_slots`` bags in that order, as ``F.embedding_bag`` wants.
    """

    unique_keys: np.ndarray  # uint64[U]
    inverse: np.ndarray  # int64[nnz], into unique_keys, keys in bag order
    bag_offsets: np.ndarray  # int64[B * n_slots]
    n_examples: int
    n_slots: int

    @staticmethod
    def of(batch: Batch) -> "BagLayout":
        bag = batch.bag_index()
        keys = batch.keys
        if bag.size > 1 and np.any(bag[1:] < bag[:-1]):  # keys of an example not in slot order
            order = np.argsort(bag, kind="stable")
            bag, keys = bag[order], keys[order]
        unique_keys, inverse = np.unique(keys, return_inverse=True)
        n_bags = len(batch) * batch.n_slots
        counts = np.bincount(bag, minlength=n_bags)
        offsets = np.zeros(n_bags, dtype=np.int64)
        np.cumsum(counts[:-1], out=offsets[1:])
        return BagLayout(unique_keys, inverse.astype(np.int64), offsets, len(batch), batch.n_slots)


def pool_sum(rows: torch.Tensor, layout: BagLayout) -> torch.Tensor:
    """Sum-pooled embeddings ``[B, n_slots, dim]`` of ``rows`` (``[U, dim]``, one per distinct key).

    Differentiable in ``rows``; an empty bag pools to zeros. On CPU the gradient of ``rows``
    comes from :func:`_bag_grad` (one pass over the bags) instead of torch's dense
    embedding-bag backward, which sorts the indices first (~4x the time at 100 keys/example).
    """
    if rows.requires_grad and not rows.is_cuda:
        pooled = _PoolSum.apply(rows, layout)
    else:
        pooled = F.embedding_bag(
            torch.from_numpy(layout.inverse), rows, torch.from_numpy(layout.bag_offsets), mode="sum"
        )
    return pooled.view(layout.n_examples, layout.n_slots, rows.shape[1])


class _PoolSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, layout: BagLayout) -> torch.Tensor:
        ctx.layout, ctx.n_rows = layout, rows.shape[0]
        return F.embedding_bag(torch.from_numpy(layout.inverse), rows.detach(),
                               torch.from_numpy(layout.bag_offsets), mode="sum")

    @staticmethod
    def backward(ctx, grad_pooled: torch.Tensor):
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
