"""DLRM (Naumov et al. 2019) as TorchRec's ``torchrec.models.dlrm.DLRM`` defines it: a bottom MLP
takes the dense features to an embedding of the slots' width; the pairwise dot products of that
embedding and the pooled slot embeddings (upper triangle, no diagonal) and the dense embedding
itself feed a top MLP that ends in one logit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hpsray.models.mlp import mlp


class DLRM(nn.Module):
    """``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``.

    Args:
        bottom: hidden widths of the bottom MLP; a last layer of width ``dim`` is added (TorchRec's
            ``dense_arch_layer_sizes`` ends in the embedding width; every layer has a ReLU). With
            ``n_dense == 0`` there is no bottom MLP and the interaction is over the slots alone.
        top: hidden widths of the top MLP (TorchRec's ``over_arch_layer_sizes`` without the final 1).
    """

    def __init__(self, n_slots: int, dim: int, n_dense: int, bottom: Sequence[int], top: Sequence[int]) -> None:
        super().__init__()
        self.n_slots, self.dim, self.n_dense = n_slots, dim, n_dense
        self.bottom = mlp(n_dense, [*bottom, dim]) if n_dense else None
        f = n_slots + (1 if n_dense else 0)
        self.rows: torch.Tensor
        self.cols: torch.Tensor
        rows, cols = torch.triu_indices(f, f, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.top = mlp((dim if n_dense else 0) + f * (f - 1) // 2, top, out=1)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        if self.bottom is None:
            features, head = pooled, []
        else:
            d = self.bottom(dense)
            features, head = torch.cat([d.unsqueeze(1), pooled], dim=1), [d]
        dots = torch.bmm(features, features.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([*head, dots], dim=1)).squeeze(1)
