"""Compile the engines' numba kernels before the clock starts.

numba compiles a kernel on its first call (and caches the machine code on disk for the next
process). On a fresh install that first call used to fall inside the first timed batch: a
pull of 5 s where 0.1 s is the real cost. Each stage actor therefore runs a throwaway copy of
its engine through every path a batch takes, on a few rows, while the pipeline waits for the
actors to come up (the report's ``startup_s``), so a new user's first figure is the real one.

The throwaway engines share nothing with the real ones: no file, row or counter of a run is
touched, so warming up cannot change what is trained. Arrays that reach an actor through Ray's
object store are read-only, and numba compiles separate code for read-only arrays: every path is
therefore run with writable and with read-only inputs.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from hpsray.data.batch import Batch
from hpsray.fileio import drop_cache
from hpsray.kernels.batch_index import in_bag_order, index_slots
from hpsray.kernels.distinct import warm_in_sorted
from hpsray.kernels.init import RowInit, initial_rows

__all__ = ["warm_cpu_table", "warm_mem_ps", "warm_ssd_ps", "warm_trainer_step", "tiny_batch"]

_KEYS = 96  # enough rows to evict, group duplicates and split over devices


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only copy of ``a``, as an array arrives from Ray's object store."""
    out = np.array(a)
    out.setflags(write=False)
    return out


