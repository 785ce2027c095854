"""Peer systems that ``hpsray bench peers`` trains beside hpsray, and what they share.

Every peer trains the same model (the kind ``PeerSpec.model`` names over sum-pooled slot embeddings)
with the same optimizers on the same examples; this module holds the common parts:

- :class:`PeerSpec`: one system's run, as a JSON-able record (it crosses process boundaries:
  each system runs in its own process, so that its peak RSS is its own);
- :func:`save_examples` / :func:`load_examples`: the examples, generated once per run and
  stored as ``.npy`` arrays that every system's process loads into memory;
- :class:`Vocabulary`: the dense row index of every key (``slot * keys_per_slot + rank``), which
  a plain PyTorch or TorchRec model needs (their tables are indexed, not hashed);
- :func:`peak_rss_bytes`, :func:`actor_peak_rss`: peak resident memory of a process / Ray actor.

The peers themselves: :mod:`~hpsray.bench.baselines.plain_torch` (``nn.EmbeddingBag`` +
sparse Adagrad) and :mod:`~hpsray.bench.baselines.sharded_ps` (in-memory shards on Ray actors);
TorchRec runs from ``benchmarks/torchrec_peer.py`` in its own virtual environment.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpsray.data.batch import Batch

_FIELDS = ("labels", "dense", "keys", "offsets", "slots")


@dataclass
class PeerSpec:
    """One system's run: data, model, optimizers, sizes (all plain values: JSON-able).

    ``rows`` examples are timed after ``warmup_rows`` untimed ones; AUC is measured on
    ``eval_rows`` held-out examples. ``batch`` is hpsray's batch (the unit of pull / write-back);
    every system takes gradient steps of ``minibatch`` examples.
    """

    system: str
    data_dir: str
    n_slots: int = 26
    keys_per_slot: int = 100_000
    keys_per_example: int = 26
    n_dense: int = 13
    dim: int = 16
    hidden: Sequence[int] = (512, 256, 128)
    minibatch: int = 4096
    batch: int = 32768
    warmup_rows: int = 65536
    rows: int = 262144
    eval_rows: int = 65536
    sparse_optimizer: str = "adagrad"
    sparse_lr: float = 0.05
    dense_optimizer: str = "adam"
    dense_lr: float = 1e-3
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"  # where hpsray's trainer, plain PyTorch and the MLP bound train ("cuda": one GPU)
    mem_capacity_rows: int | None = None  # hpsray MEM-PS budget; every row fits when None
    shards: int = 2  # sharded PS
    torchrec_optimizer: str = "exact_adagrad"
    model: dict = field(default_factory=dict)  # a model kind and its settings (ModelSpec.to_dict); {}: mlp over hidden
    result_path: str | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> PeerSpec:
        d = json.loads(text)
        d["hidden"] = tuple(d["hidden"])
        return PeerSpec(**d)

    @property
    def vocabulary_rows(self) -> int:
        return self.n_slots * self.keys_per_slot

    def train_config(self):
        """The :class:`~hpsray.config.TrainConfig` every hpsray-based system uses."""
        from hpsray.config import TrainConfig

        return TrainConfig(
            dim=self.dim,
            hidden=tuple(self.hidden),
            sparse_optimizer=self.sparse_optimizer,
            sparse_lr=self.sparse_lr,
            dense_optimizer=self.dense_optimizer,
            dense_lr=self.dense_lr,
            minibatch_size=self.minibatch,
            seed=self.seed,
            model_kind=self.model.get("kind", "mlp"),
            model_settings={k: v for k, v in self.model.items() if k != "kind"},
        )

    def generator(self):
        """The planted data set: ``keys_per_example`` keys over ``n_slots`` slots (multi-hot
        slots when there are more keys than slots), so every system's model is the same."""
        from hpsray.data import PlantedCTR

        return PlantedCTR(
            n_slots=self.n_slots,
            keys_per_slot=self.keys_per_slot,
            nnz_per_slot=PlantedCTR.spread_nnz(self.n_slots, self.keys_per_example),
            n_dense=self.n_dense,
            seed=self.seed,
        )


# -- examples on disk --------------------------------------------------------------------------


