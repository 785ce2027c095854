"""``hpsray bench serve``: the latency–throughput curve of ``POST /predict`` against its baselines.

One run, one Ray Serve instance on loopback, one replica per system, all deployed at once:

* ``tiered``: hpsray with ``--mem-fraction`` (default 5 %) of the rows in the hot-row cache and
  the rest read from the point store on disk (GDRec's default split);
* ``memory``: hpsray with every row in memory;
* ``rocksdb``: the same rows in a RocksDB store (``rocksdict``; block cache sized like the hot-row
  cache) behind the same endpoint: the HugeCTR-inference / GDRec baseline;
* ``bound``: every row in a ``torch.nn.EmbeddingBag`` behind the same endpoint: the in-memory bound;
* ``driven``: hpsray's device-driven lookup (:mod:`hpsray.serving.device_driven`: one upload of the
  keys, dedupe, layout, probes and gathers in the array module) with the same rows in memory as
  ``tiered``, ``--device-fraction`` of them in the device tier;
* ``tiered-mmap`` / ``tiered-blocks``: ``tiered`` with its misses copied from the mapped rows file
  (``LoadOptions(ssd_read="mmap")``, the only path before issue 29) / read in merged ranges by
  parallel ``preadv`` (``"blocks"``), whatever ``auto`` would pick; opt in.

``--device cuda`` runs ``tiered`` as the CPU-driven GPU path (:mod:`hpsray.serving.cuda_lookup`:
the host dedupes and probes, the device gathers) and ``driven`` with CuPy, side by side on the
same GPU (default systems ``tiered,driven,rocksdb,bound``), the model's rows split alike: 5 % in
device + host memory (``--device-fraction`` of them on the device), the rest on disk. On
``--device cpu`` ``driven`` runs the same lines on NumPy (opt in with ``--systems``).

The model is synthetic (``--rows`` rows over 26 slots, 13 dense features, ``--dim``); requests
carry raw Zipf-distributed values (the planted generator's), so keys repeat as in CTR traffic.
For each (examples per request, concurrent clients) point, an aiohttp client drives each system
in turn for ``--seconds`` (after one warm-up pass over all), ``--repeat`` rounds; a point's
figures are the medians over the rounds. Taking the systems round-robin within a point means a
busy shared machine slows all of them alike, instead of whichever ran at the wrong minute.
The headline (``examples_per_s``, ``p50_ms``, ``p99_ms`` and the baselines' rates) is the point of
the largest batch and concurrency. The client runs on the same machine as the server.

Each point also reports ``cpu_ms_per_request``: CPU seconds (user + system, from ``/proc``) that
the system's replica, the Serve HTTP proxy and this process (the client) spent per answered
request, medians over the rounds. On a shared machine these move less with the neighbours' load
than the rates do, and they show which part of a request is the store's and which the endpoint's.

``--delta`` adds ``delta``: what following one incremental export costs (:func:`follow_delta`);
``--systems '' --delta`` measures only that.

``in_process`` repeats the comparison without HTTP: each system's :meth:`ServableModel.predict`
(dedupe, lookup, pooling, dense model) on the same pre-parsed batches of the largest size, in this
process, with one torch thread, the systems round-robin, best of ``--repeat`` rounds: what the
store costs apart from Ray Serve and JSON.

``ssd_read`` compares, in the same process, the tiered model's ``predict`` with its misses read
from the mapped rows file (``mmap``: before issue 29) and in merged ranges by parallel ``preadv``
(``blocks``: after), with the rows file in the page cache (``warm``) and evicted before every
batch (``cold``: ``fsync`` then ``POSIX_FADV_DONTNEED``, so every miss is a read of the disk).
``reads_per_missed_row`` is the ``blocks`` reader's system calls per row read;
``row_bytes_in_memory`` the bytes a row takes in the memory tiers, beside ``row_bytes_natural``
(``dim * 4``) and ``row_bytes_padded`` (the aligned stride the GPU tiers used before, still the
point store's on disk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hpsray.serving import LoadOptions

HELP = "serving: examples/s, p50, p99 of POST /predict at 5 %% of rows in memory vs RocksDB and all in memory"

SYSTEMS = ("tiered", "memory", "rocksdb", "bound", "driven", "tiered-mmap", "tiered-blocks")
DEFAULT_SYSTEMS = {"cpu": "tiered,memory,rocksdb,bound", "cuda": "tiered,driven,rocksdb,bound"}
BACKEND = {
    "tiered": "hpsray",
    "memory": "hpsray",
    "rocksdb": "rocksdb",
    "bound": "embedding-bag",
    "driven": "hpsray",
    "tiered-mmap": "hpsray",
    "tiered-blocks": "hpsray",
}
SSD_READ = {"tiered-mmap": "mmap", "tiered-blocks": "blocks"}
GPU_SYSTEMS = ("tiered", "memory", "driven")  # on --device cuda these run on the GPU; the baselines on the CPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="embedding rows of the model (default 1M)")
    parser.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    parser.add_argument("--mem-fraction", type=float, default=0.05, help="rows in memory for 'tiered' (default 0.05)")
    parser.add_argument("--batch-sizes", default="1,32,256", help="examples per request (default 1,32,256)")
    parser.add_argument("--concurrency", default="1,16", help="concurrent clients (default 1,16)")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="measured seconds per system, point and round (default 2)"
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"subset of {','.join(SYSTEMS)} (default {DEFAULT_SYSTEMS['cpu']}; with --device cuda "
        f"{DEFAULT_SYSTEMS['cuda']})",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: 'tiered' is the CPU-driven GPU path, 'driven' the device-driven one, side by side",
    )
    parser.add_argument(
        "--device-fraction",
        type=float,
        default=0.01,
        help="of the rows in memory (--mem-fraction), the fraction of all rows held in the device tier "
        "by the GPU paths and 'driven' (default 0.01)",
    )
    parser.add_argument("--no-ssd-read", action="store_true", help="skip the in-process mmap vs block-read comparison")
    parser.add_argument("--repeat", type=int, default=3, help="round-robin rounds per point; medians (default 3)")
    parser.add_argument("--port", type=int, default=8777)
    parser.add_argument("--dir", default=None, help="directory for the model (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--delta",
        action="store_true",
        help="also time following an incremental export (5 %% of rows changed, 1 %% removed, 1 %% new): "
        "the point store merged from the base's vs laid out from load_export, the swap's load, the hit rate after "
        "it (with --systems '' only this)",
    )


# -- the model and its traffic ----------------------------------------------------------------


def make_model(
    directory: str,
    rows: int,
    dim: int = 16,
    n_slots: int = 26,
    n_dense: int = 13,
    hidden: tuple[int, ...] = (256, 128),
    seed: int = 0,
):
    """Export a synthetic model of ``rows`` rows (every rank of every slot) into ``directory``;
    returns the planted generator whose raw values address it."""
    import torch

    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.data.generate import dataset_schema
    from hpsray.data.keys import hash_keys
    from hpsray.export import export
    from hpsray.models import DNN

    per_slot = max(1, rows // n_slots)
    gen = PlantedCTR(n_slots=n_slots, keys_per_slot=per_slot, n_dense=n_dense, seed=seed)
    slots = np.repeat(np.arange(n_slots, dtype=np.int64), per_slot)
    ranks = np.tile(np.arange(per_slot, dtype=np.uint64), n_slots)
    keys = hash_keys(slots, ranks)
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((keys.size, dim)) * 0.05).astype(np.float32)
    config = TrainConfig(dim=dim, hidden=hidden, sparse_optimizer="sgd", seed=seed)
    dense = DNN(n_slots, dim, n_dense, hidden, seed=seed).state_dict()
    with torch.no_grad():
        export(
            (keys, weights, dense),
            directory,
            config,
            n_slots=n_slots,
            n_dense=n_dense,
            schema=dataset_schema(gen, "parquet"),
            extra={"trainer": "bench-serve"},
        )
    return gen


def request_bodies(gen, batch_size: int, n: int, start_block: int = 10_000) -> list[bytes]:
    """``n`` JSON bodies of ``batch_size`` raw examples each (Zipf values, as clients would send)."""
    from hpsray.data.generate import _table

    out: list[bytes] = []
    block = start_block
    pending: list[dict] = []
    while len(out) < n:
        batch, ranks = gen.raw_block(block)
        block += 1
        pending += _table(gen, batch, ranks, "parquet").drop(["label"]).to_pylist()
        while len(pending) >= batch_size and len(out) < n:
            out.append(json.dumps({"examples": pending[:batch_size]}).encode())
            pending = pending[batch_size:]
    return out


# -- the client ---------------------------------------------------------------------------------


async def _drive(
    url: str,
    bodies: list[bytes],
    concurrency: int,
    seconds: float | None,
    n_requests: int | None,
    examples_per_body: list[int],
) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors: list[str] = []
    examples = 0
    sent = 0
    deadline = time.perf_counter() + seconds if seconds is not None else None
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker(w: int) -> None:
            nonlocal examples, sent
            i = w
            while True:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                if n_requests is not None:
                    if sent >= n_requests:
                        return
                    sent += 1
                body = bodies[i % len(bodies)]
                i += concurrency
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                        text = await r.read()
                        if r.status != 200:
                            errors.append(f"HTTP {r.status}: {text[:200]!r}")
                            continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                latencies.append(time.perf_counter() - t0)
                examples += examples_per_body[(i - concurrency) % len(bodies)]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = np.asarray(latencies) * 1e3
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "error_samples": errors[:3],
        "examples_per_s": examples / wall if wall else 0.0,
        "requests_per_s": len(latencies) / wall if wall else 0.0,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "wall_s": wall,
    }


def drive(
    url: str, bodies: list[bytes], concurrency: int, *, seconds: float | None = None, n_requests: int | None = None
) -> dict:
    """Send ``bodies`` round-robin from ``concurrency`` clients for ``seconds`` or ``n_requests``;
    returns examples/s, requests/s, p50/p99 latency (ms), errors (with a few samples)."""
    if (seconds is None) == (n_requests is None):
        raise ValueError("give seconds or n_requests")
    counts = [len(json.loads(b)["examples"]) for b in bodies]
    return asyncio.run(_drive(url, bodies, concurrency, seconds, n_requests, counts))


# -- the run ------------------------------------------------------------------------------------


def load_options(
    system: str, mem_fraction: float, device: str = "cpu", device_fraction: float = 0.01, rows: int = 0
) -> LoadOptions:
    """The :class:`~hpsray.serving.LoadOptions` of one system of the bench."""
    from hpsray.serving import LoadOptions

    frac = mem_fraction if system in ("tiered", "rocksdb", "driven", *SSD_READ) else None
    on_gpu = device == "cuda" and system in GPU_SYSTEMS
    driver = "device" if system == "driven" else "cpu"
    device_rows = None
    if on_gpu or driver == "device":
        device_rows = int(np.ceil(device_fraction * rows)) if system != "memory" else None
        if frac is not None:  # 5 % in memory in all: the device tier's share comes out of the host tier's
            frac = max(0.0, frac - device_fraction)
    return LoadOptions(
        mem_fraction=frac,
        backend=BACKEND[system],
        device=device if on_gpu else "cpu",
        driver=driver,
        device_rows=device_rows,
        ssd_read=SSD_READ.get(system, "auto"),
    )


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
    import torch

    from hpsray.serving import ServableModel
    from hpsray.serving.layout import read_meta

    torch.set_num_threads(1)
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
    import torch

    from hpsray.serving import LoadOptions, ServableModel

    torch.set_num_threads(1)
    models = {
        m: ServableModel.load(model_dir, LoadOptions(mem_fraction=mem_fraction, ssd_read=m)) for m in ("mmap", "blocks")
    }
    batches = [models["mmap"].parser.parse_body(b) for b in bodies]
    n = sum(len(b) for b in batches)
    rows_file = os.path.join(models["mmap"].lookup.store.directory, "rows.f32")
    maps = [m.lookup.store._map for m in models.values()]
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


def follow_delta(model_dir: str, gen, dim: int, mem_fraction: float, seed: int = 0, repeat: int = 3) -> dict:
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

    def timed(name: str, fn):
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
        c = model.lookup.cache
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
        "carried_rows": int(new_model.lookup.carried),
        "cache_rows": int(new_model.lookup.cache.capacity),
        "hit_rate_first_10_requests": hit,
    }


def _deploy(model_dir: str, system: str, args: argparse.Namespace, rows: int, gpu_share: float) -> Any:
    from dataclasses import replace

    from ray import serve

    from hpsray.serving import ServeOptions, build_app

    load = load_options(system, args.mem_fraction, args.device, args.device_fraction, rows)
    opts = ServeOptions(
        port=args.port,
        mem_fraction=load.mem_fraction,
        device=load.device,
        replica_cpus=0,
        replica_gpus=gpu_share,
        watch_s=0,
        max_batch_size=32,
        name=f"bench-{system}",
        route_prefix=f"/{system}",
    )
    app = build_app(model_dir, opts, load=replace(load, limits=opts.limits))
    return serve.run(app, name=opts.name, route_prefix=opts.route_prefix)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; 0 where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _proxy_pids() -> list[int]:
    """The Serve HTTP proxy actors' processes on this machine."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"ProxyActor" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _measured(url: str, bodies: list[bytes], concurrency: int, seconds: float, replica: int, proxies: list[int]):
    """:func:`drive`, plus ``cpu_ms_per_request`` of the replica, the proxy and this process."""
    before = (_cpu_s(replica), sum(map(_cpu_s, proxies)), sum(os.times()[:2]))
    result = drive(url, bodies, concurrency, seconds=seconds)
    after = (_cpu_s(replica), sum(map(_cpu_s, proxies)), sum(os.times()[:2]))
    n = max(1, result["requests"])
    result["cpu_ms_per_request"] = {
        name: 1e3 * (a - b) / n for name, a, b in zip(("replica", "proxy", "client"), after, before)
    }
    return result


