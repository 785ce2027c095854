"""DeepFM (Guo et al. 2017) and Wide & Deep (Cheng et al. 2016) over rows that carry a key's
first-order weight beside its embedding.

Both models need, per key, a first-order weight ``w_i`` as well as an embedding ``v_i``. Until
tables of their own widths exist, a row of width ``dim`` holds both: its first ``dim - 1`` floats
are ``v_i`` and its last is ``w_i``. Sum pooling makes ``pooled[..., -1]`` the slot's
``sum_i w_i x_i`` (binary features), the first-order term, exactly; the sparse optimizer updates
``w_i`` as it updates ``v_i`` (per element for SGD, Adagrad and Adam; Adagrad per row shares one
accumulator across the row)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hpsray.models.mlp import mlp


def _split(pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embeddings [B, S, dim-1], first-order sum [B])`` of rows laid out as the module says."""
    return pooled[..., :-1], pooled[..., -1].sum(dim=1)


class WideDeep(nn.Module):
    """``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``: a wide linear part
    (the keys' first-order weights and a linear map of the dense features, ``linear``) plus a deep
    MLP over the flattened embeddings and the dense features (``deep``), summed into one logit (the
    paper's eq. 3, without hand-made cross-product features).

    Args:
        hidden: widths of the deep MLP.
    """

    def __init__(self, n_slots: int, dim: int, n_dense: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.n_slots, self.dim, self.n_dense = n_slots, dim, n_dense
        if dim < 2:
            raise ValueError(
                f"{type(self).__name__}: dim must be >= 2 (dim - 1 embedding floats and one first-order weight), "
                f"got {dim}"
            )
        self.linear = nn.Linear(n_dense, 1)  # the dense features' first-order weights and the bias
        self.deep = mlp(n_slots * (dim - 1) + n_dense, hidden, out=1)

    def interaction(self, v: torch.Tensor) -> torch.Tensor | float:
        """A term over the slots' embeddings ``v [B, S, dim-1]`` (none here)."""
        return 0.0

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        v, first = _split(pooled)
        deep = self.deep(torch.cat([v.reshape(v.shape[0], -1), dense], dim=1)).squeeze(1)
        return self.linear(dense).squeeze(1) + first + self.interaction(v) + deep


class DeepFM(WideDeep):
    """``forward(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``: the FM's first-order
    term (the keys' weights and a linear map of the dense features) plus its second-order term
    ``sum_{i<j} <v_i, v_j>`` over the slots' embeddings, plus a deep MLP over the flattened
    embeddings and the dense features: ``y = y_FM + y_DNN`` (the paper's eq. 1).

    Args:
        hidden: widths of the deep MLP.
    """

    def interaction(self, v: torch.Tensor) -> torch.Tensor:
        """The FM's second-order term, ``((sum_i v_i)^2 - sum_i v_i^2) / 2`` summed over the factors."""
        return 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)
