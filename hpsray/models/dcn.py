"""DCN-v2 (Wang et al. 2021, "DCN V2: Improved Deep & Cross Network"): cross layers
``x_{l+1} = x0 * (W_l x_l + b_l) + x_l`` over ``x0 = [flattened slot embeddings, dense]``, ``W_l``
full or low rank (``U_l V_l^T``, TorchRec's ``LowRankCrossNet``), with a deep MLP stacked on the
cross network or beside it (parallel), then one logit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hpsray.models.dnn import input_width
from hpsray.models.mlp import mlp, out_width

STRUCTURES = ("stacked", "parallel")


class CrossLayer(nn.Module):
    """One cross layer: ``x0 * (W x + b) + x``; ``W = U V^T`` of rank ``rank`` when given."""

    def __init__(self, width: int, rank: int | None) -> None:
        super().__init__()
        self.w: nn.Module = (
            nn.Linear(width, width)
            if rank is None
            else nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, width))
        )

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.w(x) + x


class DCN(nn.Module):
    """``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``.

    Args:
        cross_layers: how many cross layers.
        low_rank: the rank of each cross layer's matrix (``None``: full rank).
        structure: ``"stacked"`` (the deep MLP over the cross network's output) or ``"parallel"``
            (cross network and deep MLP side by side over ``x0``, their outputs concatenated).
        hidden: widths of the deep MLP.
        slot_dims: each slot's width when the tables' widths differ (:mod:`hpsray.tables`);
            ``pooled`` is then ``[B, sum(slot_dims)]``, the slots concatenated in slot order.
    """

    def __init__(
        self,
        n_slots: int,
        dim: int,
        n_dense: int,
        cross_layers: int,
        low_rank: int | None,
        structure: str,
        hidden: Sequence[int],
        slot_dims: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.n_slots, self.dim, self.n_dense = n_slots, dim, n_dense
        width = input_width(n_slots, dim, n_dense, slot_dims)
        self.structure = structure
        self.cross = nn.ModuleList(CrossLayer(width, low_rank) for _ in range(cross_layers))
        self.deep = mlp(width, hidden)
        deep_out = out_width(width, hidden)
        self.head = nn.Linear(deep_out if structure == "stacked" else width + deep_out, 1)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([pooled.reshape(pooled.shape[0], -1), dense], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        out = self.deep(x) if self.structure == "stacked" else torch.cat([x, self.deep(x0)], dim=1)
        return self.head(out).squeeze(1)