def save_examples(spec: PeerSpec) -> dict:
    """Generate the training stream (warm-up then measured rows) and the held-out rows once and
    store them as ``.npy`` arrays under ``spec.data_dir``. Returns a summary."""
    gen = spec.generator()
    out = Path(spec.data_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = gen.generate(spec.warmup_rows + spec.rows)
    held_out = gen.generate(spec.eval_rows, start_row=10**9)
    for name, batch in (("train", train), ("eval", held_out)):
        for f in _FIELDS:
            np.save(out / f"{name}_{f}.npy", getattr(batch, f))
    return {
        "train_rows": len(train),
        "eval_rows": len(held_out),
        "train_nnz": train.nnz,
        "distinct_train_keys": int(np.unique(train.keys).size),
    }


def load_examples(spec: PeerSpec, which: str) -> Batch:
    """The ``"train"`` or ``"eval"`` examples stored by :func:`save_examples`, in memory."""
    d = Path(spec.data_dir)
    return Batch(n_slots=spec.n_slots, **{f: np.load(d / f"{which}_{f}.npy") for f in _FIELDS})


def split(batch: Batch, size: int, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
    """Consecutive slices of ``size`` examples of ``batch[start:stop]``."""
    stop = len(batch) if stop is None else min(stop, len(batch))
    for lo in range(start, stop, size):
        yield batch.slice(lo, min(lo + size, stop))


# -- dense row indices -------------------------------------------------------------------------


class Vocabulary:
    """Dense row index ``slot * keys_per_slot + rank`` of every key the planted data can hold.

    Plain PyTorch and TorchRec index their tables with integers known in advance; this is the
    preprocessing that turns hpsray's hashed ``uint64`` keys into those integers.
    """

    def __init__(self, n_slots: int, keys_per_slot: int) -> None:
        from hpsray.data.keys import hash_keys
        from hpsray.kernels.cpu import CpuHashTable

        self.n_slots, self.keys_per_slot = n_slots, keys_per_slot
        slot = np.repeat(np.arange(n_slots, dtype=np.int64), keys_per_slot)
        rank = np.tile(np.arange(keys_per_slot, dtype=np.uint64), n_slots)
        self.keys = hash_keys(slot, rank)  # row i's key
        # a table filled in row order hands out slots 0, 1, 2, ...: its find() is the index
        self._table = CpuHashTable(self.keys.size, 1)
        if not np.array_equal(self._table.find_or_insert(self.keys), np.arange(self.keys.size)):
            raise RuntimeError("vocabulary keys collide; cannot build a dense index")

    def __len__(self) -> int:
        return int(self.keys.size)

    def index(self, keys: np.ndarray) -> np.ndarray:
        """``int64`` row of each key; raises ``KeyError`` for a key outside the vocabulary."""
        rows = self._table.find(np.asarray(keys, dtype=np.uint64))
        if rows.size and rows.min() < 0:
            bad = rows < 0
            raise KeyError(f"{int(bad.sum())} keys are not in the vocabulary (first: {int(keys[np.argmax(bad)])})")
        return rows

    def initial_weights(self, spec: PeerSpec) -> np.ndarray:
        """``float32[rows, dim]``: each row's initial weights, exactly as hpsray initialises its key."""
        from hpsray.kernels.init import initial_rows

        cfg = spec.train_config()
        return initial_rows(self.keys, spec.dim, cfg.row_init())


# -- memory --------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``getrusage`` ``ru_maxrss``, KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def actor_peak_rss(_actor_self: object = None) -> int:
    """:func:`peak_rss_bytes` inside a Ray actor: ``ray.get(a.__ray_call__.remote(actor_peak_rss))``."""
    return peak_rss_bytes()


def ray_peak_rss(actors: dict[str, Any]) -> dict:
    """Peak RSS of each Ray actor of ``actors`` (``{name: handle}``) plus this driver, and the sum."""
    import ray

    names = list(actors)
    values = ray.get([actors[n].__ray_call__.remote(actor_peak_rss) for n in names])
    per = {n: int(v) for n, v in zip(names, values)}
    per["driver"] = peak_rss_bytes()
    return {"peak_rss_bytes": int(sum(per.values())), "peak_rss_by_process": per}


def peer_result(
    examples: int, train_s: float, labels: np.ndarray, probs: np.ndarray, prepare_s: float, table_rows: int
) -> dict:
    """The figures every in-process peer reports: throughput of the measured rows, held-out
    AUC and log-loss, and this process's peak RSS (each peer adds its own details)."""
    from hpsray.models.metrics import auc, logloss

    return {
        "examples_per_s": examples / train_s,
        "auc": auc(labels, probs),
        "logloss": logloss(labels, probs),
        "peak_rss_bytes": peak_rss_bytes(),
        "examples": examples,
        "train_s": train_s,
        "prepare_s": prepare_s,
        "table_rows": table_rows,
    }


def write_result(spec: PeerSpec, result: dict) -> None:
    """Write ``result`` (one system's figures) where the orchestrator expects it."""
    if spec.result_path:
        tmp = f"{spec.result_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
        os.replace(tmp, spec.result_path)
