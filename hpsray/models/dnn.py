"""The paper's CTR model: sum-pooled slot embeddings + dense features → MLP → one logit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


class DNN(nn.Module):
    """MLP over the concatenation of per-slot pooled embeddings and dense features.

    ``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``. Any module with
    that signature can stand in for it. Weights are drawn from ``seed`` alone (not from the
    global torch RNG), so every replica of the model starts identical.
    """

    def __init__(self, n_slots: int, dim: int, n_dense: int, hidden: Sequence[int] = (512, 256, 128), seed: int = 0):
        super().__init__()
        if n_slots < 1 or dim < 1 or n_dense < 0 or any(h < 1 for h in hidden):
            raise ValueError(
                "DNN: need n_slots, dim >= 1, n_dense >= 0, hidden widths >= 1; "
                f"got {n_slots}, {dim}, {n_dense}, {tuple(hidden)}"
            )
        self.n_slots, self.dim, self.n_dense = n_slots, dim, n_dense
        layers: list[nn.Module] = []
        width = n_slots * dim + n_dense
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


def make_dense_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer of the replicated dense parameters: ``adam``, ``adagrad`` or ``sgd``.

    torch's multi-tensor (``foreach``) implementation: the single-tensor arithmetic, step for
    step (the chunked aggregation's owner-side optimizer reproduces it to the bit), issued as a
    few ops for all parameters instead of several per parameter (on CUDA, a few kernels).
    Every trainer and the reference build theirs here, so they step alike."""
    name = name.lower()
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    raise ValueError(f"unknown dense optimizer {name!r}; choose adam, adagrad or sgd")
