"""GPU-path cases of serving, run in a subprocess by ``test_gpu_path.py`` (not collected by pytest).

Under ``NUMBA_ENABLE_CUDASIM=1`` (and again on a real GPU, marked ``gpu``): the aligned-access
gather over rows at their natural stride (from a registered host arena and from device memory)
and the device scatter equal a NumPy gather for every row width class (several rows per 128-byte
segment, rows straddling segments, several segments per row); the whole CUDA lookup (device tier,
mapped host tier, SSD) equals the CPU one and a NumPy gather of the point store over batches with
repeats; rows gathered are promoted into the device tier (device hits counted), stay exact while
it evicts, and are carried into a new model re-read from its store.

    python tests/serving/cudasim_cases.py RESULTS.json [CASE ...]

writes ``{"simulator": bool, "cuda": bool, "results": {case: "ok" | traceback}}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback

import numpy as np

CASES: dict = {}
DIMS = (1, 3, 4, 8, 16, 20, 24, 32, 33, 64, 100)


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def uva_gather_matches_numpy():
    """The aligned-access gather over rows at their natural stride, from a registered host arena
    (zero-copy) and from device memory, equals its CPU twin for every width class: several rows
    per 128-byte segment, rows straddling segments (dim 3, 20), one warp-wide row, wider rows."""
    from numba import config, cuda

    from hpsray.serving.uva import device_view, gather_rows, gather_rows_host, host_arena, release_view

    rng = np.random.default_rng(0)
    for dim in DIMS:
        n, m = 97, 61
        arena = host_arena(n, dim)  # host memory, registered with the device below
        assert arena.shape == (n, dim) and arena.strides[0] == 4 * dim
        arena[:] = rng.standard_normal(arena.shape).astype(np.float32)
        src = device_view(arena)
        src_rows = rng.integers(0, n, m).astype(np.int64)
        src_rows[::7] = -1  # rows this source does not hold: left as they are
        dst_rows = rng.permutation(m).astype(np.int64)
        want = np.full((m, dim), np.nan, np.float32)
        gather_rows_host(arena, src_rows, dst_rows, want)
        for source in (src, cuda.to_device(arena)):
            out = cuda.device_array((m, dim), np.float32)
            out.copy_to_device(np.full((m, dim), np.nan, np.float32))
            gather_rows(source, cuda.to_device(src_rows), cuda.to_device(dst_rows), out, dim)
            got = out.copy_to_host()
            assert np.array_equal(got, want, equal_nan=True), f"dim {dim}: the gather differs from its CPU twin"
            assert np.isnan(got[dst_rows[src_rows < 0]]).all() and not np.isnan(want[dst_rows[src_rows >= 0]]).any()
        release_view(src)
    try:  # rows must be at their natural stride
        gather_rows(
            np.zeros((4, 4), np.float32),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            cuda.device_array((1, 3), np.float32),
            3,
        )
    except ValueError:
        pass
    else:
        raise AssertionError("a padded source was accepted")
    assert config.ENABLE_CUDASIM or cuda.is_available()


@case
def scatter_matches_numpy():
    from numba import cuda

    from hpsray.serving.gds import scatter_rows

    rng = np.random.default_rng(1)
    for dim in (1, 8, 33):
        m = 40
        src = rng.standard_normal((m, dim)).astype(np.float32)
        dst = rng.permutation(m).astype(np.int64)
        out = cuda.to_device(np.zeros((m, dim), np.float32))
        scatter_rows(cuda.to_device(src), cuda.to_device(dst), out, dim)
        want = np.zeros((m, dim), np.float32)
        want[dst] = src
        assert np.array_equal(out.copy_to_host(), want)


@case
def device_reader_matches_point_store():
    """SSD rows into device rows (kvikio where installed, else a host copy + scatter) equal CPU reads."""
    from numba import cuda

    from hpsray.serving.gds import DeviceRowReader
    from hpsray.serving.pointstore import PointStore

    with tempfile.TemporaryDirectory() as d:
        store = PointStore(_write_store(d, n=300, dim=24))
        rows = np.array([5, 299, 0, 17, 17, 150], np.int64)
        dst = np.array([0, 1, 2, 3, 4, 5], np.int64)[::-1].copy()
        cpu = np.zeros((6, 24), np.float32)
        store.read_into(rows, cpu, dst)
        out = cuda.to_device(np.zeros((6, 24), np.float32))
        DeviceRowReader(store).read(rows, out, dst)
        assert np.array_equal(out.copy_to_host(), cpu)


@case
def cuda_lookup_matches_cpu():
    """The whole GPU lookup against the CPU one (rows handed to torch on a real GPU; the device
    array itself in the simulator, where torch has no CUDA)."""
    from numba import config

    from hpsray.kernels.init import RowInit
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.lookup import TieredLookup
    from hpsray.serving.pointstore import PointStore

    sim = bool(config.ENABLE_CUDASIM)
    with tempfile.TemporaryDirectory() as d:
        n, size = (1200, 100) if sim else (5000, 300)
        path = _write_store(d, n=n, dim=16)
        init = RowInit(dim=16, scale=0.01, seed=3)
        gpu, cpu = CudaTieredLookup(PointStore(path), 250, init), TieredLookup(PointStore(path), 250, init)
        keys = np.fromfile(f"{path}/keys.u64", dtype=np.uint64)
        rng = np.random.default_rng(2)
        for _ in range(5):
            q = np.unique(np.concatenate([rng.choice(keys[:400], size), rng.integers(0, 2**63, 20).astype(np.uint64)]))
            got = gpu.rows_device(q).copy_to_host() if sim else gpu.rows(q).cpu().numpy()
            assert np.array_equal(got, cpu.rows(q))
        s = gpu.stats()
        assert s["device_hits"] > 0 and s["host_hits"] >= 0 and s["ssd_reads"] > 0, s


@case
def three_tier_lookup_matches_numpy_gather():
    """Device tier + mapped host tier + SSD: over batches with repeats, every batch's rows equal a
    NumPy gather of the point store (initial rows for unseen keys), for a narrow and a wide row;
    each tier serves some rows, and every distinct key is counted once by exactly one of them."""
    from hpsray.kernels.init import RowInit
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.pointstore import PointStore

    for dim in (16, 33):
        with tempfile.TemporaryDirectory() as d:
            path = _write_store(d, n=400, dim=dim)
            init = RowInit(dim=dim, scale=0.01, seed=5)
            keys, rows, want = _oracle(path, dim, init)
            lookup = CudaTieredLookup(PointStore(path), 64, init, device_rows=16)
            assert lookup.device.capacity == 16 and lookup.cache.capacity == 64
            for q in _batches(keys, 8, 40, seed=dim):
                got = lookup.rows_device(q).copy_to_host()
                assert got.shape == (q.size, dim)
                assert np.array_equal(got, want(q)), f"dim {dim}: the three-tier lookup differs from NumPy"
            s = lookup.stats()
            assert s["device_hits"] > 0 and s["host_hits"] > 0 and s["ssd_reads"] > 0, s
            assert s["device_hits"] + s["host_hits"] + s["ssd_reads"] + s["unseen"] == s["lookups"], s
            _device_rows_hold_their_keys(lookup, want)


@case
def promotion_moves_rows_into_the_device_tier():
    """Rows read from SSD or hit in the host tier are promoted into device memory: the same keys
    asked again are device hits (counted), served exactly."""
    from hpsray.kernels.init import RowInit
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.pointstore import PointStore

    with tempfile.TemporaryDirectory() as d:
        path = _write_store(d, n=300, dim=8)
        init = RowInit(dim=8, scale=0.01, seed=7)
        keys, rows, want = _oracle(path, 8, init)
        # SSD -> device: no host tier, an empty device tier of 64 rows
        lookup = CudaTieredLookup(PointStore(path), 0, init, device_rows=64)
        q = keys[::37].copy()  # 9 keys: few enough that every set has a free entry
        assert np.array_equal(lookup.rows_device(q).copy_to_host(), want(q))
        s = lookup.stats()
        assert s["ssd_reads"] == q.size and s["device_hits"] == 0 and s["promoted"] == q.size, s
        assert (lookup.device.slots_of(q) >= 0).all()
        assert np.array_equal(lookup.rows_device(q).copy_to_host(), want(q))
        s = lookup.stats()
        assert s["device_hits"] == q.size and s["ssd_reads"] == q.size, s
        # host -> device: the host tier holds the rows (read once), the device tier none yet
        lookup = CudaTieredLookup(PointStore(path), 300, init, device_rows=0)
        lookup.rows_device(q)
        assert lookup.stats()["device_hits"] == 0 and lookup.device.capacity == 0
        three = CudaTieredLookup(PointStore(path), 300, init, device_rows=64)
        three.rows_device(q)  # SSD -> host and device
        three.device.directory.keys[:] = np.iinfo(np.uint64).max  # forget the device tier: EMPTY_KEY
        three.device.directory.counts[:] = 0
        assert np.array_equal(three.rows_device(q).copy_to_host(), want(q))  # host hits, promoted again
        s = three.stats()
        assert s["host_hits"] == q.size and s["ssd_reads"] == q.size and s["promoted"] == 2 * q.size, s
        assert np.array_equal(three.rows_device(q).copy_to_host(), want(q))
        assert three.stats()["device_hits"] == q.size
        _device_rows_hold_their_keys(three, want)


@case
def rows_stay_exact_after_the_device_tier_evicts():
    """A device tier of 8 rows (2 sets) under many distinct keys: entries age and are replaced
    again and again; every batch stays equal to NumPy, and every device slot holds its key's row."""
    from hpsray.kernels.init import RowInit
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.pointstore import PointStore

    with tempfile.TemporaryDirectory() as d:
        path = _write_store(d, n=400, dim=24)
        init = RowInit(dim=24, scale=0.01, seed=9)
        keys, rows, want = _oracle(path, 24, init)
        lookup = CudaTieredLookup(PointStore(path), 40, init, device_rows=8)
        rng = np.random.default_rng(4)
        replaced = 0
        for b in range(10):
            # a hot core asked every batch, plus a different spread of cold keys each batch
            q = rng.permutation(np.unique(np.concatenate([keys[:6], keys[rng.integers(6, keys.size, 20)]])))
            before = lookup.device.directory.keys.copy()
            assert np.array_equal(lookup.rows_device(q).copy_to_host(), want(q)), f"batch {b} differs"
            after = lookup.device.directory.keys
            replaced += int(((before != after) & (before != np.iinfo(np.uint64).max)).sum())
            assert _device_rows_hold_their_keys(lookup, want) > 0
        s = lookup.stats()
        assert replaced > 0, "the device tier never evicted a row"
        assert s["promoted"] > lookup.device.capacity and s["device_hits"] > 0, s