def _median(points: list[dict]) -> dict:
    """Per-key medians of a point's rounds (errors summed, one sample kept)."""
    out = {
        k: float(np.median([p[k] for p in points])) for k in ("examples_per_s", "requests_per_s", "p50_ms", "p99_ms")
    }
    if all("cpu_ms_per_request" in p for p in points):
        out["cpu_ms_per_request"] = {
            k: float(np.median([p["cpu_ms_per_request"][k] for p in points])) for k in points[0]["cpu_ms_per_request"]
        }
    out["requests"] = int(sum(p["requests"] for p in points))
    out["errors"] = int(sum(p["errors"] for p in points))
    out["error_samples"] = [e for p in points for e in p["error_samples"]][:3]
    out["rounds"] = len(points)
    return out


def _serve_runs(args, model_dir: str, systems: list[str], bodies: dict, batch_sizes: list[int], concurrency: list[int]):
    """The curves over HTTP (one Serve instance, the systems round-robin) and the replicas' stats."""
    import ray
    from ray import serve

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    curves: dict[str, list[dict]] = {}
    try:
        from hpsray.serving.layout import read_meta

        rows = int(read_meta(os.path.join(model_dir, "point"))["rows"])
        on_gpu = [s for s in systems if args.device == "cuda" and s in GPU_SYSTEMS]
        share = 1.0 / max(1, len(on_gpu))  # the GPU systems share the one GPU
        handles = {system: _deploy(model_dir, system, args, rows, share) for system in systems}
        urls = {system: f"http://127.0.0.1:{args.port}/{system}/predict" for system in systems}
        replicas = {system: handles[system].stats.remote().result()["pid"] for system in systems}
        proxies = _proxy_pids()
        for system in systems:  # warm-up: caches filled, code paths compiled
            drive(urls[system], bodies[batch_sizes[-1]], max(concurrency), seconds=min(3.0, args.seconds))
        curves = {system: [] for system in systems}
        for b in batch_sizes:
            for c in concurrency:
                rounds: dict[str, list[dict]] = {system: [] for system in systems}
                for _ in range(args.repeat):
                    for system in systems:
                        rounds[system].append(
                            _measured(urls[system], bodies[b], c, args.seconds, replicas[system], proxies)
                        )
                for system in systems:
                    curves[system].append({"batch": b, "concurrency": c, **_median(rounds[system])})
        stats = {system: handles[system].stats.remote().result() for system in systems}
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
    return curves, stats


