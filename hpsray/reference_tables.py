"""The reference trainer with tables of their own (:mod:`hpsray.tables`, issue 43), stated plainly.

One :class:`~hpsray.reference.SortedRowStore` per table, at that table's row width, with its own
row initialiser, sparse optimizer and admission/expiry. A mini-batch's keys are tagged with their
table (:meth:`~hpsray.tables.Tables.tag`) and split by table; each table's distinct rows pool per
(example, slot) bag: ``sum``, or ``mean`` = the float32 sum divided by the bag's key count (an
empty bag pools to zeros). The model's input is the slots' pooled embeddings in slot order, each
at its table's dim: ``[B, n_slots, dim]`` when every table has one dim, else
``[B, sum of the slots' dims]``. Every table's rows step with the same global step count.

Like :mod:`hpsray.reference`, it imports nothing from ``hpsray.tiers``, ``hpsray.actors`` or
``hpsray.pipelines``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from hpsray.data.batch import Batch
from hpsray.kernels.optim import apply_to_rows
from hpsray.models.pooling import BagLayout, pool_sum
from hpsray.models.step import DenseReplicas
from hpsray.reference_store import SortedRowStore
from hpsray.tables import Tables

__all__ = ["TableSplit", "admission_of", "assemble", "pool", "predict_input", "train_tables"]


class TableSplit:
    """Cuts a batch into one batch per table: the table's slots only (numbered in the table's
    slot order, ascending), its keys tagged; every example kept (a bag may be empty)."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables
        self.local = np.zeros(tables.n_slots, dtype=np.int32)  # a slot's number within its table
        self.sorted_slots = []
        for t in range(len(tables.specs)):
            slots = np.flatnonzero(tables.slot_table == t)  # model slots: a copy table's follow the data's
            self.local[slots] = np.arange(slots.size, dtype=np.int32)
            self.sorted_slots.append(slots)

    def tagged(self, batch: Batch) -> np.ndarray:
        """``batch``'s keys, tagged with their tables."""
        return self.tables.tag(batch.keys, batch.slots)

    def __call__(self, batch: Batch) -> list[Batch]:
        keys = self.tagged(batch)
        owner = self.tables.slot_table[batch.slots]
        out = []
        for t, slots in enumerate(self.sorted_slots):
            mask = owner == t
            ends = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
            out.append(
                replace(
                    batch,
                    keys=keys[mask],
                    offsets=ends[batch.offsets],
                    slots=self.local[batch.slots[mask]],
                    n_slots=int(slots.size),
                )
            )
        return out


def admission_of(
    tables: Tables | None, admit_after: int, expire_after_batches: int | None
) -> list[tuple[int, int | None]]:
    """Per table (one without ``tables``), its ``(admit_after, expire_after_batches)``: its own
    where it gives them, else these (:meth:`~hpsray.tables.Tables.admission`)."""
    if tables is None:
        return [(admit_after, expire_after_batches)]
    return tables.admission(admit_after, expire_after_batches)


def pool(rows: torch.Tensor, layout: BagLayout, pooling: str) -> torch.Tensor:
    """``[B, slots, dim]`` pooled embeddings of ``rows`` (one per distinct key): the sum, or
    (``"mean"``) the sum divided by the bag's key count in float32; an empty bag pools to zeros."""
    pooled = pool_sum(rows, layout)
    if pooling == "sum":
        return pooled
    offsets = np.asarray(layout.bag_offsets)
    counts = np.diff(np.append(offsets, np.int64(np.asarray(layout.inverse).size)))
    divisor = torch.from_numpy(np.maximum(counts, 1).astype(np.float32)).view(layout.n_examples, layout.n_slots, 1)
    return pooled / divisor


def assemble(pooled: list[torch.Tensor], split: TableSplit) -> torch.Tensor:
    """The model's input from each table's ``[B, its slots, dim]``: the slots in slot order,
    ``[B, n_slots, dim]`` when every table has one dim, else ``[B, sum of the slots' dims]``."""
    tables = split.tables
    pieces = [pooled[t][:, split.local[s], :] for s, t in enumerate(tables.slot_table)]
    if tables.uniform_dim is not None:
        return torch.stack(pieces, dim=1)
    return torch.cat(pieces, dim=1)