def _keys(n: int = _KEYS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.unique(rng.integers(1, 2**62, size=n, dtype=np.int64).astype(np.uint64))


class _DictStore:
    """An in-memory backing store for a throwaway MEM-PS."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.rows: dict[int, np.ndarray] = {}

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        found = np.array([int(k) in self.rows for k in keys.tolist()], dtype=bool)
        rows = np.zeros((keys.size, self.width), dtype=np.float32)
        for i in np.flatnonzero(found):
            rows[i] = self.rows[int(keys[i])]
        return rows, found

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None:
        for k, r in zip(keys.tolist(), rows):
            self.rows[k] = np.array(r)


def warm_cpu_table() -> None:
    """Every verb of a throwaway CPU hash table MEM-PS uses, with writable and read-only inputs:
    the engines keep key maps in such tables, and grow them (an export) only once they fill up.
    Not ``apply_gradients``: only the trainer's HBM-PS and the reference apply gradients."""
    from hpsray.kernels.cpu import CpuHashTable

    keys = _keys(40)
    for k in (keys, _frozen(keys)):
        table = CpuHashTable(64, 3, RowInit(dim=3, scale=0.1))
        slots = table.find_or_insert(k)
        table.find_or_insert(k[:5], initialise=False)
        rows = table.gather(slots)
        table.put(slots if k.flags.writeable else _frozen(slots), rows if k.flags.writeable else _frozen(rows))
        table.scatter_add(k, rows)
        table.assign(k, rows)
        table.insert_or_assign(k, rows)
        table.get(k, columns=2)
        table.export()
        table.keys()
        table.erase(k[:3])


def warm_mem_ps(width: int, init: RowInit, **options: Any) -> None:
    """Pull (the load stage filling the misses), write back, evict and flush through a
    throwaway :class:`~hpsray.tiers.mem.MemPS` built with the real one's options; the
    lender's merge of sorted keys."""
    from hpsray.tiers.loans import Pulled
    from hpsray.tiers.mem import MemPS

    warm_cpu_table()
    warm_in_sorted()  # the lender's held keys
    options = {k: v for k, v in options.items() if k != "capacity_bytes"}
    keys = _keys()
    half = keys.size // 2
    store = _DictStore(width)
    mem = MemPS(half + 8, width, store, init, **options)
    parts = (keys[:half], keys[half:], keys[:half], keys[half:])  # the third and fourth pulls load back
    for batch_id, part in enumerate(parts):
        if batch_id % 2:
            part = _frozen(part)
        rows, missing = mem.pull(batch_id, part)
        rows, _ = Pulled(rows, missing, part[missing], init).load_missing(store.load)
        mem.write_back(batch_id, part, rows + 1.0 if batch_id % 2 == 0 else _frozen(rows + 1.0))
        mem.unpin(batch_id)
    for batch_id, part in ((4, keys[:8]), (5, _frozen(keys[:8]))):  # the pull path of keys already held
        mem.pull(batch_id, part)
        mem.unpin(batch_id)
    mem.peek(keys[:4])
    mem.flush()


def warm_ssd_ps(width: int, **options: Any) -> None:
    """Dump, load (partial files from the device and from the page cache, whole files) and scan
    through a throwaway SSD-PS in a temporary directory built with the real one's options."""
    from hpsray.tiers.ssd import SSDPS

    keys = _keys(1500)  # files of many blocks: a sparse load reads some of their blocks only
    initial_rows(keys[keys.size // 2 :][::3], width, RowInit(dim=width))  # the keys never stored
    rows = np.arange(keys.size * width, dtype=np.float32).reshape(keys.size, width)
    with tempfile.TemporaryDirectory(prefix="hpsray-warmup-") as directory:
        store = SSDPS(directory, width, **options)
        try:
            store.dump(keys, rows)
            store.dump(_frozen(keys[: keys.size // 3]), _frozen(rows[: keys.size // 3] + 1))  # a stale row count
            try:  # the first partial loads read blocks the page cache lacks
                drop_cache(os.path.join(directory, name) for name in os.listdir(directory))
            except OSError:
                pass  # a file system without the hint: its cold path compiles on first use
            for asked in (keys[::97], keys[::7], keys):
                store.load(asked)
                store.load(_frozen(asked))
            list(store.scan())
        finally:
            store.close()


def tiny_batch(n_slots: int, n_dense: int, examples: int = 24, seed: int = 0) -> Batch:
    """A few examples of the given shape (one or two keys per slot, some repeated)."""
    rng = np.random.default_rng(seed)
    per_example = rng.integers(n_slots, 2 * n_slots + 1, size=examples)
    offsets = np.zeros(examples + 1, dtype=np.int64)
    np.cumsum(per_example, out=offsets[1:])
    nnz = int(offsets[-1])
    slots = np.concatenate(
        [np.sort(np.concatenate([np.arange(n_slots), rng.integers(0, n_slots, m - n_slots)])) for m in per_example]
    ).astype(np.int32)
    keys = (rng.integers(1, 40, size=nnz).astype(np.uint64) << np.uint64(8)) + slots.astype(np.uint64)
    return Batch(
        labels=(rng.random(examples) < 0.5).astype(np.float32),
        dense=rng.standard_normal((examples, n_dense)).astype(np.float32),
        keys=keys,
        offsets=offsets,
        slots=slots,
        n_slots=n_slots,
    )


def warm_trainer_step(hbm_like: Any, init: RowInit, width: int, n_slots: int, n_dense: int) -> None:
    """What a batch's boundary asks of a trainer's table, with writable and read-only arrays,
    on a throwaway working set: insert, retain, erase, find, get and assign; and the step's
    fused sparse update and the batch's index on the CPU (the step's other ops are torch's,
    which compile nothing). ``hbm_like`` is a
    fresh, empty HBM-PS of the same shape as the trainer's."""
    from hpsray.training.fused_update import warm_fused_update

    warm_fused_update()
    warm_in_sorted()  # the working set's stale and kept keys
    batch = tiny_batch(n_slots, n_dense)
    keys = np.unique(batch.keys)
    half = keys.size // 2
    extra = keys[:half] | np.uint64(1 << 60)  # rows of an earlier batch, which retain() erases
    first = np.r_[keys[:half], extra]
    hbm_like.insert(first, initial_rows(first, width, init))
    hbm_like.insert(_frozen(keys), _frozen(initial_rows(keys, width, init)))
    hbm_like.retain(_frozen(keys))
    hbm_like.insert(extra, initial_rows(extra, width, init))
    hbm_like.retain(keys)
    hbm_like.insert(extra, initial_rows(extra, width, init))
    hbm_like.erase(extra)  # the engine's erase of the last batch's stale rows
    hbm_like.tables[0].find(_frozen(batch.keys))  # the engine's find once per batch
    hbm_like.tables[0].find(batch.keys)
    hbm_like.insert_or_assign(keys[:7], hbm_like.get(keys[:7]))
    hbm_like.insert_or_assign(_frozen(keys[:7]), _frozen(hbm_like.get(_frozen(keys[:7]))))
    slots = np.searchsorted(keys, batch.keys)
    for offsets, bag_slots in ((batch.offsets, batch.slots), (_frozen(batch.offsets), _frozen(batch.slots))):
        in_bag_order(offsets, bag_slots)  # the batch's index on the CPU
        index_slots(slots, offsets, bag_slots, n_slots, 8, keys.size)
