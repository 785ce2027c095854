"""The HTTP runs of ``hpsray bench serve``: the aiohttp client, one Ray Serve deployment per
system, and the curves driven round-robin with their CPU cost per request."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import numpy as np

from hpsray.bench.serve_workload import GPU_SYSTEMS, load_options


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


def _measured(
    url: str, bodies: list[bytes], concurrency: int, seconds: float, replica: int, proxies: list[int]
) -> dict:
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
    out: dict[str, Any] = {
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


def serve_runs(
    args: argparse.Namespace,
    model_dir: str,
    systems: list[str],
    bodies: dict[int, list[bytes]],
    batch_sizes: list[int],
    concurrency: list[int],
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
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
