"""Plain PyTorch peer: every row in one ``nn.EmbeddingBag(mode="sum", sparse=True)``.

The table is indexed by the dense row of each key (:class:`~hpsray.bench.baselines.Vocabulary`,
computed once as preprocessing, like any integer-encoded CTR data set); sparse gradients go to
``torch.optim.Adagrad`` (or ``SparseAdam`` / ``SGD`` for hpsray's ``adam`` / ``sgd``), whose
update is hpsray's row update (``a += g*g; w -= lr * g / (sqrt(a) + eps)``). Rows start from
hpsray's per-key initial values and the dense model is the same seeded kind (``spec.model``), so
with the same mini-batches it trains the same parameters as the reference trainer. With
``spec.device = "cuda"`` the table, the model and the prepared mini-batches live on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpsray.bench.baselines import PeerSpec, Vocabulary, load_examples, peak_rss_bytes, peer_result, split, write_result
from hpsray.config import TrainConfig
from hpsray.data.batch import Batch
from hpsray.kernels.optim import Adagrad, Adam
from hpsray.models.dnn import make_dense_optimizer
from hpsray.models.kinds import build_model


@dataclass
class IndexedBatch:
    """A mini-batch as ``nn.EmbeddingBag`` input: rows in bag order and each bag's start."""

    indices: torch.Tensor  # int64[nnz]
    offsets: torch.Tensor  # int64[B * n_slots]
    dense: torch.Tensor  # float32[B, n_dense]
    labels: torch.Tensor  # float32[B]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device) -> IndexedBatch:
        return IndexedBatch(
            self.indices.to(device), self.offsets.to(device), self.dense.to(device), self.labels.to(device)
        )


def index_batch(batch: Batch, vocab: Vocabulary) -> IndexedBatch:
    """Turn ``batch``'s keys into table rows grouped by ``(example, slot)`` bag."""
    bag = batch.bag_index()
    keys = batch.keys
    if bag.size > 1 and np.any(bag[1:] < bag[:-1]):
        order = np.argsort(bag, kind="stable")
        bag, keys = bag[order], keys[order]
    return IndexedBatch(
        torch.from_numpy(vocab.index(keys)),
        torch.from_numpy(batch.bag_offsets(bag)),
        torch.from_numpy(np.array(batch.dense, dtype=np.float32)),
        torch.from_numpy(np.array(batch.labels, dtype=np.float32)),
    )


class PlainTorchCTR(nn.Module):
    """``nn.EmbeddingBag`` (sum, sparse gradients) under the model ``config`` names
    (:func:`~hpsray.models.kinds.build_model`: the same module and weights as hpsray's)."""

    def __init__(self, weights: torch.Tensor, n_slots: int, n_dense: int, config: TrainConfig):
        super().__init__()
        n_rows, dim = weights.shape
        self.n_slots, self.dim = n_slots, dim
        self.embedding = nn.EmbeddingBag(n_rows, dim, mode="sum", sparse=True, _weight=weights)
        self.dnn = build_model(config, n_slots, n_dense)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.embedding(indices, offsets).view(-1, self.n_slots, self.dim)
        return self.dnn(pooled, dense)


def sparse_optimizer(config: TrainConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer with the math of ``config``'s sparse optimizer (sparse gradients)."""
    opt = config.optimizer()
    name = config.sparse_optimizer.lower()
    if name == "adagrad" and isinstance(opt, Adagrad):
        return torch.optim.Adagrad(params, lr=opt.lr, eps=opt.eps, initial_accumulator_value=opt.initial_accumulator)
    if name == "adam" and isinstance(opt, Adam):
        return torch.optim.SparseAdam(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    if name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr)
    raise ValueError(
        f"plain PyTorch has no sparse optimizer for {config.sparse_optimizer!r} "
        "(torch.optim offers adagrad, adam (SparseAdam) and sgd for sparse gradients)"
    )


class PlainTorchTrainer:
    """Mini-batch training of :class:`PlainTorchCTR` with a sparse and a dense optimizer.

    Args:
        weights: ``float32[rows, dim]`` initial table (see :meth:`Vocabulary.initial_weights`).
        n_slots, n_dense: input shape.
        config: model shape, optimizers, seed (its ``minibatch_size`` is not used here: the
            caller hands over :class:`IndexedBatch` mini-batches).
    """

    def __init__(
        self, weights: np.ndarray, n_slots: int, n_dense: int, config: TrainConfig, device: str = "cpu"
    ) -> None:
        self.config = config
        self.model = PlainTorchCTR(
            torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)),
            n_slots,
            n_dense,
            config,
        ).to(device)
        self.sparse = sparse_optimizer(config, [self.model.embedding.weight])
        self.dense = make_dense_optimizer(config.dense_optimizer, self.model.dnn.parameters(), config.dense_lr)
        self.steps = 0

    def train_minibatch(self, mb: IndexedBatch) -> torch.Tensor:
        """One gradient step; returns the mini-batch's mean loss before it (a 0-d tensor on the
        model's device: reading it waits for the device)."""
        self.model.train()
        logits = self.model(mb.indices, mb.offsets, mb.dense)
        loss = F.binary_cross_entropy_with_logits(logits, mb.labels)
        self.sparse.zero_grad(set_to_none=True)
        self.dense.zero_grad(set_to_none=True)
        loss.backward()
        self.sparse.step()
        self.dense.step()
        self.steps += 1
        return loss.detach()

    def fit(self, minibatches: Iterable[IndexedBatch]) -> int:
        """Train on each mini-batch in order; returns the number of examples."""
        examples = 0
        for mb in minibatches:
            self.train_minibatch(mb)
            examples += len(mb)
        return examples

    @torch.no_grad()
    def predict(self, mb: IndexedBatch) -> np.ndarray:
        """Click probabilities of ``mb``'s examples."""
        self.model.eval()
        return torch.sigmoid(self.model(mb.indices, mb.offsets, mb.dense)).cpu().numpy()

    def export(self) -> tuple[np.ndarray, dict]:
        """``(table float32[rows, dim], dense state_dict)``."""
        return (
            self.model.embedding.weight.detach().cpu().numpy().copy(),
            {k: v.detach().cpu().clone() for k, v in self.model.dnn.state_dict().items()},
        )


