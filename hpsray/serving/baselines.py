"""The baselines ``hpsray bench serve`` puts behind the same endpoint (``LoadOptions.backend``).

- ``rocksdb``: the model's rows in a RocksDB store (``rocksdict``: the SSD store NVIDIA HugeCTR's
  inference used, and GDRec's baseline), bulk-loaded from the point store through an SST file,
  its block cache sized like the hot-row cache; a batch's distinct keys are one ``multi_get``.
- ``embedding-bag``: every row in a ``torch.nn.EmbeddingBag`` (sum mode) over the keys' indexes,
  no deduplication, no tiers: the all-in-memory bound.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from hpsray.data.batch import Batch
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.serving.pointstore import PointStore

__all__ = ["BACKENDS", "EmbeddingBagLookup", "RocksDBLookup"]

BACKENDS = ("hpsray", "rocksdb", "embedding-bag")


class RocksDBLookup:
    """Rows by key from RocksDB (see the module docstring); keys are 8 big-endian bytes."""

    def __init__(self, store: PointStore, cache_rows: int, init: RowInit) -> None:
        from rocksdict import BlockBasedOptions, Cache, Options, Rdict, SstFileWriter

        self.dim, self.init = store.dim, init
        path = os.path.join(store.directory, "..", "rocksdb")
        path = os.path.abspath(path)
        opts = Options(raw_mode=True)
        table = BlockBasedOptions()
        table.set_block_cache(Cache(max(1 << 20, cache_rows * (8 + 4 * store.dim))))
        opts.set_block_based_table_factory(table)
        if not os.path.exists(os.path.join(path, "CURRENT")):
            tmp = f"{path}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            sst = os.path.join(tmp, "rows.sst")
            writer = SstFileWriter(options=opts)
            writer.open(sst)
            kb = np.asarray(store.keys).astype(">u8").tobytes()
            rb = store.read_all().tobytes()
            w = 4 * store.dim
            for i in range(len(store)):  # a baseline's bulk load: RocksDB takes bytes one pair at a time
                writer[kb[8 * i : 8 * i + 8]] = rb[w * i : w * i + w]
            writer.finish()
            db = Rdict(os.path.join(tmp, "db"), opts)
            db.ingest_external_file([sst])
            db.close()
            os.remove(sst)
            try:
                os.rename(os.path.join(tmp, "db"), path)
            except OSError:
                pass
            shutil.rmtree(tmp, ignore_errors=True)
        self.db = Rdict(path, opts)
        self.lookups = 0

    def rows(self, unique_keys: np.ndarray) -> np.ndarray:
        kb = unique_keys.astype(">u8").tobytes()
        values = self.db.get([kb[8 * i : 8 * i + 8] for i in range(unique_keys.size)])
        assert values is not None  # a list of keys gets a list (rocksdict's stub says Any | None)
        self.lookups += unique_keys.size
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return np.frombuffer(b"".join(values), np.float32).reshape(unique_keys.size, self.dim).copy()
        out = np.empty((unique_keys.size, self.dim), np.float32)
        zero = bytes(4 * self.dim)
        out[:] = np.frombuffer(b"".join(v if v is not None else zero for v in values), np.float32).reshape(out.shape)
        idx = np.asarray(missing)
        out[idx] = initial_rows(unique_keys[idx], self.dim, self.init)
        return out

    def stats(self) -> dict:
        return {"mode": "rocksdb", "lookups": self.lookups}


class EmbeddingBagLookup:
    """All rows in a ``torch.nn.EmbeddingBag``; :meth:`pooled` replaces dedupe + gather + pooling."""

    def __init__(self, store: PointStore) -> None:
        self.dim = store.dim
        self.keys = np.array(store.keys)
        self.bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(store.read_all()), freeze=True, mode="sum")
        self.lookups = 0

    def pooled(self, batch: Batch) -> torch.Tensor:
        """``[B, n_slots, dim]`` sum-pooled rows (keys absent from the model pool as row 0: the
        bound is measured on traffic whose keys are all in the model)."""
        idx = np.searchsorted(self.keys, batch.keys)
        np.minimum(idx, self.keys.size - 1, out=idx)
        self.lookups += idx.size
        out = self.bag(torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(batch.bag_offsets()))
        return out.view(len(batch), batch.n_slots, self.dim)

    def stats(self) -> dict:
        return {"mode": "embedding-bag", "rows_in_memory": int(self.keys.size), "lookups": self.lookups}
