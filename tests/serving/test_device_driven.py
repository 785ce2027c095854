"""The device-driven path on the CPU (NumPy: the lines a GPU runs with CuPy), the parallel block
reads of SSD misses, and rows at their natural stride in memory."""

from __future__ import annotations

import json
import os
import shutil
import threading
import types
from collections import Counter

import numpy as np
import pytest
from conftest import N_DENSE, N_SLOTS, close, raw_examples

from hpsray.data.batch import Batch
from hpsray.errors import ServingError
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.init import RowInit, initial_rows
from hpsray.models.pooling import BagLayout
from hpsray.serving import LoadOptions, ServableModel
from hpsray.serving.blockread import BlockReader, plan_ranges
from hpsray.serving.device_driven import DeviceDrivenLookup, Directory, Transfers, device_layout
from hpsray.serving.layout import build_point_store, row_stride
from hpsray.serving.pointstore import PointStore
from hpsray.serving.uva import host_arena, windows_per_row


def _batch(rng, n: int, n_slots: int = 5, shuffle: bool = True) -> Batch:
    """``n`` examples, 0-3 keys per slot (empty bags, multi-hot), repeated keys, and (``shuffle``)
    an example's keys not in slot order."""
    keys, slots, offsets = [], [], [0]
    for _ in range(n):
        s = np.repeat(np.arange(n_slots, dtype=np.int32), rng.integers(0, 4, n_slots))
        if shuffle:
            s = rng.permutation(s)
        slots.append(s)
        keys.append(rng.integers(1, 40, s.size).astype(np.uint64) * np.uint64(7919))
        offsets.append(offsets[-1] + s.size)
    return Batch(
        labels=np.zeros(n, np.float32),
        dense=np.zeros((n, 2), np.float32),
        keys=np.concatenate(keys) if keys else np.empty(0, np.uint64),
        offsets=np.asarray(offsets, np.int64),
        slots=np.concatenate(slots) if slots else np.empty(0, np.int32),
        n_slots=n_slots,
    )


@pytest.mark.parametrize("n,shuffle", [(1, False), (37, False), (37, True), (200, True)])
def test_device_layout_equals_the_host_layout(n, shuffle):
    rng = np.random.default_rng(n)
    batch = _batch(rng, n, shuffle=shuffle)
    transfers = Transfers(np)
    got, want = device_layout(batch, np, transfers), BagLayout.of(batch)
    assert np.array_equal(got.unique_keys, want.unique_keys)
    assert np.array_equal(got.inverse, want.inverse)
    assert np.array_equal(got.bag_offsets, want.bag_offsets)
    assert (got.n_examples, got.n_slots) == (want.n_examples, want.n_slots)
    assert transfers.h2d == {"keys": 1}  # keys, slots and offsets in one upload


def test_device_layout_of_a_batch_without_keys():
    batch = Batch(
        labels=np.zeros(3, np.float32),
        dense=np.zeros((3, 1), np.float32),
        keys=np.empty(0, np.uint64),
        offsets=np.zeros(4, np.int64),
        slots=np.empty(0, np.int32),
        n_slots=2,
    )
    got = device_layout(batch, np, Transfers(np))
    assert got.unique_keys.size == 0 and got.inverse.size == 0 and np.array_equal(got.bag_offsets, np.zeros(6))


