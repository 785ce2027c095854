"""The in-process measurements of ``hpsray bench serve`` (no HTTP, no JSON): each system's
``predict``, the tiered model's two miss readers warm and cold, and following one delta."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from hpsray.bench.serve_workload import load_options, request_bodies

if TYPE_CHECKING:
    from hpsray.data import PlantedCTR
    from hpsray.serving import ServableModel
    from hpsray.serving.lookup import TieredLookup

T = TypeVar("T")


def in_process(
    model_dir: str,
    bodies: list[bytes],
    mem_fraction: float,
    systems: list[str],
    repeat: int = 3,
    device: str = "cpu",
    device_fraction: float = 0.01,
) -> dict:
    """Examples/s of each system's predict() on the same parsed batches (no HTTP, no JSON)."""
    from hpsray.models.threads import torch_threads
    from hpsray.serving import ServableModel
    from hpsray.serving.layout import read_meta

    with torch_threads(1):  # the caller's count restored after
        rows = int(read_meta(os.path.join(model_dir, "point"))["rows"])
        models: dict[str, ServableModel] = {}
        best: dict[str, float] = {}
        for system in systems:
            opts = load_options(system, mem_fraction, device, device_fraction, rows)
            models[system] = ServableModel.load(model_dir, opts)
        batches = [models[systems[0]].parser.parse_body(b) for b in bodies]
        for model in models.values():
            for b in batches:  # warm the cache, as the HTTP runs do
                model.predict(b)
        n = sum(len(b) for b in batches)
        for _ in range(repeat):
            for system, model in models.items():
                t0 = time.perf_counter()
                for b in batches:
                    model.predict(b)
                best[system] = max(best.get(system, 0.0), n / (time.perf_counter() - t0))
        keep = (
            "hit_rate",
            "ssd_reads",
            "rows_in_memory",
            "rows_on_device",
            "device_hits",
            "host_hits",
            "reads_per_missed_row",
            "row_bytes_in_memory",
            "ssd_read",
            "transfers",
        )
        return {
            s: {"examples_per_s": best[s], **{k: v for k, v in models[s].stats().items() if k in keep}} for s in systems
        }


def _evict(path: str, maps: list) -> None:
    """Drop ``path``'s pages from the page cache: this process's mappings of it let go first
    (``MADV_DONTNEED``: a mapped page is not dropped), the file written back (only clean pages
    go), then ``POSIX_FADV_DONTNEED``."""
    import mmap

    for m in maps:
        if m is not None:
            m.madvise(mmap.MADV_DONTNEED)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ssd_read(model_dir: str, bodies: list[bytes], mem_fraction: float, repeat: int = 3) -> dict:
    """The tiered model's predict() with misses read from the mapped file (``mmap``) and in merged
    ranges by parallel ``preadv`` (``blocks``), warm (rows file in the page cache) and cold (evicted
    before every batch): examples/s, best of ``repeat``, the two alternating."""
    from hpsray.models.threads import torch_threads
    from hpsray.serving import LoadOptions, ServableModel

    with torch_threads(1):  # the caller's count restored after
        models = {
            m: ServableModel.load(model_dir, LoadOptions(mem_fraction=mem_fraction, ssd_read=m))
            for m in ("mmap", "blocks")
        }
        batches = [models["mmap"].parser.parse_body(b) for b in bodies]
        n = sum(len(b) for b in batches)
        rows_file = os.path.join(_tiered(models["mmap"]).store.directory, "rows.f32")
        maps = [_tiered(m).store._map for m in models.values()]
        out: dict = {m: {} for m in models}
        for model in models.values():
            for b in batches:
                model.predict(b)
        for cond in ("warm", "cold"):
            best = dict.fromkeys(models, 0.0)
            for _ in range(repeat):
                for name, model in models.items():
                    spent = 0.0
                    for b in batches:
                        if cond == "cold":
                            _evict(rows_file, maps)
                        t0 = time.perf_counter()
                        model.predict(b)
                        spent += time.perf_counter() - t0
                    best[name] = max(best[name], n / spent)
            for name in models:
                out[name][f"{cond}_examples_per_s"] = best[name]
        for name in models:
            out[name]["reads_per_missed_row"] = models[name].stats()["reads_per_missed_row"]
        out["blocks_vs_mmap"] = {
            c: out["blocks"][f"{c}_examples_per_s"] / out["mmap"][f"{c}_examples_per_s"] for c in ("warm", "cold")
        }
        return out


