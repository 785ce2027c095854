"""Synthetic click logs drawn from a planted logistic model over Zipf-distributed keys.

Each example has ``n_slots`` categorical slots with ``nnz_per_slot`` keys each (one number for
all slots, or one per slot for multi-hot slots of different widths; rank ``r`` of the slot's
vocabulary drawn with probability proportional to ``1 / (r + 1) ** zipf_a``) and
``n_dense`` standard-normal dense features. Its click probability is
``sigmoid(key_scale * mean-ish(w[keys]) + dense @ v + bias)`` with per-key weights ``w`` that
are a fixed hash of the key, so a trainer that learns the keys reaches a known AUC
(:meth:`PlantedCTR.true_logits` gives the Bayes-optimal scores to compare with).

Rows are generated in fixed blocks, each from its own seeded generator, so the stream is the
same whatever batch size the caller slices it into.

The key of rank ``r`` in slot ``s`` is ``hash_keys(s, r)``: a file that stores ``r`` as the raw
categorical value (hex text in Criteo TSV, an integer in Parquet; see
:mod:`hpsray.data.generate`) reads back into exactly these keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from hpsray.data.batch import Batch
from hpsray.data.keys import hash_keys
from hpsray.kernels.hashing import mix64_array

BLOCK_ROWS = 8192
_WEIGHT_SALT = np.uint64(0x7F4A7C159E3779B9)


@dataclass
class PlantedCTR:
    """A reproducible synthetic CTR data set; see the module docstring."""

    n_slots: int = 26
    keys_per_slot: int = 10_000
    nnz_per_slot: int | Sequence[int] = 1
    n_dense: int = 13
    zipf_a: float = 1.05
    key_scale: float = 3.0
    dense_scale: float = 0.5
    bias: float = -1.0
    seed: int = 0
    _cdf: np.ndarray = field(init=False, repr=False)
    _dense_w: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("n_slots", "keys_per_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlantedCTR.{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.nnz_per_slot, (int, np.integer)):
            if self.nnz_per_slot < 1:
                raise ValueError(f"PlantedCTR.nnz_per_slot must be >= 1, got {self.nnz_per_slot}")
        else:
            self.nnz_per_slot = tuple(int(m) for m in self.nnz_per_slot)
            if len(self.nnz_per_slot) != self.n_slots or min(self.nnz_per_slot) < 1:
                raise ValueError(
                    f"PlantedCTR.nnz_per_slot must be one integer >= 1 or {self.n_slots} of them, "
                    f"got {self.nnz_per_slot}"
                )
        if self.n_dense < 0:
            raise ValueError(f"PlantedCTR.n_dense must be >= 0, got {self.n_dense}")
        p = 1.0 / np.power(np.arange(1, self.keys_per_slot + 1, dtype=np.float64), self.zipf_a)
        self._cdf = np.cumsum(p / p.sum())
        self._cdf[-1] = 1.0
        rng = np.random.default_rng([self.seed, 0xD5E])
        self._dense_w = (rng.standard_normal(self.n_dense) * self.dense_scale).astype(np.float32)

    @property
    def slot_nnz(self) -> np.ndarray:
        """``int64[n_slots]``: keys per example in each slot."""
        return np.broadcast_to(np.asarray(self.nnz_per_slot, dtype=np.int64), (self.n_slots,)).copy()

    @property
    def nnz_per_example(self) -> int:
        return int(self.slot_nnz.sum())

    @staticmethod
    def spread_nnz(n_slots: int, nnz: int) -> int | tuple[int, ...]:
        """``nnz_per_slot`` for ``nnz`` keys per example over ``n_slots`` slots, as even as possible."""
        if nnz < n_slots:
            raise ValueError(f"need at least one key per slot: nnz={nnz} < slots={n_slots}")
        base, extra = divmod(nnz, n_slots)
        return base if extra == 0 else tuple(base + (s < extra) for s in range(n_slots))

    def key_weights(self, keys: np.ndarray) -> np.ndarray:
        """The planted weight of each key, uniform in [-1, 1) (a fixed hash of the key)."""
        h = mix64_array(np.asarray(keys, dtype=np.uint64) ^ _WEIGHT_SALT ^ np.uint64(self.seed))
        return ((h >> np.uint64(40)).astype(np.float64) / 2**24 * 2.0 - 1.0).astype(np.float32)

    def true_logits(self, batch: Batch) -> np.ndarray:
        """The planted model's logit of each example (the Bayes-optimal score)."""
        w = self.key_weights(batch.keys).astype(np.float64)
        per_example = np.add.reduceat(w, batch.offsets[:-1]) if batch.nnz else np.zeros(len(batch))
        per_example[np.diff(batch.offsets) == 0] = 0.0
        scale = self.key_scale / np.sqrt(self.nnz_per_example)
        return (scale * per_example + batch.dense.astype(np.float64) @ self._dense_w + self.bias).astype(np.float32)

    def block(self, index: int) -> Batch:
        """Rows ``index * BLOCK_ROWS`` to ``(index + 1) * BLOCK_ROWS - 1`` of the stream."""
        return self.raw_block(index)[0]

    def raw_block(self, index: int) -> tuple[Batch, np.ndarray]:
        """:meth:`block` and the raw value (Zipf rank, ``uint64[nnz]``) behind each of its keys."""
        rng = np.random.default_rng([self.seed, index])
        n, s, m = BLOCK_ROWS, self.n_slots, self.slot_nnz
        per_example = int(m.sum())
        ranks = np.searchsorted(self._cdf, rng.random(n * per_example)).astype(np.uint64)
        slots = np.tile(np.repeat(np.arange(s, dtype=np.int32), m), n)
        keys = hash_keys(slots, ranks)
        dense = rng.standard_normal((n, self.n_dense)).astype(np.float32)
        offsets = np.arange(0, n * per_example + 1, per_example, dtype=np.int64)
        unlabeled = Batch(np.zeros(n, np.float32), dense, keys, offsets, slots, s)
        p = 1.0 / (1.0 + np.exp(-self.true_logits(unlabeled).astype(np.float64)))
        labels = (rng.random(n) < p).astype(np.float32)
        return Batch(labels, dense, keys, offsets, slots, s), ranks

    def batches(self, n_rows: int, batch_size: int, start_row: int = 0) -> Iterator[Batch]:
        """Rows ``start_row .. start_row + n_rows - 1`` in batches of ``batch_size``."""
        if batch_size <= 0 or n_rows < 0:
            raise ValueError(f"need batch_size > 0 and n_rows >= 0, got {batch_size}, {n_rows}")
        pending: list[Batch] = []
        have = 0
        row, end = start_row, start_row + n_rows
        while row < end:
            blk = self.block(row // BLOCK_ROWS)
            lo = row % BLOCK_ROWS
            hi = min(BLOCK_ROWS, lo + end - row)
            piece = blk.slice(lo, hi)
            row += hi - lo
            pending.append(piece)
            have += len(piece)
            while have >= batch_size or (row >= end and have):
                merged = Batch.concat(pending) if len(pending) > 1 else pending[0]
                take = min(batch_size, len(merged))
                yield merged.slice(0, take)
                rest = merged.slice(take, len(merged))
                pending = [rest] if len(rest) else []
                have = len(rest)

    def generate(self, n_rows: int, start_row: int = 0) -> Batch:
        """Rows ``start_row .. start_row + n_rows - 1`` as one batch."""
        return Batch.concat(list(self.batches(n_rows, max(n_rows, 1), start_row)))
