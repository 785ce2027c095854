"""``Trainer``: a node's HBM-PS working set and its dense model replicas, training batches."""

from __future__ import annotations

import os

import numpy as np
import torch

from hpsray.config import TrainConfig
from hpsray.models.dnn import DNN
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.models.step import DenseReplicas
from hpsray.actors.timing import StageClock
from hpsray.tiers.hbm import HbmPS


class Trainer:
    """Trains each batch on its working set (paper Algorithm 1, step 4).

    Args:
        node, n_nodes: this node and how many there are (for the device hash).
        config: model shape, optimizers, mini-batch size, seed.
        n_slots, n_dense: input shape.
        capacity: rows the working set of two consecutive batches may hold.
        n_devices: ``D`` device tables and dense replicas ("virtual devices" on CPU).
        device: ``"cpu"`` or ``"cuda"`` kernels.
        model: a module ``(pooled [B, n_slots, dim], dense) -> logits``; the DNN when ``None``.
        threads: torch intra-op threads (default: all cores).
    """

    def __init__(self, node: int, n_nodes: int, config: TrainConfig, n_slots: int, n_dense: int, capacity: int,
                 n_devices: int = 1, device: str = "cpu", model: torch.nn.Module | None = None,
                 threads: int | None = None) -> None:
        self.node, self.config = node, config  # first, so repr() works if the rest fails
        torch.set_num_threads(threads or os.cpu_count() or 1)
        self.optimizer = config.optimizer()
        self.hbm = HbmPS(capacity, config.row_width, config.row_init(), n_devices, n_nodes, device)
        model = model if model is not None else DNN(n_slots, config.dim, n_dense, config.hidden, seed=config.seed)
        self.dense = DenseReplicas(model, n_devices, config.dense_optimizer, config.dense_lr)
        self.step = 0
        self.examples = 0
        self.losses: dict = {}
        self.clock = StageClock("train", node)

    def __repr__(self) -> str:
        return f"Trainer[node {self.node}]"

    def train(self, batch_id, batch, keys: np.ndarray, rows: np.ndarray) -> dict:
        """Insert the working set, train every mini-batch, return the batch's updated rows."""
        with self.clock.timed(batch_id):
            self.hbm.insert(keys, rows)  # rows resident from the previous batch are fresher
            self.hbm.retain(keys)
            dim = self.config.dim
            self.dense.train(True)
            losses = []
            for mb in batch.minibatches(self.config.minibatch_size):
                loss, gkeys, grads = self.dense.step(mb, lambda k: self.hbm.get(k)[:, :dim])
                self.step += 1
                self.hbm.apply_gradients(gkeys, grads, self.optimizer, self.step)
                losses.append(loss)
            self.examples += len(batch)
            self.losses[batch_id] = float(np.mean(losses)) if losses else float("nan")
            return {"keys": keys, "rows": self.hbm.export(keys), "loss": self.losses[batch_id]}

    @torch.no_grad()
    def predict(self, batch, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Click probabilities of ``batch`` given the rows of its distinct ``keys`` (sorted)."""
        model = self.dense.models[0]
        model.eval()
        out = []
        dim = self.config.dim
        for mb in batch.minibatches(self.config.minibatch_size):
            layout = BagLayout.of(mb)
            emb = torch.from_numpy(np.ascontiguousarray(rows[np.searchsorted(keys, layout.unique_keys), :dim]))
            out.append(torch.sigmoid(model(pool_sum(emb, layout), torch.tensor(mb.dense))).numpy())
        return np.concatenate(out) if out else np.empty(0, np.float32)

    def dense_state(self) -> dict:
        """The dense model's parameters (replica 0; all replicas are equal)."""
        return {k: v.detach().clone() for k, v in self.dense.models[0].state_dict().items()}

    def replicas_equal(self) -> bool:
        ref = self.dense.models[0].state_dict()
        return all(torch.equal(ref[k], m.state_dict()[k]) for m in self.dense.models[1:] for k in ref)

    def stats(self) -> dict:
        return {**self.clock.snapshot(), "examples": self.examples, "steps": self.step, "losses": dict(self.losses)}
