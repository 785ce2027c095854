"""The paper's CTR model: sum-pooled slot embeddings + dense features → MLP → one logit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from hpsray.models.dense_optim import DenseOptimizer


class DNN(nn.Module):
    """MLP over the concatenation of per-slot pooled embeddings and dense features.

    ``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``. Any module with
    that signature can stand in for it. Weights are drawn from ``seed`` alone (not from the
    global torch RNG), so every replica of the model starts identical. With ``slot_dims``
    (tables of several widths, :mod:`hpsray.tables`) ``pooled`` is ``[B, sum(slot_dims)]``: the
    slots' pooled embeddings concatenated in slot order.
    """

    def __init__(
        self,
        n_slots: int,
        dim: int,
        n_dense: int,
        hidden: Sequence[int] = (512, 256, 128),
        seed: int = 0,
        slot_dims: Sequence[int] | None = None,
    ):
        super().__init__()
        if n_slots < 1 or dim < 1 or n_dense < 0 or any(h < 1 for h in hidden):
            raise ValueError(
                "DNN: need n_slots, dim >= 1, n_dense >= 0, hidden widths >= 1; "
                f"got {n_slots}, {dim}, {n_dense}, {tuple(hidden)}"
            )
        self.n_slots, self.dim, self.n_dense = n_slots, dim, n_dense
        layers: list[nn.Module] = []
        width = input_width(n_slots, dim, n_dense, slot_dims)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for h in hidden:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            layers.append(nn.Linear(width, 1))
            self.mlp = nn.Sequential(*layers)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat([pooled.reshape(pooled.shape[0], -1), dense], dim=1)
        return self.mlp(x).squeeze(1)


def input_width(n_slots: int, dim: int, n_dense: int, slot_dims: Sequence[int] | None) -> int:
    """Width of ``[flattened pooled embeddings, dense]``: ``n_slots * dim`` embedding floats, or
    ``sum(slot_dims)`` when the slots' widths are given."""
    if slot_dims is None:
        return n_slots * dim + n_dense
    if len(slot_dims) != n_slots or any(d < 1 for d in slot_dims):
        raise ValueError(f"slot_dims: need {n_slots} widths >= 1, got {tuple(slot_dims)}")
    return sum(slot_dims) + n_dense


def make_dense_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float) -> DenseOptimizer:
    """The optimizer of the replicated dense parameters: ``adam``, ``adagrad`` or ``sgd``
    (:class:`~hpsray.models.dense_optim.DenseOptimizer`: torch's multi-tensor arithmetic, bit for
    bit; the chunked aggregation's owner-side optimizer reproduces it). Every trainer and the
    reference build theirs here, so they step alike."""
    return DenseOptimizer(name, params, lr)