def follow_delta(
    model_dir: str, gen: PlantedCTR, dim: int, mem_fraction: float, seed: int = 0, repeat: int = 3
) -> dict:
    """What serving pays to follow one incremental export of the model in ``model_dir``.

    A delta of the bench model (5 % of rows changed, 1 % removed, 1 % new keys) is exported
    beside it; then, medians of ``repeat``: the delta's point store merged from the base's
    (:func:`~hpsray.serving.layout.build_point_store`) against the same layout written from
    :func:`~hpsray.export.load_export`'s arrays and against a rebuild from the Parquet
    files; the replica's load of the new model (5 % tiered, the old model's hot rows carried;
    all in memory); and the cache hit rate of the first requests after the swap, carried against
    cold. Leaves the delta in ``model_dir``.
    """
    from hpsray.config import TrainConfig
    from hpsray.export import export, load_export
    from hpsray.serving import LoadOptions, ServableModel
    from hpsray.serving.layout import _padded, point_store_dir, row_stride

    keys, rows, dense = load_export(model_dir)
    rng = np.random.default_rng(seed + 1)
    rows = rows.copy()
    rows[rng.random(keys.size) < 0.05, :dim] += 1.0
    keep = rng.random(keys.size) >= 0.01
    new = np.setdiff1d(rng.integers(1, 2**63, keys.size // 100, dtype=np.uint64), keys)
    keys2 = np.concatenate([keys[keep], new])
    rows2 = np.concatenate([rows[keep], np.full((new.size, rows.shape[1]), 0.01, np.float32)])
    config = TrainConfig(dim=dim, sparse_optimizer="sgd", seed=seed)
    opts = LoadOptions(mem_fraction=mem_fraction)
    old = ServableModel.load(model_dir, opts)
    batches = [old.parser.parse_body(b) for b in request_bodies(gen, 256, 60)]
    for b in batches:  # the old model's cache warm, as on a serving replica
        old.predict(b)
    t0 = time.perf_counter()
    manifest = export((keys2, rows2, dense), model_dir, config, incremental=True)
    export_s = time.perf_counter() - t0
    delta_dir = os.path.join(model_dir, f"delta-{manifest['sequence']:06d}")
    scratch = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "layout-from-load-export")
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], T]) -> T:
        t = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t)
        return out

    def from_load_export() -> None:
        k, r, _ = load_export(model_dir)
        os.makedirs(scratch, exist_ok=True)
        with open(os.path.join(scratch, "keys.u64"), "wb") as f:
            f.write(k.data)
        with open(os.path.join(scratch, "rows.f32"), "wb") as f:
            f.write(_padded(r[:, :dim], row_stride(dim)).data)

    from hpsray.serving.layout import build_point_store

    for _ in range(repeat):
        shutil.rmtree(point_store_dir(delta_dir), ignore_errors=True)
        timed("merge_s", lambda: build_point_store(model_dir))
        timed("layout_from_load_export_s", from_load_export)
        timed("rebuild_from_parquet_s", lambda: build_point_store(model_dir, rebuild=True))
        new_model = timed("swap_load_tiered_s", lambda: ServableModel.load(model_dir, opts, previous=old))
        timed("swap_load_memory_s", lambda: ServableModel.load(model_dir))
    shutil.rmtree(scratch, ignore_errors=True)
    cold = ServableModel.load(model_dir, opts)
    hit = {}
    for name, model in (("carried", new_model), ("cold", cold)):
        c = _tiered(model).cache
        h0, n0 = c.hits, c.lookups
        for b in batches[:10]:
            model.predict(b)
        hit[name] = (c.hits - h0) / max(1, c.lookups - n0)
    return {
        "rows": int(manifest["rows"]),
        "changed": int(manifest["changed"]),
        "removed": int(manifest["removed"]),
        "export_delta_s": export_s,
        **{k: float(np.median(v)) for k, v in times.items()},
        "carried_rows": int(_tiered(new_model).carried),
        "cache_rows": int(_tiered(new_model).cache.capacity),
        "hit_rate_first_10_requests": hit,
    }


def _tiered(model: ServableModel) -> TieredLookup:
    """``model``'s lookup, a :class:`~hpsray.serving.lookup.TieredLookup` (a CPU model loaded with
    ``mem_fraction``: the only kind these measurements load)."""
    from hpsray.serving.lookup import TieredLookup

    if not isinstance(model.lookup, TieredLookup):
        raise TypeError(f"expected a tiered lookup, got {type(model.lookup).__name__}")
    return model.lookup
