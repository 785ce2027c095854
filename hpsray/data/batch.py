"""The ``Batch``: one chunk of training examples as arrays."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """Examples ``0..B-1``: labels, dense features and CSR sparse keys.

    The keys of example ``i`` are ``keys[offsets[i]:offsets[i+1]]``; ``slots`` gives the slot
    (feature field) of each key. Embeddings are sum-pooled per (example, slot).
    """

    labels: np.ndarray  # float32[B]
    dense: np.ndarray  # float32[B, n_dense]
    keys: np.ndarray  # uint64[nnz]
    offsets: np.ndarray  # int64[B + 1]
    slots: np.ndarray  # int32[nnz]
    n_slots: int

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def n_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def nnz(self) -> int:
        return int(self.keys.shape[0])

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field whose dtype or shape is wrong."""
        b = self.labels.shape[0]
        checks = [
            ("labels", self.labels, np.float32, 1),
            ("dense", self.dense, np.float32, 2),
            ("keys", self.keys, np.uint64, 1),
            ("offsets", self.offsets, np.int64, 1),
            ("slots", self.slots, np.int32, 1),
        ]
        for name, arr, dtype, ndim in checks:
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != ndim:
                got = f"{getattr(arr, 'dtype', type(arr).__name__)} ndim={getattr(arr, 'ndim', '?')}"
                raise ValueError(f"Batch.{name}: expected {np.dtype(dtype)} with ndim={ndim}, got {got}")
        if self.dense.shape[0] != b:
            raise ValueError(f"Batch.dense: {self.dense.shape[0]} rows for {b} labels")
        if self.offsets.shape[0] != b + 1 or self.offsets[0] != 0 or self.offsets[-1] != self.keys.shape[0]:
            raise ValueError(f"Batch.offsets: must have {b + 1} entries from 0 to nnz={self.keys.shape[0]}")
        if b and np.any(np.diff(self.offsets) < 0):
            raise ValueError("Batch.offsets: must be non-decreasing")
        if self.slots.shape[0] != self.keys.shape[0]:
            raise ValueError(f"Batch.slots: {self.slots.shape[0]} slot ids for {self.keys.shape[0]} keys")
        if self.slots.size and (self.slots.min() < 0 or self.slots.max() >= self.n_slots):
            raise ValueError(f"Batch.slots: slot ids must lie in [0, {self.n_slots})")

    def example_of_key(self) -> np.ndarray:
        """``int64[nnz]``: the example each key belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.offsets))

    def bag_index(self) -> np.ndarray:
        """``int64[nnz]``: the pooling bag ``example * n_slots + slot`` of each key."""
        return self.example_of_key() * self.n_slots + self.slots

    def bag_offsets(self, bag: np.ndarray | None = None) -> np.ndarray:
        """``int64[B * n_slots]``: where each bag (:meth:`bag_index` order) starts among the keys
        sorted by bag, as ``F.embedding_bag`` takes them; ``bag``: :meth:`bag_index` where the
        caller has it already (in any order)."""
        n_bags = len(self) * self.n_slots
        offsets = np.zeros(n_bags, dtype=np.int64)
        np.cumsum(np.bincount(self.bag_index() if bag is None else bag, minlength=n_bags)[:-1], out=offsets[1:])
        return offsets

    def slice(self, start: int, stop: int) -> Batch:
        """Examples ``start..stop-1`` as a new batch (views where possible): a mini-batch."""
        stop = min(stop, len(self))
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Batch(
            labels=self.labels[start:stop],
            dense=self.dense[start:stop],
            keys=self.keys[lo:hi],
            offsets=self.offsets[start : stop + 1] - lo,
            slots=self.slots[lo:hi],
            n_slots=self.n_slots,
        )

    def minibatches(self, size: int) -> Iterator[Batch]:
        """Consecutive mini-batches of ``size`` examples (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"mini-batch size must be positive, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, start + size)

    @staticmethod
    def empty(n_slots: int, n_dense: int) -> Batch:
        """A batch of no examples (an exhausted node's part of a global mini-batch)."""
        return Batch(
            labels=np.empty(0, np.float32),
            dense=np.empty((0, n_dense), np.float32),
            keys=np.empty(0, np.uint64),
            offsets=np.zeros(1, np.int64),
            slots=np.empty(0, np.int32),
            n_slots=n_slots,
        )

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """One batch holding the examples of ``batches`` in order."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        n_slots = batches[0].n_slots
        starts = np.cumsum([0] + [b.nnz for b in batches[:-1]])
        offsets = np.concatenate([[0]] + [b.offsets[1:] + s for b, s in zip(batches, starts)]).astype(np.int64)
        return Batch(
            labels=np.concatenate([b.labels for b in batches]),
            dense=np.concatenate([b.dense for b in batches]),
            keys=np.concatenate([b.keys for b in batches]),
            offsets=offsets,
            slots=np.concatenate([b.slots for b in batches]),
            n_slots=n_slots,
        )