def run(args: argparse.Namespace) -> dict:
    if args.systems is None:
        args.systems = DEFAULT_SYSTEMS[args.device]
    systems = [s for s in args.systems.split(",") if s]
    bad = set(systems) - set(SYSTEMS)
    if bad:
        raise SystemExit(f"--systems: unknown {sorted(bad)} (known: {', '.join(SYSTEMS)})")
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="hpsray-bench-serve-")
    model_dir = os.path.join(work, "model")
    t0 = time.perf_counter()
    gen = make_model(model_dir, args.rows, args.dim, seed=args.seed)
    from hpsray.serving.layout import build_point_store

    build_point_store(model_dir)
    build_s = time.perf_counter() - t0
    bodies = {b: request_bodies(gen, b, max(8, min(400, 20_000 // b))) for b in batch_sizes}

    local: dict = {}
    reads: dict = {}
    curves: dict[str, list[dict]] = {}
    stats: dict[str, dict] = {}
    delta = None
    try:
        if systems:
            local = in_process(
                model_dir,
                bodies[batch_sizes[-1]],
                args.mem_fraction,
                systems,
                args.repeat,
                args.device,
                args.device_fraction,
            )
            if not args.no_ssd_read and "tiered" in systems:
                reads = ssd_read(model_dir, bodies[batch_sizes[-1]], args.mem_fraction, args.repeat)
            curves, stats = _serve_runs(args, model_dir, systems, bodies, batch_sizes, concurrency)
        if args.delta:
            delta = follow_delta(model_dir, gen, args.dim, args.mem_fraction, args.seed, args.repeat)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    def head(system: str) -> dict:
        pts = curves.get(system) or [{}]
        return pts[-1]

    from hpsray.serving.layout import row_stride

    report: dict = {
        "rows": int(args.rows),
        "dim": args.dim,
        "device": args.device,
        "mem_fraction": args.mem_fraction,
        "device_fraction": args.device_fraction,
        "headline_point": {"batch": batch_sizes[-1], "concurrency": max(concurrency)},
        "model_build_s": build_s,
    }
    t, r, m, bnd = head("tiered"), head("rocksdb"), head("memory"), head("bound")
    report["examples_per_s"] = t.get("examples_per_s")
    report["p50_ms"] = t.get("p50_ms")
    report["p99_ms"] = t.get("p99_ms")
    report["memory_examples_per_s"] = m.get("examples_per_s")
    report["rocksdb_examples_per_s"] = r.get("examples_per_s")
    report["rocksdb_p50_ms"] = r.get("p50_ms")
    report["cpu_ms_per_request"] = {s: head(s).get("cpu_ms_per_request") for s in systems}
    report["in_memory_bound_examples_per_s"] = bnd.get("examples_per_s")
    if t and r:
        report["vs_rocksdb"] = t["examples_per_s"] / r["examples_per_s"]
        met = report["vs_rocksdb"] >= 2 and t["p50_ms"] <= r["p50_ms"]
        report["target_2x_rocksdb_at_equal_or_lower_p50"] = bool(met)
    if t and bnd:
        report["vs_bound"] = t["examples_per_s"] / bnd["examples_per_s"]
        report["target_half_of_bound"] = bool(report["vs_bound"] >= 0.5)
    report["in_process"] = local
    if "tiered" in local and "rocksdb" in local:
        report["in_process_vs_rocksdb"] = local["tiered"]["examples_per_s"] / local["rocksdb"]["examples_per_s"]
    if "tiered" in local and "bound" in local:
        report["in_process_vs_bound"] = local["tiered"]["examples_per_s"] / local["bound"]["examples_per_s"]
    if "tiered" in local and "driven" in local:
        report["in_process_driven_vs_tiered"] = local["driven"]["examples_per_s"] / local["tiered"]["examples_per_s"]
        if args.device == "cuda":
            report["target_device_driven_1_5x_cpu_driven"] = bool(report["in_process_driven_vs_tiered"] >= 1.5)
    for system in SSD_READ:
        if system in curves and r:
            report[f"{system.replace('-', '_')}_vs_rocksdb"] = head(system)["examples_per_s"] / r["examples_per_s"]
    if "driven" in curves and "tiered" in curves:
        report["driven_vs_tiered"] = head("driven")["examples_per_s"] / t["examples_per_s"]
    if reads:
        report["ssd_read"] = reads
        report["in_process_tiered_blocks_vs_mmap"] = reads["blocks_vs_mmap"]
    sources = [reads.get("blocks", {})] + [local.get(s, {}) for s in ("tiered", "tiered-blocks", "driven")]
    measured = [x["reads_per_missed_row"] for x in sources if x.get("reads_per_missed_row")]
    report["reads_per_missed_row"] = measured[0] if measured else None
    report["row_bytes_natural"] = 4 * args.dim
    in_mem = [
        local[s]["row_bytes_in_memory"] for s in ("driven", "tiered") if "row_bytes_in_memory" in local.get(s, {})
    ]
    report["row_bytes_in_memory"] = in_mem[0] if in_mem else None
    report["row_bytes_padded"] = row_stride(args.dim)
    report["row_bytes_by_dim"] = {d: {"natural": 4 * d, "padded": row_stride(d)} for d in (8, 16, 20, 33, 64, 100)}
    report["errors"] = sum(p["errors"] for pts in curves.values() for p in pts)
    report["curves"] = {
        s: [{k: v for k, v in p.items() if k != "error_samples"} for p in pts] for s, pts in curves.items()
    }
    report["replica_stats"] = {
        s: {k: v for k, v in st.items() if k not in ("load", "pid", "directory")} for s, st in stats.items()
    }
    if delta is not None:
        report["delta"] = delta
    return report