def test_directory_admits_free_entries_and_ages_full_sets():
    d = Directory(8, np)  # 2 sets of 4
    assert d.n_sets == 2
    even = np.arange(2, 20, 2, dtype=np.uint64)  # 9 keys, all in set 0
    slots = d.admit(even)
    assert (slots >= 0).sum() == 4 and set(slots[slots >= 0] // 4) == {0}  # the set's 4 free entries
    held = even[slots >= 0]
    assert np.array_equal(d.locate(even) >= 0, slots >= 0)
    for _ in range(3):
        d.probe(held)  # hot: counts 4
    assert d.counts() == (12, 12)
    turned = even[slots < 0]
    assert (d.admit(turned) < 0).all()  # a full set turns them away, aging its counts by 5: 4 -> 0
    assert (d.locate(held) >= 0).all()  # not evicted
    assert (d.admit(turned[:2]) >= 0).all()  # now they get in, over entries whose count reached 0
    assert (d.locate(turned[:2]) >= 0).all()
    assert (Directory(0, np).admit(even) == -1).all() and (Directory(0, np).probe(even) == -1).all()


def _oracle(store: PointStore, init: RowInit):
    keys = np.asarray(store.keys)
    rows = store.read_all()

    def want(q: np.ndarray) -> np.ndarray:
        pos = np.minimum(np.searchsorted(keys, q), keys.size - 1)
        found = keys[pos] == q
        out = np.empty((q.size, store.dim), np.float32)
        out[found] = rows[pos[found]]
        out[~found] = initial_rows(q[~found], store.dim, init)
        return out

    return keys, want


def _held_rows_are_exact(tier, want) -> int:
    keys = tier.directory.keys
    occupied = np.flatnonzero(keys != EMPTY_KEY)
    assert np.array_equal(tier.rows[occupied], want(keys[occupied])), "a slot holds a wrong row"
    return int(occupied.size)


def test_device_driven_lookup_is_exact_through_three_tiers_while_they_evict(exports):
    store = PointStore(build_point_store(exports["parquet"]))
    init = RowInit(dim=8, scale=0.02, seed=3)
    keys, want = _oracle(store, init)
    lookup = DeviceDrivenLookup(store, 64, init, device_rows=16)
    rng = np.random.default_rng(5)
    for _ in range(12):
        hot = keys[np.minimum(rng.zipf(1.3, 150), 200) - 1]
        q = rng.permutation(
            np.unique(np.concatenate([hot, rng.choice(keys, 60), rng.integers(1, 2**63, 3, np.uint64)]))
        )
        assert np.array_equal(lookup.rows(q), want(q))
        assert _held_rows_are_exact(lookup.host, want) > 0 and _held_rows_are_exact(lookup.device, want) > 0
    s = lookup.stats()
    assert s["device_hits"] > 0 and s["host_hits"] > 0 and s["ssd_reads"] > 0 and s["unseen"] >= 3, s
    assert s["device_hits"] + s["host_hits"] + s["ssd_reads"] + s["unseen"] == s["lookups"], s
    assert 0 < s["reads_per_missed_row"] <= 1
    assert s["row_bytes_in_memory"] == 4 * 8  # natural stride


@pytest.mark.parametrize("mem", [None, 0.05])
def test_device_driven_predictions_equal_the_reference_with_one_upload_of_keys(planted, trained, exports, mem):
    batch, examples = raw_examples(planted, 300)
    model = ServableModel.load(exports["parquet"], LoadOptions(mem_fraction=mem, driver="device", device_rows=40))
    assert isinstance(model.lookup, DeviceDrivenLookup)
    parsed = model.parser.parse_body(json.dumps({"examples": examples}).encode())
    want = trained.predict(batch)
    n = 4
    for _ in range(n):  # cold, then warm tiers
        assert close(model.predict(parsed), want)
    t = model.stats()["transfers"]
    up, down = t["host_to_device"], t["device_to_host"]
    assert up["keys"] == n and up["dense"] == n and down["probabilities"] == n  # one of each per batch
    assert down["miss_keys"] == n  # the missed keys and their count, in one copy per batch
    assert 0 < up.get("rows", 0) <= n  # their rows up, in one copy, in the batches with misses
    assert set(up) <= {"keys", "dense", "rows"} and set(down) <= {"probabilities", "miss_keys"}


def test_device_driven_swap_carries_hot_keys_with_the_new_rows(planted, trained, exports, tmp_path):
    from hpsray.data.generate import dataset_schema
    from hpsray.export import export

    d = str(tmp_path / "m")
    shutil.copytree(exports["parquet"], d)
    opts = LoadOptions(mem_fraction=0.2, driver="device", device_rows=64)
    old = ServableModel.load(d, opts)
    keys, rows, dense = trained.export()
    hot = keys[:: max(1, keys.size // 40)]
    for _ in range(2):
        old.lookup.rows(hot)
    rows2 = rows.copy()
    rows2[:, :8] += 1.0
    schema = dataset_schema(planted, "parquet")
    export((keys, rows2, dense), d, trained.config, n_slots=N_SLOTS, n_dense=N_DENSE, schema=schema)
    new = ServableModel.load(d, opts, previous=old)
    assert new.lookup.carried >= hot.size  # in the device tier, most in the host tier too
    got = new.lookup.rows(hot)
    assert np.array_equal(got, rows2[np.searchsorted(keys, hot), :8])  # the new rows, never the old
    assert new.lookup.stats()["ssd_reads"] == 0


def _store(tmp_path, n: int = 3000, dim: int = 12) -> tuple[PointStore, np.ndarray]:
    from hpsray.serving.layout import FORMAT

    path = str(tmp_path / "point")
    os.makedirs(path)
    stride = row_stride(dim)
    rows = np.zeros((n, stride // 4), np.float32)
    rows[:, :dim] = np.random.default_rng(n).standard_normal((n, dim))
    np.arange(1, n + 1, dtype=np.uint64).tofile(os.path.join(path, "keys.u64"))
    rows.tofile(os.path.join(path, "rows.f32"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"format": FORMAT, "version": 1, "dim": dim, "rows": n, "stride": stride}, f)
    return PointStore(path), rows[:, :dim]


def test_ranges_merge_rows_of_near_blocks_and_nothing_else():
    stride, nbytes = 64, 48  # 64 rows per 4 KiB block
    r = plan_ranges(np.array([130, 0, 1, 2, 64, 5000, 5001], np.int64), stride, nbytes)
    # 0,1,2 and 64 (the next block: a gap of 61 rows < 4 KiB) and 130 (gap 65 rows: 4112 bytes > 4 KiB) ...
    assert [r.rows[a:b].tolist() for a, b in zip(r.starts[:-1], r.starts[1:])] == [[0, 1, 2, 64], [130], [5000, 5001]]
    assert r.lengths.tolist() == [64 * 64 + 48, 48, 64 + 48] and r.offsets.tolist() == [0, 130 * 64, 5000 * 64]
    assert len(plan_ranges(np.arange(2000), stride, nbytes)) == 4  # at most 512 rows (1023 I/O vectors) per read
    with pytest.raises(ValueError, match="distinct"):
        plan_ranges(np.array([3, 3]), stride, nbytes)


def test_block_reads_equal_the_point_store_under_concurrent_requests(tmp_path):
    store, rows = _store(tmp_path)
    reader = store.block_reader(threads=4)
    errors: list[str] = []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(25):
            fr = rng.choice(len(store), int(rng.integers(1, 800)), replace=False)
            dst = rng.permutation(fr.size)
            out = np.full((fr.size, store.dim), np.nan, np.float32)
            reader.read_into(fr, out, dst)
            if not np.array_equal(out[dst], rows[fr]):
                errors.append(f"client {seed}: rows differ")

    threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert reader.rows > 0 and reader.reads_per_row < 1  # rows of a block share a read


def test_block_reads_refuse_bad_input_and_report_a_truncated_file(tmp_path):
    store, _ = _store(tmp_path, n=500)
    reader = store.block_reader()
    out = np.zeros((2, store.dim), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        reader.read_into(np.array([0, 500]), out, np.array([0, 1]))
    with pytest.raises(ValueError, match="float32"):
        reader.read_into(np.array([0]), np.zeros((1, store.dim), np.float64), np.array([0]))
    with pytest.raises(ValueError, match="output rows"):
        reader.read_into(np.array([0]), out, np.array([2]))
    twice = np.zeros((3, store.dim), np.float32)
    reader.read_into(np.array([7, 9, 7]), twice, np.array([2, 0, 1]))  # a row asked twice: read once, copied
    assert np.array_equal(twice[[2, 1]], np.stack([store.lookup(np.array([8], np.uint64))[1][0]] * 2))
    os.truncate(store.rows_path, 100 * store.stride)
    with pytest.raises(ServingError, match="short read"):
        BlockReader(store.rows_path, 500, store.dim, store.stride).read_into(np.array([3, 400]), out, np.array([0, 1]))


def test_tiered_lookup_reads_misses_in_blocks_or_from_the_map_alike(exports):
    from hpsray.serving.lookup import TieredLookup

    path = build_point_store(exports["parquet"])
    init = RowInit(dim=8, scale=0.02, seed=3)
    blocks = TieredLookup(PointStore(path), 100, init, ssd_read="blocks")
    mapped = TieredLookup(PointStore(path), 100, init, ssd_read="mmap")
    keys = np.asarray(blocks.store.keys)
    rng = np.random.default_rng(2)
    for _ in range(4):
        q = np.unique(rng.choice(keys, 700))
        assert np.array_equal(blocks.rows(q), mapped.rows(q))
    assert 0 < blocks.stats()["reads_per_missed_row"] < 1 and mapped.stats()["reads_per_missed_row"] is None
    with pytest.raises(ValueError, match="ssd_read"):
        LoadOptions(ssd_read="pread")


def test_auto_reads_a_rows_file_that_fits_the_page_cache_through_the_map():
    from hpsray.serving.lookup import resolve_ssd_read

    gib = 1 << 30
    assert resolve_ssd_read("auto", 1 * gib, available_bytes=8 * gib) == "mmap"  # stays cached
    assert resolve_ssd_read("auto", 3 * gib, available_bytes=8 * gib) == "blocks"  # will be read from disk
    assert resolve_ssd_read("blocks", 1, available_bytes=8 * gib) == "blocks"
    assert resolve_ssd_read("mmap", 100 * gib, available_bytes=8 * gib) == "mmap"
    assert resolve_ssd_read("auto", 1) in ("mmap", "blocks")  # this machine's MemAvailable
    with pytest.raises(ValueError, match="ssd_read"):
        resolve_ssd_read("pread", 1)


@pytest.mark.parametrize("dim", [1, 3, 16, 20, 33, 100])
def test_memory_rows_stay_at_their_natural_stride(dim):
    arena = host_arena(10, dim)
    assert arena.shape == (10, dim) and arena.strides[0] == 4 * dim and not arena.any()
    assert row_stride(dim) >= arena.strides[0]  # the point store's aligned stride, on disk only
    # an aligned access reads at most two windows of a narrow row, ceil(dim / 32) + 1 of a wide one
    w = windows_per_row(dim, np.arange(1000))
    assert w.max() <= (2 if dim <= 32 else -(-dim // 32) + 1)


def test_driver_options_are_checked():
    assert LoadOptions(driver="device", device_rows=3).device_rows == 3
    with pytest.raises(ValueError, match="driver must be"):
        LoadOptions(driver="gpu")
    with pytest.raises(ValueError, match="baseline"):
        LoadOptions(driver="device", backend="rocksdb")


# --- host syncs per batch, counted on the NumPy twin ---------------------------------------------

SYNCS: Counter[str] = Counter()
"""What :class:`DeviceLike` arrays and :class:`CountingXp` saw that would make a CUDA host wait."""


def _bool_key(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray) and k.dtype == bool and k.ndim > 0 for k in keys)


class DeviceLike(np.ndarray):
    """A NumPy array standing for a CuPy one: counts in :data:`SYNCS` each use that syncs on CUDA
    (a boolean mask, whose result size the host must learn; a value read on the host: ``int``,
    ``bool``, ``float``, ``item``, ``tolist``; ``nonzero``; a download)."""

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        return np.asarray(arr).view(DeviceLike)  # reductions stay on the "device", as CuPy's do

    def __getitem__(self, key):
        if _bool_key(key):
            SYNCS["boolean mask"] += 1
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        if _bool_key(key):
            SYNCS["boolean mask"] += 1
        super().__setitem__(key, value)

    def _read(self, what: str):
        SYNCS[what] += 1
        return np.asarray(self)

    def __int__(self):
        return int(self._read("int()"))

    def __float__(self):
        return float(self._read("float()"))

    def __bool__(self):
        return bool(self._read("bool()"))

    def __index__(self):
        return self._read("index").__index__()

    def item(self, *args):
        return self._read("item()").item(*args)

    def tolist(self):
        return self._read("tolist()").tolist()

    def nonzero(self):
        return self._read("nonzero()").nonzero()

    def get(self):
        return self._read("download")


class CountingXp(types.ModuleType):
    """NumPy as an array module whose arrays are :class:`DeviceLike`; the functions whose output
    size depends on the data (``flatnonzero``, ``nonzero``, ``unique``, ...) count a sync."""

    SYNCING = frozenset({"flatnonzero", "nonzero", "argwhere", "unique", "compress", "extract", "bincount"})

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name: str):
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr
        syncing = name in self.SYNCING

        def call(*args, **kwargs):
            if syncing:  # one sync, whatever the call does inside
                SYNCS[f"xp.{name}"] += 1
                args = tuple(np.asarray(a) if isinstance(a, DeviceLike) else a for a in args)
            out = attr(*args, **kwargs)
            if isinstance(out, np.ndarray):
                return out.view(DeviceLike)
            if isinstance(out, tuple):
                return tuple(o.view(DeviceLike) if isinstance(o, np.ndarray) else o for o in out)
            return out

        return call


def _count_syncs(lookup: DeviceDrivenLookup, batches: list[Batch]) -> list[dict]:
    """Per batch: ``{"layout": syncs, "rows": syncs, "downloads": d2h copies, "uploads": h2d}``;
    the rows checked against the point store (initial rows for unseen keys)."""
    _, want = _oracle(lookup.store, lookup.init)
    out = []
    for batch in batches:
        h2d, d2h = sum(lookup.transfers.h2d.values()), sum(lookup.transfers.d2h.values())
        SYNCS.clear()
        layout = lookup.layout(batch)
        n_layout = sum(SYNCS.values())
        SYNCS.clear()
        rows = lookup.rows(layout.unique_keys)
        n_rows = sum(SYNCS.values())
        assert np.array_equal(np.asarray(rows), want(np.asarray(layout.unique_keys)))
        out.append(
            {
                "layout": n_layout,
                "rows": n_rows,
                "what": dict(SYNCS),
                "downloads": sum(lookup.transfers.d2h.values()) - d2h,
                "uploads": sum(lookup.transfers.h2d.values()) - h2d,
            }
        )
    return out


def _sync_workload(exports) -> tuple[DeviceDrivenLookup, list[Batch]]:
    store = PointStore(build_point_store(exports["parquet"]))
    keys = np.asarray(store.keys)
    rng = np.random.default_rng(8)
    batches = []
    for _ in range(6):  # hot keys (device hits), others (host hits, SSD reads), unseen keys
        b = _batch(rng, 60)
        hot = keys[np.minimum(rng.zipf(1.3, b.nnz), 300) - 1]
        k = np.where(rng.random(b.nnz) < 0.97, hot, rng.integers(1, 2**63, b.nnz, np.uint64))
        batches.append(Batch(b.labels, b.dense, k.astype(np.uint64), b.offsets, b.slots, b.n_slots))
    return DeviceDrivenLookup(store, 64, RowInit(dim=8, scale=0.02, seed=3), device_rows=16, xp=CountingXp()), batches


def test_a_batch_syncs_once_for_its_layout_and_once_for_its_misses(exports):
    """The device-driven lookup on the NumPy twin with every would-be sync counted: per batch one
    upload of keys and one count read in the layout (the distinct keys), one download in the rows
    (the missed keys and their count together) and one upload of the missed rows; nothing else."""
    lookup, batches = _sync_workload(exports)
    counts = _count_syncs(lookup, batches)
    assert all(c["layout"] <= 1 and c["rows"] == 0 for c in counts), counts
    assert all(c["downloads"] == 1 and c["uploads"] <= 2 for c in counts), counts
    s = lookup.stats()
    assert s["device_hits"] > 0 and s["host_hits"] > 0 and s["ssd_reads"] > 0 and s["unseen"] > 0, s


@pytest.mark.parametrize("fault", ["item", "mask", "flatnonzero"])
def test_the_sync_count_sees_a_sync_injected_into_a_batch(exports, monkeypatch, fault):
    """The guard above, shown failing: a read-back, a boolean mask or a flatnonzero injected into
    the host directory's probe is counted once per batch."""
    lookup, batches = _sync_workload(exports)
    probe = Directory.probe

    def probe_with_a_sync(self, keys, *args, **kwargs):
        slots = probe(self, keys, *args, **kwargs)
        if self is lookup.host.directory:
            if fault == "item":
                (slots >= 0).sum().item()
            elif fault == "mask":
                slots[slots >= 0]
            else:
                self.xp.flatnonzero(slots >= 0)
        return slots

    monkeypatch.setattr(Directory, "probe", probe_with_a_sync)
    counts = _count_syncs(lookup, batches)
    assert all(c["rows"] == 1 for c in counts), counts
