"""One mini-batch step of a CTR model whose sparse rows live outside PyTorch.

The caller fetches the rows of the mini-batch's distinct keys (from the reference's arrays or
from HBM-PS tables) and applies the returned sparse gradients with the shared optimizer math;
this module does the part in between, identically for every trainer: pool, forward, loss,
backward, dense optimizer step.

The step runs on a :class:`~hpsray.models.device.StepDevice`: on CUDA the keys are
deduplicated on the device (CuPy), the rows come from the tables as device arrays, pooling, the
model, the loss and the backward pass run there, and the sparse gradients go back to the tables
as device arrays; only the mini-batch's keys, dense features and labels go in, and the loss
stays a device tensor until the caller reads it.

With ``D`` dense replicas (one per device, paper App. C.4) each replica takes a contiguous
slice of the mini-batch and its loss is scaled by the whole mini-batch's size, so the summed
replica gradients equal the single-replica gradient; every replica then steps with that sum and
the replicas stay identical.

**The fused sparse path.** When ``weights_of`` looks rows up in a table that has one (an
:class:`~hpsray.tiers.hbm.HbmPS` of one table: the trainer's), the step takes it
(:mod:`hpsray.kernels.fused`): it asks ``weights_of`` once per step with an empty probe, and
the table answers with its path. Then the keys are probed and sum-pooled per bag in one pass
(no sort of the keys, no gather of rows), the pooled sums go into the model as a leaf tensor,
and the pooled gradient is summed per distinct row in one more pass; the returned keys are
then distinct but in no particular order, and ``HbmPS.apply_gradients`` applies them at the
slots the forward pass found. The arithmetic is the unfused path's (bags and rows sum in bag
order from zero), so both give bit-equal results.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.kernels.fused import lookup_probe
from hpsray.models.device import StepDevice
from hpsray.models.dnn import make_dense_optimizer
from hpsray.models.pooling import BagLayout, pool_sum


class DenseReplicas:
    """``n`` identical copies of a model, each with its own dense optimizer, kept in lockstep,
    on ``device`` (the CPU when ``None``; the model is moved there)."""

    def __init__(
        self, model: torch.nn.Module, n: int, optimizer: str, lr: float, device: StepDevice | None = None
    ) -> None:
        if n < 1:
            raise ValueError(f"need at least one dense replica, got {n}")
        self.device = device or StepDevice("cpu")
        model.to(self.device.torch)
        self.models = [model] + [copy.deepcopy(model) for _ in range(n - 1)]
        self.optimizers = [make_dense_optimizer(optimizer, m.parameters(), lr) for m in self.models]
        self._unfused: tuple[Any, int] | None = None  # the last bound method that had no fused path

    def _fused_path(self, weights_of: Callable[[Any], Any]) -> Any:
        """The fused path behind ``weights_of``, or ``None`` (see the module docstring). A bound
        method that answered ``None`` is not asked again (its probe may be a remote call); a
        wrong "no" would only cost speed, never change a result."""
        method = getattr(weights_of, "__func__", None), id(getattr(weights_of, "__self__", None))
        if method[0] is not None and method == self._unfused:
            return None
        fused = getattr(weights_of(lookup_probe()), "lookup", None)
        if fused is None and method[0] is not None:
            self._unfused = method
        return fused

    def __len__(self) -> int:
        return len(self.models)

    def train(self, mode: bool = True) -> None:
        for m in self.models:
            m.train(mode)

    def step(
        self,
        mb: Batch,
        weights_of: Callable[[Any], Any],
        total: int | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Any, Any]:
        """Forward/backward over ``mb`` and one dense optimizer step.

        ``weights_of(unique_keys)`` returns ``float32[U, dim]`` embedding weights for sorted
        distinct keys given in the device's array module (numpy or CuPy; any array torch can
        take without a copy on that device). Returns the mini-batch's loss as a 0-d tensor on
        the device (its share of the mean over ``total`` examples, default ``len(mb)``; read it
        with ``float()`` when needed, which waits for the device) and ``(keys, grads)`` of the
        sparse gradient in the device's array module; keys may repeat across replicas, whose
        gradients the tables sum before they apply them. On the fused path (module docstring)
        each replica's keys are distinct but in no particular order.

        Across nodes, ``mb`` is this node's part of a global mini-batch of ``total`` examples
        (possibly empty) and ``reduce(flat)`` sums the flattened dense gradient over the nodes
        before every replica steps with it.
        """
        dev, xp = self.device, self.device.xp
        n_total = total if total is not None else len(mb)
        bounds = np.linspace(0, len(mb), len(self.models) + 1).astype(int)
        loss_sum = torch.zeros((), device=dev.torch)
        keys_out, grads_out = [], []
        for model in self.models:  # a replica whose slice is empty must not keep old gradients
            model.zero_grad(set_to_none=True)
        fused = self._fused_path(weights_of)
        for model, lo, hi in zip(self.models, bounds[:-1], bounds[1:]):
            if hi <= lo:
                continue
            part = mb.slice(lo, hi)
            if fused is not None:
                bags = fused.forward(part)
                leaf = dev.tensor(bags.pooled).requires_grad_(True)  # d loss / d pooled lands here
                pooled = leaf.view(len(part), part.n_slots, leaf.shape[1])
            else:
                layout = BagLayout.of(part, xp)
                leaf = dev.tensor(weights_of(layout.unique_keys)).requires_grad_(True)
                pooled = pool_sum(leaf, layout)
            logits = model(pooled, dev.tensor(part.dense))
            loss = (
                torch.nn.functional.binary_cross_entropy_with_logits(logits, dev.tensor(part.labels), reduction="sum")
                / n_total
            )
            loss.backward()
            loss_sum = loss_sum + loss.detach()
            assert leaf.grad is not None  # backward reached the leaf
            if fused is not None:
                keys, grads = fused.backward(bags, dev.from_tensor(leaf.grad))
            else:
                keys, grads = layout.unique_keys, dev.from_tensor(leaf.grad)
            keys_out.append(keys)
            grads_out.append(grads)
        empty = None
        if not keys_out:  # this node's part of the global mini-batch is empty
            # weights_of is asked before reduce, as on a step with examples: both may be
            # collectives (a device mesh) that every process must call in one order
            no_keys = xp.empty(0, dtype=xp.uint64)
            empty = no_keys, xp.zeros((0, weights_of(no_keys).shape[1]), dtype=xp.float32)
        self.step_optimizers(reduce)
        if empty is not None:
            return loss_sum, *empty
        if len(keys_out) == 1:
            return loss_sum, keys_out[0], grads_out[0]
        return loss_sum, xp.concatenate(keys_out), xp.concatenate(grads_out)

    def zero_grad(self) -> None:
        """Forget every replica's gradients (a replica without examples must not keep old ones)."""
        for model in self.models:
            model.zero_grad(set_to_none=True)

    def step_optimizers(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Step every replica's dense optimizer with the replicas' summed gradient, first summed
        over the nodes by ``reduce(flat)`` when given."""
        if reduce is not None:
            self._reduce_across_nodes(reduce)
        elif len(self.models) > 1:
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

    def _reduce_across_nodes(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the replicas' gradients locally, then over nodes with ``reduce``, and give every
        replica the total (zeros stand in for parameters without a gradient)."""
        groups = list(zip(*[list(m.parameters()) for m in self.models]))
        if len(self.models) == 1 and all(g[0].grad is not None for g in groups):  # one replica: its gradients
            flat = torch.cat([g[0].grad.reshape(-1) for g in groups if g[0].grad is not None])
        else:
            flat = torch.cat(
                [
                    sum((p.grad for p in group if p.grad is not None), torch.zeros_like(group[0])).reshape(-1)
                    for group in groups
                ]
            )
        total = reduce(flat)
        for group in groups:
            n = group[0].numel()
            chunk, total = total[:n].view_as(group[0]), total[n:]
            for p in group:  # one replica takes its part of the sum as it is (nothing else writes it)
                p.grad = chunk if len(group) == 1 else chunk.clone()
