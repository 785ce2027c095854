"""GPU-path cases of serving, run in a subprocess by ``test_gpu_path.py`` (not collected by pytest).

Under ``NUMBA_ENABLE_CUDASIM=1`` (and again on a real GPU, marked ``gpu``): the UVA gather kernel
and the device scatter equal a NumPy gather for every row width class (several rows per 128-byte
segment, one row per segment, several segments per row), and, on a real GPU only, the whole CUDA
lookup equals the CPU one.

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
DIMS = (1, 4, 8, 16, 24, 32, 33, 64)


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def uva_gather_matches_numpy():
    from numba import config, cuda

    from hpsray.serving.uva import gather_rows, mapped_rows, stride_words

    rng = np.random.default_rng(0)
    for dim in DIMS:
        n, m = 97, 61
        src = mapped_rows(n, dim)  # pinned host memory mapped into the device
        assert src.shape == (n, stride_words(dim))
        src[:] = rng.standard_normal(src.shape).astype(np.float32)
        src_rows = rng.integers(0, n, m).astype(np.int64)
        dst_rows = rng.permutation(m).astype(np.int64)
        out = cuda.device_array((m, dim), np.float32)
        out.copy_to_device(np.full((m, dim), np.nan, np.float32))
        gather_rows(src, cuda.to_device(src_rows), cuda.to_device(dst_rows), out, dim)
        want = np.full((m, dim), np.nan, np.float32)
        want[dst_rows] = src[src_rows, :dim]
        got = out.copy_to_host()
        assert np.array_equal(got, want), f"dim {dim}: UVA gather differs from the NumPy gather"
    # a row's stride must match the alignment rule
    try:
        gather_rows(
            np.zeros((4, 3), np.float32),
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            cuda.device_array((1, 3), np.float32),
            3,
        )
    except ValueError:
        pass
    else:
        raise AssertionError("an unaligned stride was accepted")
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
    """The whole GPU lookup against the CPU one (real GPU only: it hands rows to torch on CUDA)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return
    from hpsray.kernels.init import RowInit
    from hpsray.serving.cuda_lookup import CudaTieredLookup
    from hpsray.serving.lookup import TieredLookup
    from hpsray.serving.pointstore import PointStore

    with tempfile.TemporaryDirectory() as d:
        path = _write_store(d, n=5000, dim=16)
        init = RowInit(dim=16, scale=0.01, seed=3)
        gpu, cpu = CudaTieredLookup(PointStore(path), 250, init), TieredLookup(PointStore(path), 250, init)
        keys = np.fromfile(f"{path}/keys.u64", dtype=np.uint64)
        rng = np.random.default_rng(2)
        for _ in range(5):
            q = np.unique(np.concatenate([rng.choice(keys[:400], 300), rng.integers(0, 2**63, 20).astype(np.uint64)]))
            assert np.array_equal(gpu.rows(q).cpu().numpy(), cpu.rows(q))


def _write_store(d: str, n: int, dim: int) -> str:
    import json as _json
    import os

    from hpsray.serving.layout import FORMAT, row_stride

    rng = np.random.default_rng(n)
    keys = np.unique(rng.integers(0, 2**63, n * 2).astype(np.uint64))[:n]
    stride = row_stride(dim)
    rows = np.zeros((n, stride // 4), np.float32)
    rows[:, :dim] = rng.standard_normal((n, dim))
    path = os.path.join(d, "point")
    os.makedirs(path)
    keys.tofile(os.path.join(path, "keys.u64"))
    rows.tofile(os.path.join(path, "rows.f32"))
    with open(os.path.join(path, "meta.json"), "w") as f:
        _json.dump({"format": FORMAT, "version": 1, "dim": dim, "rows": n, "stride": stride}, f)
    return path


def main(argv: list[str]) -> int:
    out_path, names = argv[0], argv[1:] or list(CASES)
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
