"""One mini-batch step of a CTR model whose sparse rows live outside PyTorch.

The caller fetches the rows of the mini-batch's distinct keys (from the reference's arrays or
from HBM-PS tables) and applies the returned sparse gradients with the shared optimizer math;
this module does the part in between, identically for every trainer: pool, forward, loss,
backward, dense optimizer step.

With ``D`` dense replicas (one per device, paper App. C.4) each replica takes a contiguous
slice of the mini-batch and its loss is scaled by the whole mini-batch's size, so the summed
replica gradients equal the single-replica gradient; every replica then steps with that sum and
the replicas stay identical.
"""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.models.dnn import make_dense_optimizer
from hpsray.models.pooling import BagLayout, pool_sum


class DenseReplicas:
    """``n`` identical copies of a model, each with its own dense optimizer, kept in lockstep."""

    def __init__(self, model: torch.nn.Module, n: int, optimizer: str, lr: float) -> None:
        if n < 1:
            raise ValueError(f"need at least one dense replica, got {n}")
        self.models = [model] + [copy.deepcopy(model) for _ in range(n - 1)]
        self.optimizers = [make_dense_optimizer(optimizer, m.parameters(), lr) for m in self.models]

    def __len__(self) -> int:
        return len(self.models)

    def train(self, mode: bool = True) -> None:
        for m in self.models:
            m.train(mode)

    def step(
        self, mb: Batch, weights_of: Callable[[np.ndarray], np.ndarray]
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """Forward/backward over ``mb`` and one dense optimizer step.

        ``weights_of(unique_keys)`` returns ``float32[U, dim]`` embedding weights. Returns the
        mini-batch's mean loss and ``(keys, grads)`` of the sparse gradient; keys may repeat
        across replicas, whose gradients the tables sum before they apply them.
        """
        n_total = len(mb)
        bounds = np.linspace(0, n_total, len(self.models) + 1).astype(int)
        loss_sum = 0.0
        keys_out, grads_out = [], []
        for model, lo, hi in zip(self.models, bounds[:-1], bounds[1:]):
            if hi <= lo:
                continue
            part = mb.slice(lo, hi)
            layout = BagLayout.of(part)
            emb = torch.from_numpy(np.ascontiguousarray(weights_of(layout.unique_keys))).requires_grad_(True)
            # torch.tensor copies: batches from the object store are read-only views
            logits = model(pool_sum(emb, layout), torch.tensor(part.dense))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, torch.tensor(part.labels), reduction="sum"
            ) / n_total
            model.zero_grad(set_to_none=True)
            loss.backward()
            loss_sum += float(loss.detach())
            keys_out.append(layout.unique_keys)
            grads_out.append(emb.grad.numpy())
        self._allreduce_and_step()
        return loss_sum, np.concatenate(keys_out), np.concatenate(grads_out)

    def _allreduce_and_step(self) -> None:
        if len(self.models) > 1:
            params = [list(m.parameters()) for m in self.models]
            for group in zip(*params):
                grads = [p.grad for p in group if p.grad is not None]
                if not grads:
                    continue
                total = torch.stack(grads).sum(0)
                for p in group:
                    p.grad = total.clone()
        for opt in self.optimizers:
            opt.step()
