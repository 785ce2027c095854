"""In-memory sharded parameter server on Ray actors, without tiers (the paper's MPI-cluster baseline).

``K`` :class:`PSShard` actors each hold, in one numba hash table, every row of the keys with
``owner_of(key, K) == k`` (weights and optimizer state) and apply the sparse optimizer to the
gradients pushed to them. One :class:`PSTrainer` actor runs the model: for every mini-batch it
pulls the rows of its distinct keys from their owners (all shards at once), runs forward and
backward, and pushes each shard its keys' gradients. There is no batch-level working set, no
cache and no disk: every mini-batch pays a pull round trip.

BSP comes from Ray's ordering: a shard runs one caller's calls in submission order, so the pull
of mini-batch ``t + 1`` runs after the push of ``t``; the trainer never waits for a push.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray
import torch

from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.kernels import make_table
from hpsray.kernels.init import initial_rows
from hpsray.models.kinds import build_model
from hpsray.models.metrics import auc, logloss
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.models.step import DenseReplicas
from hpsray.tiers.partition import group_by, owner_of


class PSShard:
    """Shard ``shard`` of ``n_shards``: rows of its keys in memory, sparse optimizer applied here.

    Args:
        capacity: most rows this shard holds (its table does not grow).
    """

    def __init__(self, shard: int, n_shards: int, config: TrainConfig, capacity: int) -> None:
        self.shard, self.n_shards = shard, n_shards
        self.dim = config.dim
        self.init = config.row_init()
        self.optimizer = config.optimizer()
        self.table = make_table(capacity, config.row_width, self.init, device="cpu")
        self.busy_s = 0.0

    def __repr__(self) -> str:
        return f"PSShard[{self.shard}/{self.n_shards}]"

    def pull(self, keys: np.ndarray) -> np.ndarray:
        """Weights ``float32[n, dim]`` of ``keys``; keys never seen get their initial rows."""
        t0 = time.perf_counter()
        rows = self.table.gather(self.table.find_or_insert(keys))
        out = np.ascontiguousarray(rows[:, : self.dim])
        self.busy_s += time.perf_counter() - t0
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray, step: int) -> int:
        """Apply the summed gradients of ``keys`` (pulled before) at global step ``step``."""
        t0 = time.perf_counter()
        self.table.apply_gradients(keys, grads, self.optimizer, step)
        self.busy_s += time.perf_counter() - t0
        return int(keys.size)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Weights of ``keys`` for evaluation, without inserting (unseen keys: initial values)."""
        slots = self.table.find(keys)
        out = initial_rows(keys, self.dim, self.init)
        found = slots >= 0
        if found.any():
            out[found] = self.table.gather(slots[found])[:, : self.dim]
        return out

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row of this shard ``(keys, rows)`` (weights and optimizer state)."""
        return self.table.export()

    def stats(self) -> dict:
        return {"shard": self.shard, "rows": self.table.size, "busy_s": self.busy_s}


class PSTrainer:
    """The trainer process: pulls rows per mini-batch from the shards, trains, pushes gradients.

    Args:
        shards: the :class:`PSShard` actor handles, shard ``k`` at index ``k``.
        config: model shape, optimizers, mini-batch size, seed.
        n_slots, n_dense: input shape.
        threads: torch intra-op threads (default: all cores).
    """

    def __init__(
        self, shards: list, config: TrainConfig, n_slots: int, n_dense: int, threads: int | None = None
    ) -> None:
        torch.set_num_threads(threads or os.cpu_count() or 1)
        self.shards = list(shards)
        self.config = config
        model = build_model(config, n_slots, n_dense)
        self.dense = DenseReplicas(model, 1, config.dense_optimizer, config.dense_lr)
        self.step = 0
        self.examples = 0
        self.wait_s = 0.0  # time blocked on pulls
        self._pushes: list = []

    def __repr__(self) -> str:
        return f"PSTrainer[{len(self.shards)} shards]"

    def _by_shard(self, keys: np.ndarray) -> list[np.ndarray]:
        order, offsets = group_by(owner_of(keys, len(self.shards)), len(self.shards))
        return [order[offsets[k] : offsets[k + 1]] for k in range(len(self.shards))]

    def _pull(self, keys: np.ndarray, method: str = "pull") -> np.ndarray:
        parts = self._by_shard(keys)
        refs = [getattr(s, method).remote(keys[p]) for s, p in zip(self.shards, parts)]
        out = np.empty((keys.size, self.config.dim), dtype=np.float32)
        t0 = time.perf_counter()
        for p, rows in zip(parts, ray.get(refs)):
            out[p] = rows
        self.wait_s += time.perf_counter() - t0
        return out

    def _push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        for s, p in zip(self.shards, self._by_shard(keys)):
            if p.size:
                self._pushes.append(s.push.remote(keys[p], grads[p], self.step))

    def train_batch(self, batch: Batch) -> float:
        """Train every mini-batch of ``batch`` in order; returns the mean loss."""
        losses = []
        self.dense.train(True)
        for mb in batch.minibatches(self.config.minibatch_size):
            loss, keys, grads = self.dense.step(mb, self._pull)
            self.step += 1
            self._push(keys, grads)
            losses.append(float(loss))
        ray.get(self._pushes)  # surface a shard's error; bounds the refs held
        self._pushes = []
        self.examples += len(batch)
        return float(np.mean(losses)) if losses else float("nan")

    def fit(self, batch_refs: list) -> dict:
        """Train on each batch (ObjectRefs, passed inside a list) in order."""
        t0 = time.perf_counter()
        examples = 0
        for ref in batch_refs:
            batch = ray.get(ref)
            self.train_batch(batch)
            examples += len(batch)
        return {"examples": examples, "seconds": time.perf_counter() - t0, "steps": self.step}

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of ``batch``'s examples."""
        model = self.dense.models[0]
        model.eval()
        out = []
        for mb in batch.minibatches(self.config.minibatch_size):
            layout = BagLayout.of(mb)
            emb = torch.from_numpy(self._pull(layout.unique_keys, "lookup"))
            out.append(torch.sigmoid(model(pool_sum(emb, layout), torch.tensor(mb.dense))).numpy())
        return np.concatenate(out) if out else np.empty(0, np.float32)

    def evaluate(self, batch_refs: list) -> dict:
        labels, probs = [], []
        for ref in batch_refs:
            batch = ray.get(ref)
            labels.append(batch.labels)
            probs.append(self.predict(batch))
        y, p = np.concatenate(labels), np.concatenate(probs)
        return {"auc": auc(y, p), "logloss": logloss(y, p), "examples": int(y.size)}

    def dense_state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.dense.models[0].state_dict().items()}

    def stats(self) -> dict:
        return {"steps": self.step, "examples": self.examples, "pull_wait_s": self.wait_s}


