"""The in-memory reference trainer: the oracle of every test and the baseline of benchmarks.

Single process, every row in host memory, plain PyTorch for the model. It uses the same row
initialiser (:func:`~hpsray.kernels.init.initial_rows`), the same sparse-optimizer math
(:func:`~hpsray.kernels.optim.apply_to_rows`) and the same model as the distributed system, but
none of its tables, tiers or actors: rows live in a sorted key array with a growable row
array. Tiering, pipelining, devices and nodes must not change what it computes (docs/architecture.md: invariant 1).

With ``admit_after`` / ``expire_after_batches`` it applies the pipeline's admission and expiry
rules (docs/architecture.md: Admission and expiry), stated here again on their own
(:class:`SeenCounts`, not the owner's table, so a bug in either shows as a difference): per
batch, its distinct keys are counted; a key not admitted trains the batch from its initial row
and its row is dropped at the batch's end; then the rows expiring at that end are dropped.

With ``TrainConfig.tables`` it holds one row store per table, ``stores[t]`` (``store`` is
``stores[0]``): :mod:`hpsray.reference_tables`.

The oracle stands apart from the system under test: it imports nothing from ``hpsray.tiers``,
``hpsray.actors`` or ``hpsray.pipelines`` (tests/test_reference.py checks it, transitively).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hpsray.config import TrainConfig, check_admission
from hpsray.data.batch import Batch
from hpsray.kernels.optim import apply_to_rows
from hpsray.models.kinds import build_model
from hpsray.models.metrics import auc, logloss
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.models.step import DenseReplicas
from hpsray.models.threads import torch_threads
from hpsray.reference_store import SortedRowStore
from hpsray.reference_tables import TableSplit, admission_of, predict_input, train_tables
from hpsray.tables import with_first_order

_NEVER = np.iinfo(np.int64).min  # "last seen" of a key not seen yet


class ShardedSource(Protocol):
    """What the reference reads: ``open(batch_size, reader_index, num_readers)`` gives one
    node's batches (the pipeline's sources are such)."""

    def open(self, batch_size: int, reader_index: int = 0, num_readers: int = 1) -> Iterator[Batch]: ...


class SeenCounts:
    """Admission and expiry as plain arrays: per key (kept sorted), in how many batches it was
    seen (capped at the count that admits it) and the last batch it was seen in.

    * ``see(b, keys)``: each distinct key counts once for batch ``b``; it is admitted once seen
      in ``max(admit_after, 1)`` batches, and stays admitted until it expires.
    * ``expire(b)``: at the end of batch ``b``, every key last seen in batch
      ``b - expire_after_batches`` or earlier is forgotten (its count starts again at its next
      sighting); returns those that were admitted, i.e. had rows, sorted. A batch already
      expired through returns nothing.

    ``stats`` counts what the owners report: ``admitted`` (keys given a row; again after
    expiring), ``rejected`` (a key's sightings in batches that gave it no row), ``expired`` (rows
    dropped), ``forgotten`` (counts of keys never admitted dropped) and ``tracked`` (keys counted).
    """

    def __init__(self, admit_after: int = 0, expire_after_batches: int | None = None) -> None:
        check_admission(admit_after, expire_after_batches)  # the pipeline's checks, the same errors
        self.need = max(int(admit_after), 1)
        self.expire_after = None if expire_after_batches is None else int(expire_after_batches)
        self.enabled = int(admit_after) > 1 or self.expire_after is not None
        self.keys = np.empty(0, dtype=np.uint64)  # sorted
        self.count = np.empty(0, dtype=np.int64)
        self.last = np.empty(0, dtype=np.int64)
        self.expired_through: int | None = None
        self.totals = {"admitted": 0, "rejected": 0, "expired": 0, "forgotten": 0}

    @property
    def stats(self) -> dict[str, int]:
        return {**self.totals, "tracked": int(self.keys.size)}

    def see(self, batch: int, keys: np.ndarray) -> np.ndarray:
        """Count sorted distinct ``keys`` as seen in ``batch``; returns which are admitted."""
        idx = np.searchsorted(self.keys, keys)
        found = idx < self.keys.size
        found[found] = self.keys[idx[found]] == keys[found]
        new = keys[~found]
        if new.size:
            at = idx[~found]
            self.keys = np.insert(self.keys, at, new)
            self.count = np.insert(self.count, at, 0)
            self.last = np.insert(self.last, at, _NEVER)
            idx = np.searchsorted(self.keys, keys)
        first = self.last[idx] != batch
        before = self.count[idx[first]]
        self.count[idx[first]] = np.minimum(before + 1, self.need)
        self.last[idx] = batch
        admitted = self.count[idx] >= self.need
        self.totals["admitted"] += int(np.count_nonzero((before < self.need) & (before + 1 >= self.need)))
        self.totals["rejected"] += int(np.count_nonzero(first & ~admitted))
        return admitted

    def expire(self, through: int) -> np.ndarray:
        """Forget the keys expiring at the end of batch ``through``; returns those with rows."""
        if self.expire_after is None or (self.expired_through is not None and through <= self.expired_through):
            return np.empty(0, dtype=np.uint64)
        self.expired_through = through
        gone = self.last <= through - self.expire_after
        had_row = self.keys[gone & (self.count >= self.need)]
        self.totals["expired"] += int(had_row.size)
        self.totals["forgotten"] += int(np.count_nonzero(gone)) - int(had_row.size)
        keep = ~gone
        self.keys, self.count, self.last = self.keys[keep], self.count[keep], self.last[keep]
        return had_row


@dataclass
class EvalResult:
    """Metrics of a model over some examples."""

    auc: float
    logloss: float
    examples: int


class ReferenceTrainer:
    """Mini-batch training with every row in memory (see module docstring).

    Args:
        n_slots: categorical slots per example.
        n_dense: dense features per example.
        config: model shape, optimizers, mini-batch size and seed.
        model: any module ``(pooled [B, n_slots, dim], dense [B, n_dense]) -> logits [B]``;
            the kind ``config`` names when ``None`` (:func:`~hpsray.models.kinds.build_model`).
        admit_after: a key gets a row from the batch in which it is seen for the
            ``admit_after``-th time on (counting batches; ``0``: every key).
        expire_after_batches: rows of keys not seen for this many batches are dropped
            (``None``: never). A table's own (``config.tables``) replace either for its rows.
        threads: torch's intra-op threads while it trains (default: the machine's cores, as the
            pipeline's trainer). A dense layer's weight gradient sums over the mini-batch in
            chunks per thread, so results are bit-equal only at the same count (docs/architecture.md,
            Invariants, 1).
    """

    def __init__(
        self,
        n_slots: int,
        n_dense: int,
        config: TrainConfig | None = None,
        model: torch.nn.Module | None = None,
        *,
        admit_after: int = 0,
        expire_after_batches: int | None = None,
        threads: int | None = None,
    ):
        self.threads = threads or os.cpu_count() or 1
        self.config = with_first_order(
            config or TrainConfig(), n_slots
        )  # a model of first-order rows: their table added
        self.n_dense = n_dense
        self.optimizer = self.config.optimizer()
        self.tables = self.config.tables_for(n_slots) if self.config.tables else None
        self.n_slots = self.tables.n_slots if self.tables is not None else n_slots
        """The model's slots: the data's, then any copied ones (a batch of the data's is expanded)."""
        if self.tables is None:
            self.store = SortedRowStore(self.config.row_width, self.config.row_init())
            self.stores = [self.store]
        else:
            self.split = TableSplit(self.tables)
            self.stores = [SortedRowStore(w, i) for w, i in zip(self.tables.widths, self.tables.row_inits, strict=True)]
            self.store = self.stores[0]
        self.model = model or build_model(self.config, n_slots, n_dense)
        self.dense = DenseReplicas(self.model, 1, self.config.dense_optimizer, self.config.dense_lr)
        self.step = 0  # mini-batches trained; the sparse optimizer's global step
        self.batches = 0  # batches trained: the next batch's id, as the pipeline numbers them
        self.examples = 0
        self.train_seconds = 0.0
        self.admissions: list[SeenCounts | None] = []
        for admit, expire in admission_of(self.tables, admit_after, expire_after_batches):
            admission = SeenCounts(admit, expire)
            self.admissions.append(admission if admission.enabled else None)
        self.admission = self.admissions[0]  # the (first) table's

    def _begin_batch(self, minibatches: list[Batch]) -> list[np.ndarray]:
        """Count the batch's distinct keys; returns, per table, those not admitted (trained,
        then dropped)."""
        none = np.empty(0, np.uint64)
        if all(a is None for a in self.admissions):
            return [none] * len(self.stores)
        tagged = [mb.keys if self.tables is None else self.split.tagged(mb) for mb in minibatches]
        keys = np.unique(np.concatenate(tagged)) if minibatches else none
        rejected = []
        for t, (admission, store) in enumerate(zip(self.admissions, self.stores, strict=True)):
            if admission is None:
                rejected.append(none)
                continue
            own = keys if self.tables is None else keys[self.tables.table_of(keys) == t]
            store.drop(admission.expire(self.batches - 1))  # done at the last batch's end already
            admitted = admission.see(self.batches, own)
            rejected.append(own[~admitted])
        return rejected

    def _end_batch(self, rejected: list[np.ndarray]) -> None:
        """Drop the rows of keys not admitted and of keys expiring now; the batch is done."""
        for admission, store, gone in zip(self.admissions, self.stores, rejected, strict=True):
            if admission is not None:
                store.drop(gone)
                store.drop(admission.expire(self.batches))
        self.batches += 1

    def _expand(self, batch: Batch) -> Batch:
        """``batch`` with its copied slots appended (:mod:`hpsray.first_order`); checked."""
        if self.tables is not None and batch.n_slots == self.tables.n_data_slots:
            batch = self.tables.expand(batch)
        self.check(batch)
        return batch

    def check(self, batch: Batch) -> None:
        """``ValueError`` for a batch of other slots or dense features than the trainer's."""
        if batch.n_slots != self.n_slots or batch.n_dense != self.n_dense:
            raise ValueError(
                f"batch has {batch.n_slots} slots and {batch.n_dense} dense features; "
                f"the trainer was built for {self.n_slots} and {self.n_dense}"
            )

    def train_minibatch(self, mb: Batch) -> float:
        """One gradient step on ``mb``; returns its mean log-loss before the step."""
        if self.tables is not None:
            return train_tables(self, [[mb]])
        fetched = {}

        def weights_of(unique_keys: np.ndarray) -> np.ndarray:
            fetched["pos"] = pos = self.store.positions(unique_keys)
            fetched["rows"] = rows = self.store.rows_at(pos)
            return rows[:, : self.config.dim]

        loss, _, grads = self.dense.step(mb, weights_of)
        self.step += 1
        apply_to_rows(fetched["rows"], grads, self.optimizer, self.step)
        self.store.write(fetched["pos"], fetched["rows"])
        self.examples += len(mb)
        return float(loss)

    def train_batch(self, batch: Batch) -> float:
        """Train on every mini-batch of ``batch`` in order; returns the mean loss."""
        batch = self._expand(batch)
        t0 = time.perf_counter()
        self.model.train()
        loss = self.train_minibatches(list(batch.minibatches(self.config.minibatch_size)))
        self.train_seconds += time.perf_counter() - t0
        return loss

    def train_shares(self, shares: list[Batch] | list[list[Batch]]) -> float:
        """One step over a global mini-batch of several nodes, given as the nodes' shares in
        rank order, each node's share a :class:`Batch` or (``D`` devices per node) a list of its
        devices' slices in device order (:func:`global_batches`); returns its mean loss before
        the step.

        The order of the sums is stated here (docs/architecture.md: invariant 1): each slice's
        gradients are what its device computes alone (its own forward and backward, its loss
        the slice's part of the mean over every share's examples). A row's gradient is summed
        over the slices in (node, device) order, starting from zero. The dense gradient is
        summed per node over its devices in device order, then over the node sums in node
        order, each sum starting from its first term. The optimizers then step once."""
        nodes = [share if isinstance(share, list) else [share] for share in shares]
        if self.tables is not None:
            return train_tables(self, nodes)
        slices = [s for node in nodes for s in node]
        total = sum(len(s) for s in slices)
        dim = self.config.dim
        keys = np.unique(np.concatenate([s.keys for s in slices]))
        pos = self.store.positions(keys)
        rows = self.store.rows_at(pos)
        sparse = np.zeros((keys.size, dim), dtype=np.float32)
        params = list(self.model.parameters())
        dense: list[torch.Tensor] | None = None
        loss_sum = 0.0
        for node in nodes:
            node_sum: list[torch.Tensor] | None = None
            for s in node:
                self.check(s)
                layout = BagLayout.of(s)
                at = np.searchsorted(keys, layout.unique_keys)
                leaf = torch.from_numpy(rows[at, :dim]).requires_grad_(True)
                self.model.zero_grad(set_to_none=True)
                logits = self.model(pool_sum(leaf, layout), torch.from_numpy(np.array(s.dense)))
                loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(np.array(s.labels)), reduction="sum")
                (loss / total).backward()
                assert leaf.grad is not None
                sparse[at] += leaf.grad.numpy()  # a slice's keys are distinct: one sum term per slice
                grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
                node_sum = grads if node_sum is None else [a + g for a, g in zip(node_sum, grads, strict=True)]
                loss_sum += float(loss.detach()) / total
            if node_sum is not None:
                dense = node_sum if dense is None else [a + g for a, g in zip(dense, node_sum, strict=True)]
        assert dense is not None, "a global mini-batch has at least one slice"
        for p, g in zip(params, dense, strict=True):
            p.grad = g
        self.dense.optimizers[0].step()
        self.step += 1
        apply_to_rows(rows, sparse, self.optimizer, self.step)
        self.store.write(pos, rows)
        self.examples += total
        return loss_sum

    def train_minibatches(self, minibatches: list) -> float:
        """Train one batch given as its mini-batches, in order, or (several nodes) as its global
        mini-batches, each its nodes' shares (:func:`global_batches`, :meth:`train_shares`);
        returns the mean loss. Admission and expiry count the batch as one."""
        minibatches = [_each(item, self._expand) for item in minibatches]
        flat = list(_batches_in(minibatches))
        rejected = self._begin_batch(flat)
        losses = []
        with torch_threads(self.threads):
            for item in minibatches:
                if isinstance(item, list):
                    losses.append(self.train_shares(item))
                else:
                    self.check(item)
                    losses.append(self.train_minibatch(item))
        self._end_batch(rejected)
        return float(np.mean(losses)) if losses else float("nan")

    def fit(self, batches: Iterable[Batch], progress: Callable[[int, Batch, float], Any] | None = None) -> None:
        """Train on each batch in order; ``progress(i, batch, loss)`` is called after each."""
        for i, batch in enumerate(batches):
            loss = self.train_batch(batch)
            if progress:
                progress(i, batch, loss)

    def fit_nodes(self, source: ShardedSource, batch_size: int, n_nodes: int, n_devices: int = 1) -> None:
        """Train what ``n_nodes`` nodes of ``n_devices`` devices each train on ``source`` (see
        :func:`global_batches`)."""
        self.model.train()
        for minibatches in global_batches(source, batch_size, n_nodes, self.config.minibatch_size, n_devices):
            self.train_minibatches(minibatches)

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities of ``batch``'s examples (unseen keys use their initial rows)."""
        batch = self._expand(batch)
        self.model.eval()
        out = []
        for mb in batch.minibatches(self.config.minibatch_size):
            if self.tables is not None:
                x = predict_input(self, mb)
            else:
                layout = BagLayout.of(mb)
                x = pool_sum(torch.from_numpy(self.store.peek(layout.unique_keys)[:, : self.config.dim]), layout)
            out.append(torch.sigmoid(self.model(x, torch.from_numpy(mb.dense))).numpy())
        return np.concatenate(out) if out else np.empty(0, dtype=np.float32)

    def evaluate(self, batches: Iterable[Batch]) -> EvalResult:
        """AUC and log-loss over ``batches``."""
        labels, probs = [], []
        for batch in batches:
            labels.append(batch.labels)
            probs.append(self.predict(batch))
        y, p = np.concatenate(labels), np.concatenate(probs)
        return EvalResult(auc=auc(y, p), logloss=logloss(y, p), examples=int(y.size))

    def export(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """``(keys sorted, rows, dense state_dict)``: everything the model learnt (with
        ``config.tables``: ``ValueError``, see :meth:`export_tables`)."""
        if self.tables is not None:
            raise ValueError("a model of several tables exports per table: ReferenceTrainer.export_tables()")
        keys, rows = self.store.export()
        return keys, rows, self.dense_state()

    def dense_state(self) -> dict:
        """A copy of the dense model's ``state_dict``."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def export_tables(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per table name, its ``(keys sorted, rows)``, each row at its table's width
        (``{"default": ...}`` without ``config.tables``)."""
        if self.tables is None:
            return {"default": self.store.export()}
        return {spec.name: store.export() for spec, store in zip(self.tables.specs, self.stores, strict=True)}


def global_batches(
    source: ShardedSource, batch_size: int, n_nodes: int, minibatch_size: int, n_devices: int = 1
) -> Iterator[list[list]]:
    """Per batch, the global mini-batches that ``n_nodes`` nodes train under BSP, in order.

    Node ``i`` reads share ``i`` of ``n_nodes`` of ``source`` in batches of ``batch_size``; in
    batch ``t`` every node steps through the same number of mini-batches, and global mini-batch
    ``k`` is, in node order, each node's ``k``-th mini-batch (a node whose batch is shorter, or
    whose share has ended, contributes nothing); with ``n_devices > 1`` each node's part is a
    list of that many contiguous slices (``linspace`` bounds), in device order, empty ones left
    out. Training the reference on these (:meth:`ReferenceTrainer.train_shares`) gives what
    the distributed system must reproduce (docs/architecture.md: invariant 1).
    """
    streams = [iter(source.open(batch_size, i, n_nodes)) for i in range(n_nodes)]
    m = minibatch_size
    while True:
        batches = [next(s, None) for s in streams]
        present = [b for b in batches if b is not None and len(b)]
        if not present:
            return
        yield [
            [_slices(b.slice(k * m, (k + 1) * m), n_devices) for b in present if k * m < len(b)]
            for k in range(max(-(-len(b) // m) for b in present))
        ]


def _each(item: Any, f: Callable[[Batch], Batch]) -> Any:
    """``item`` (a :class:`Batch` or nested lists of them) with ``f`` applied to every batch."""
    return [_each(i, f) for i in item] if isinstance(item, list) else f(item)


def _batches_in(items: list) -> Iterator[Batch]:
    """Every :class:`Batch` in nested lists of them, in order."""
    for item in items:
        if isinstance(item, list):
            yield from _batches_in(item)
        else:
            yield item


def _slices(part: Batch, n: int) -> Batch | list[Batch]:
    """``part`` cut into ``n`` contiguous slices at ``linspace`` bounds, the empty ones left out
    (``part`` itself for one)."""
    if n == 1:
        return part
    bounds = np.linspace(0, len(part), n + 1).astype(int)
    return [part.slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]


def global_minibatches(
    source: ShardedSource, batch_size: int, n_nodes: int, minibatch_size: int
) -> Iterator[list[Batch]]:
    """:func:`global_batches`, flattened: each global mini-batch as its nodes' shares."""
    for batch in global_batches(source, batch_size, n_nodes, minibatch_size):
        yield from batch