@case
def hot_rows_carried_to_a_new_model_are_re_read():
    """A model swap (an export with the same keys, other rows): both tiers of the new lookup start
    with the old one's keys, their rows read from the new store, so the first batch hits the
    device tier and serves the new rows, never the old."""
    from hpsray.kernels.init import RowInit
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.pointstore import PointStore

    with tempfile.TemporaryDirectory() as d:
        old_path = _write_store(d, n=300, dim=16)
        new_path = _write_store(d, n=300, dim=16, sub="point-new", row_seed=99)
        init = RowInit(dim=16, scale=0.01, seed=11)
        keys, _, _ = _oracle(old_path, 16, init)
        _, _, want_new = _oracle(new_path, 16, init)
        old = CudaTieredLookup(PointStore(old_path), 64, init, device_rows=32)
        q = keys[::29].copy()
        old.rows_device(q)
        new = CudaTieredLookup(PointStore(new_path), 64, init, device_rows=32, warm_from=old)
        assert new.carried >= 2 * q.size  # each key in both tiers
        assert np.array_equal(new.rows_device(q).copy_to_host(), want_new(q))
        s = new.stats()
        assert s["device_hits"] == q.size and s["ssd_reads"] == 0, s
        _device_rows_hold_their_keys(new, want_new)


@case
def device_driven_lookup_gathers_through_the_kernel():
    """The device-driven lookup (NumPy arrays) with both tiers gathering through the CUDA kernel
    (``gather_rows``, rows a tier misses passed as ``-1``) instead of its NumPy twin: every batch
    equals a NumPy gather of the point store while the tiers fill and evict."""
    from hpsray.kernels.init import RowInit
    from hpsray.serving.device_driven import DeviceDrivenLookup
    from hpsray.serving.pointstore import PointStore

    with tempfile.TemporaryDirectory() as d:
        path = _write_store(d, n=200, dim=8)
        init = RowInit(dim=8, scale=0.01, seed=5)
        keys, _, want = _oracle(path, 8, init)
        lookup = DeviceDrivenLookup(PointStore(path), 24, init, device_rows=8)
        lookup.device.kernel = lookup.host.kernel = True
        for b, q in enumerate(_batches(keys, 5, 12, seed=6, hot=10)):
            q = np.sort(q)  # distinct keys in order, as a layout's are
            assert np.array_equal(lookup.rows(q), want(q)), f"batch {b} differs"
        s = lookup.stats()
        assert s["device_hits"] > 0 and s["host_hits"] > 0 and s["ssd_reads"] > 0, s
        lookup.close()


