"""DeepFM (Guo et al. 2017) and Wide & Deep (Cheng et al. 2016) over embedding rows and
first-order rows of their own.

Both models need, per key, a first-order weight ``w_i`` as well as an embedding ``v_i``. The
weights are rows of width 1 in a table of their own, the first-order table
(:mod:`hpsray.first_order`): each slot of the data is read again as a slot of that table, after
the data's slots. So the model takes ``n_slots = n + c`` slots: ``n`` slots of embeddings (one
``dim`` for all), then ``c`` first-order slots of width 1, whose sum pooling makes each the slot's
``sum_i w_i x_i`` (binary features), the first-order term, exactly. Each table keeps its own
optimizer state: ``adagrad_row``'s accumulator of ``w_i`` is its own, not shared with ``v_i``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from hpsray.models.mlp import mlp


class WideDeep(nn.Module):
    """``forward(pooled, dense [B, n_dense]) -> logits [B]``: a wide linear part (the keys'
    first-order weights and a linear map of the dense features, ``linear``) plus a deep MLP over
    the flattened embeddings and the dense features (``deep``), summed into one logit (the paper's
    eq. 3, without hand-made cross-product features).

    ``pooled`` is ``[B, n_slots, dim]`` (``dim`` 1) or ``[B, n * dim + first_order]``: the ``n =
    n_slots - first_order`` slots' embeddings, then the first-order slots' weights.

    Args:
        first_order: the last slots, first-order rows of width 1 (at least one).
        slot_dims: each slot's width (``dim`` for the first ``n``, 1 for the rest), or ``None``.
        hidden: widths of the deep MLP.
    """

    def __init__(
        self,
        n_slots: int,
        dim: int,
        n_dense: int,
        hidden: Sequence[int],
        first_order: int = 0,
        slot_dims: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.n_slots, self.dim, self.n_dense = n_slots, dim, n_dense
        self.first_order = first_order
        self.n_emb = n_slots - first_order
        if first_order < 1 or self.n_emb < 1:
            raise ValueError(
                f"{type(self).__name__}: needs first-order slots after the embeddings' (hpsray.first_order); "
                f"got {first_order} of {n_slots} slots"
            )
        if slot_dims is not None and tuple(slot_dims) != (dim,) * self.n_emb + (1,) * first_order:
            raise ValueError(
                f"{type(self).__name__}: slot_dims must be {self.n_emb} x {dim} then {first_order} x 1, "
                f"got {tuple(slot_dims)}"
            )
        with warnings.catch_warnings():  # no dense features (Avazu's logs): a weight of no element, the bias kept
            warnings.filterwarnings("ignore", "Initializing zero-element tensors", UserWarning)
            self.linear = nn.Linear(n_dense, 1)  # the dense features' first-order weights and the bias
        self.deep = mlp(self.n_emb * dim + n_dense, hidden, out=1)

    def split(self, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings [B, n, dim], first-order sum [B])`` of the model's input."""
        x = pooled.reshape(pooled.shape[0], -1)
        cut = self.n_emb * self.dim
        return x[:, :cut].view(-1, self.n_emb, self.dim), x[:, cut:].sum(dim=1)

    def interaction(self, v: torch.Tensor) -> torch.Tensor | float:
        """A term over the slots' embeddings ``v [B, n, dim]`` (none here)."""
        return 0.0

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        v, first = self.split(pooled)
        deep = self.deep(torch.cat([v.reshape(v.shape[0], -1), dense], dim=1)).squeeze(1)
        return self.linear(dense).squeeze(1) + first + self.interaction(v) + deep


class DeepFM(WideDeep):
    """``forward(pooled, dense [B, n_dense]) -> logits [B]`` (``pooled`` as :class:`WideDeep`
    takes it): the FM's first-order term (the keys' weights and a linear map of the dense
    features) plus its second-order term ``sum_{i<j} <v_i, v_j>`` over the slots' embeddings,
    plus a deep MLP over the flattened embeddings and the dense features: ``y = y_FM + y_DNN``
    (the paper's eq. 1).

    Args:
        hidden: widths of the deep MLP.
    """

    def interaction(self, v: torch.Tensor) -> torch.Tensor:
        """The FM's second-order term, ``((sum_i v_i)^2 - sum_i v_i^2) / 2`` summed over the factors."""
        return 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)