class TableTrainer(Protocol):
    """What this module reads and steps of the :class:`~hpsray.reference.ReferenceTrainer`: its
    split, one store per table, the model and its dense optimizer, the shape check, and the step and
    example counts it advances."""

    step: int
    examples: int

    @property
    def split(self) -> TableSplit: ...
    @property
    def stores(self) -> Sequence[SortedRowStore]: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def dense(self) -> DenseReplicas: ...
    def check(self, batch: Batch) -> None: ...


def forward_input(
    trainer: TableTrainer, batch: Batch, rows_of: Callable[[int, np.ndarray], torch.Tensor]
) -> tuple[torch.Tensor, list]:
    """``(model input, per table (layout, leaf))`` of ``batch``; ``rows_of(t, unique_keys)`` gives
    table ``t``'s weights ``float32[U, dim]`` (a leaf that requires grad where training)."""
    split = trainer.split
    parts = split(batch)
    leaves, pooled = [], []
    for t, part in enumerate(parts):
        layout = BagLayout.of(part)
        leaf = rows_of(t, layout.unique_keys)
        leaves.append((layout, leaf))
        pooled.append(pool(leaf, layout, split.tables.specs[t].pooling))
    return assemble(pooled, split), leaves


def predict_input(trainer: TableTrainer, batch: Batch) -> torch.Tensor:
    """The model's input for ``batch`` from the stored rows (unseen keys: their initial rows)."""
    dims = trainer.split.tables.dims
    x, _ = forward_input(trainer, batch, lambda t, k: torch.from_numpy(trainer.stores[t].peek(k)[:, : dims[t]]))
    return x


def train_tables(trainer: TableTrainer, nodes: list[list[Batch]]) -> float:
    """One step over a global mini-batch (its nodes' shares, each a list of device slices) with
    tables of their own; the order of the sums is :meth:`ReferenceTrainer.train_shares`'s."""
    tables = trainer.split.tables
    slices = [s for node in nodes for s in node]
    total = sum(len(s) for s in slices)
    keys = []
    for t in range(len(tables)):
        tagged = [k[tables.table_of(k) == t] for k in (trainer.split.tagged(s) for s in slices)]
        keys.append(np.unique(np.concatenate(tagged)) if tagged else np.empty(0, np.uint64))
    pos = [store.positions(k) for store, k in zip(trainer.stores, keys, strict=True)]
    rows = [store.rows_at(p) for store, p in zip(trainer.stores, pos, strict=True)]
    sparse = [np.zeros((k.size, d), dtype=np.float32) for k, d in zip(keys, tables.dims, strict=True)]
    params = list(trainer.model.parameters())
    dense: list[torch.Tensor] | None = None
    loss_sum = 0.0
    at: dict[int, np.ndarray] = {}  # per table, the slice's distinct keys' places in keys[t]

    def rows_of(t: int, unique_keys: np.ndarray) -> torch.Tensor:
        at[t] = np.searchsorted(keys[t], unique_keys)
        return torch.from_numpy(rows[t][at[t], : tables.dims[t]]).requires_grad_(True)

    for node in nodes:
        node_sum: list[torch.Tensor] | None = None
        for s in node:
            trainer.check(s)
            trainer.model.zero_grad(set_to_none=True)
            x, leaves = forward_input(trainer, s, rows_of)
            logits = trainer.model(x, torch.from_numpy(np.array(s.dense)))
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(np.array(s.labels)), reduction="sum")
            (loss / total).backward()
            for t, (_, leaf) in enumerate(leaves):
                assert leaf.grad is not None
                sparse[t][at[t]] += leaf.grad.numpy()  # a slice's keys are distinct: one term per slice
            grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            node_sum = grads if node_sum is None else [a + g for a, g in zip(node_sum, grads, strict=True)]
            loss_sum += float(loss.detach()) / total
        if node_sum is not None:
            dense = node_sum if dense is None else [a + g for a, g in zip(dense, node_sum, strict=True)]
    assert dense is not None, "a global mini-batch has at least one slice"
    for p, g in zip(params, dense, strict=True):
        p.grad = g
    trainer.dense.optimizers[0].step()
    trainer.step += 1
    for t, store in enumerate(trainer.stores):
        apply_to_rows(rows[t], sparse[t], tables.optimizers[t], trainer.step)
        store.write(pos[t], rows[t])
    trainer.examples += total
    return loss_sum