def minibatches(batch: Batch, vocab: Vocabulary, spec: PeerSpec, start: int, stop: int) -> list[IndexedBatch]:
    """Indexed mini-batches of ``batch[start:stop]`` in hpsray's order (batches of ``spec.batch``
    examples, each cut into mini-batches of ``spec.minibatch``)."""
    device = torch.device(spec.device)
    return [
        index_batch(mb, vocab).to(device)
        for big in split(batch, spec.batch, start, stop)
        for mb in big.minibatches(spec.minibatch)
    ]


def _synchronize(spec: PeerSpec) -> None:
    """Wait for the device's queued work (a timing on CUDA ends when the work does)."""
    if spec.device == "cuda":
        torch.cuda.synchronize()


def _use_threads(spec: PeerSpec) -> None:
    """torch's intra-op threads for this run: ``spec.threads``, else every core."""
    import os

    torch.set_num_threads(spec.threads or os.cpu_count() or 1)


def run_peer(spec: PeerSpec) -> dict:
    """Train and evaluate the plain PyTorch peer on ``spec``'s stored examples; returns its figures."""
    _use_threads(spec)
    t_prep = time.perf_counter()
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    trainer = PlainTorchTrainer(
        vocab.initial_weights(spec), spec.n_slots, spec.n_dense, spec.train_config(), spec.device
    )
    train = load_examples(spec, "train")
    warmup = minibatches(train, vocab, spec, 0, spec.warmup_rows)
    measured = minibatches(train, vocab, spec, spec.warmup_rows, spec.warmup_rows + spec.rows)
    held_out = [
        index_batch(mb, vocab).to(torch.device(spec.device))
        for mb in load_examples(spec, "eval").minibatches(spec.minibatch)
    ]
    del train
    prep_s = time.perf_counter() - t_prep

    trainer.fit(warmup)
    _synchronize(spec)
    t0 = time.perf_counter()
    examples = trainer.fit(measured)
    _synchronize(spec)
    train_s = time.perf_counter() - t0

    y = np.concatenate([mb.labels.cpu().numpy() for mb in held_out])
    p = np.concatenate([trainer.predict(mb) for mb in held_out])
    return {
        **peer_result(examples, train_s, y, p, prep_s, len(vocab)),
        "sparse_optimizer": type(trainer.sparse).__name__,
        "threads": torch.get_num_threads(),
    }


def _pooled(
    table: nn.EmbeddingBag, train: Batch, vocab: Vocabulary, spec: PeerSpec, start: int, stop: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(pooled embeddings, dense features, labels)`` of each mini-batch of ``train[start:stop]``."""
    with torch.no_grad():
        return [
            (table(mb.indices, mb.offsets).view(-1, spec.n_slots, spec.dim), mb.dense, mb.labels)
            for mb in minibatches(train, vocab, spec, start, stop)
        ]


def run_mlp_alone(spec: PeerSpec) -> dict:
    """The bound every system shares: the dense model alone on the same mini-batches.

    Each timed step is what every peer's step contains besides its sparse work: the
    dense model's forward, the loss, the backward *including* the gradient of the pooled
    embeddings (every system needs it for its rows), and the dense optimizer step. The pooled
    inputs are the initial table's sums, computed before the clock. No system can train faster
    than this; ``examples_per_s`` of a system over this one is the share of its time spent on
    the dense model.
    """
    _use_threads(spec)
    t_prep = time.perf_counter()
    vocab = Vocabulary(spec.n_slots, spec.keys_per_slot)
    table = nn.EmbeddingBag.from_pretrained(
        torch.from_numpy(np.ascontiguousarray(vocab.initial_weights(spec), dtype=np.float32)), mode="sum"
    ).to(spec.device)
    train = load_examples(spec, "train")
    config = spec.train_config()
    dnn = build_model(config, spec.n_slots, spec.n_dense).to(spec.device)
    opt = make_dense_optimizer(config.dense_optimizer, dnn.parameters(), config.dense_lr)

    def fit(steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
        examples = 0
        for pooled, dense, labels in steps:
            pooled = pooled.detach().requires_grad_(True)
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(dnn(pooled, dense), labels).backward()
            opt.step()
            examples += len(labels)
        return examples

    warmup = _pooled(table, train, vocab, spec, 0, spec.warmup_rows)
    measured = _pooled(table, train, vocab, spec, spec.warmup_rows, spec.warmup_rows + spec.rows)
    del train, table  # free them
    prep_s = time.perf_counter() - t_prep
    fit(warmup)
    _synchronize(spec)
    t0 = time.perf_counter()
    examples = fit(measured)
    _synchronize(spec)
    train_s = time.perf_counter() - t0
    return {
        "examples_per_s": examples / train_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "examples": examples,
        "train_s": train_s,
        "prepare_s": prep_s,
        "threads": torch.get_num_threads(),
    }


def main(spec_json: str) -> None:
    """Entry point of the peer's own process: run and write the result file."""
    spec = PeerSpec.from_json(spec_json)
    write_result(spec, run_peer(spec))