class ShardedPS:
    """``n_shards`` :class:`PSShard` actors and one :class:`PSTrainer` actor on the local Ray.

    ``capacity`` is the number of rows the whole table may reach; each shard gets a share with
    head-room for uneven ownership.
    """

    def __init__(
        self,
        config: TrainConfig,
        n_slots: int,
        n_dense: int,
        capacity: int,
        n_shards: int = 2,
        threads: int | None = None,
    ) -> None:
        if n_shards < 1:
            raise ValueError(f"n_shards must be >= 1, got {n_shards}")
        per_shard = int(capacity / n_shards * 1.2) + 1024
        opts = dict(num_cpus=0, max_concurrency=1)
        self.config = config
        self.shards: list[Any] = [  # actor handles
            ray.remote(PSShard).options(**opts).remote(k, n_shards, config, per_shard) for k in range(n_shards)
        ]
        self.trainer: Any = ray.remote(PSTrainer).options(**opts).remote(self.shards, config, n_slots, n_dense, threads)

    def fit(self, batch_refs: list) -> dict:
        """Train on the batches behind ``batch_refs`` (ObjectRefs) in order."""
        return ray.get(self.trainer.fit.remote(list(batch_refs)))

    def evaluate(self, batch_refs: list) -> dict:
        return ray.get(self.trainer.evaluate.remote(list(batch_refs)))

    def export(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """``(keys sorted, rows, dense state_dict)``, as :meth:`ReferenceTrainer.export`."""
        parts = ray.get([s.export.remote() for s in self.shards])
        keys = np.concatenate([k for k, _ in parts])
        rows = np.concatenate([r for _, r in parts])
        order = np.argsort(keys)
        return keys[order], rows[order], ray.get(self.trainer.dense_state.remote())

    def actors(self) -> dict:
        out = {f"PSShard[{k}]": s for k, s in enumerate(self.shards)}
        out["PSTrainer"] = self.trainer
        return out

    def stats(self) -> dict:
        return {
            "trainer": ray.get(self.trainer.stats.remote()),
            "shards": ray.get([s.stats.remote() for s in self.shards]),
        }

    def shutdown(self) -> None:
        for a in self.actors().values():
            ray.kill(a)