@case
def device_rows_sizing():
    """The device tier's size: given (at most the rows), refused past the free memory, and by
    default the smaller of the memory rows and a quarter of the free device memory."""
    from hpsray.errors import ServingError
    from hpsray.serving.device_cache import device_rows_for

    row = 64  # bytes of a dim-16 row
    assert device_rows_for(1000, 300, None, 16, free_bytes=float("inf")) == 300
    assert device_rows_for(1000, 300, None, 16, free_bytes=100 * row) == 25
    assert device_rows_for(1000, 0, None, 16, free_bytes=float("inf")) == 0
    assert device_rows_for(1000, 300, 2000, 16, free_bytes=float("inf")) == 1000
    assert device_rows_for(1000, 300, 10, 16, free_bytes=10 * row) == 10
    assert device_rows_for(1000, 300, None, 16) == 300  # the simulator reports infinite memory
    for bad, err in ((11, ServingError), (-1, ValueError)):
        try:
            device_rows_for(1000, 300, bad, 16, free_bytes=10 * row)
        except err:
            pass
        else:
            raise AssertionError(f"device_rows {bad} was accepted")


def _write_store(d: str, n: int, dim: int, sub: str = "point", row_seed: int | None = None) -> str:
    """A point store of ``n`` random keys (the same keys for the same ``n``) and random rows
    (``row_seed``: other rows for the same keys)."""
    import json as _json
    import os

    from hpsray.serving.layout import FORMAT, row_stride

    rng = np.random.default_rng(n)
    keys = np.unique(rng.integers(0, 2**63, n * 2).astype(np.uint64))[:n]
    if row_seed is not None:
        rng = np.random.default_rng(row_seed)
    stride = row_stride(dim)
    rows = np.zeros((n, stride // 4), np.float32)
    rows[:, :dim] = rng.standard_normal((n, dim))
    path = os.path.join(d, sub)
    os.makedirs(path)
    keys.tofile(os.path.join(path, "keys.u64"))
    rows.tofile(os.path.join(path, "rows.f32"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        _json.dump({"format": FORMAT, "version": 1, "dim": dim, "rows": n, "stride": stride}, f)
    return path


def _oracle(path: str, dim: int, init):
    """``want(q)``: a NumPy gather of the point store's rows for ``q`` (initial rows for unseen keys)."""
    from hpsray.kernels.init import initial_rows

    keys = np.fromfile(f"{path}/keys.u64", dtype=np.uint64)
    rows = np.fromfile(f"{path}/rows.f32", dtype=np.float32).reshape(keys.size, -1)[:, :dim]

    def want(q: np.ndarray) -> np.ndarray:
        pos = np.minimum(np.searchsorted(keys, q), keys.size - 1)
        found = keys[pos] == q
        out = np.empty((q.size, dim), np.float32)
        out[found] = rows[pos[found]]
        out[~found] = initial_rows(q[~found], dim, init)
        return out

    return keys, rows, want


def _batches(keys: np.ndarray, n_batches: int, size: int, seed: int, hot: int = 60) -> list[np.ndarray]:
    """Distinct-key batches with repeats across them: Zipf-like picks (the first ``hot`` keys
    most), a few random keys of the store, a few keys it lacks (unseen)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ranks = np.minimum(rng.zipf(1.3, size), keys.size) - 1
        q = np.concatenate(
            [
                keys[ranks % hot],
                keys[rng.integers(0, keys.size, size // 4)],
                rng.integers(0, 2**63, 3).astype(np.uint64),
            ]
        )
        out.append(rng.permutation(np.unique(q)))
    return out


def _device_rows_hold_their_keys(lookup, rows_of) -> int:
    """Every occupied device slot holds its key's row exactly; returns the occupied slots."""
    from hpsray.kernels.hashing import EMPTY_KEY

    d = lookup.device
    occupied = np.flatnonzero(d.directory.keys != EMPTY_KEY)
    held = d.rows.copy_to_host()[occupied, : lookup.dim]
    assert np.array_equal(held, rows_of(d.directory.keys[occupied])), "a device slot holds a wrong row"
    return int(occupied.size)


def main(argv: list[str]) -> int:
    out_path, names = argv[0], argv[1:] or list(CASES)
    if not hasattr(np, "row_stack"):  # numpy 2.5 dropped it; numba-cuda's array overloads still name it
        np.row_stack = np.vstack
    from numba import config, cuda

    report = {"simulator": bool(config.ENABLE_CUDASIM), "cuda": bool(cuda.is_available()), "results": {}}
    if report["cuda"]:
        for name in names:
            try:
                CASES[name]()
                report["results"][name] = "ok"
            except Exception:
                report["results"][name] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
