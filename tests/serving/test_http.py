"""The model on a real Ray Serve over real HTTP (aiohttp/requests clients on loopback).

One Serve instance for the module, six applications: ``mem`` (all rows in memory), ``ssd``
(5 % in memory, the rest read from the point store), ``driven`` (the device-driven lookup on
NumPy, 5 % in memory, misses read in merged ranges by parallel ``preadv``), ``hex`` (the same model exported with the
Criteo schema: hex strings in, multi-hot as "a,b"), ``swap`` (a directory of exports, watched),
``delta`` (one export, 5 % in memory, watched for incremental deltas).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import numpy as np
import pytest
import requests
from conftest import N_DENSE, N_SLOTS, close, raw_examples

from hpsray.bench.serve_http import drive
from hpsray.serving import Limits, ServableModel, ServeOptions, build_app

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(ray_local, exports, tmp_path_factory):
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    root = tmp_path_factory.mktemp("swap-root")
    shutil.copytree(exports["parquet"], root / "v1")
    delta = tmp_path_factory.mktemp("delta-root") / "model"  # an export that gets a delta
    shutil.copytree(exports["parquet"], delta)
    apps = {
        "mem": (exports["parquet"], ServeOptions(port=port)),
        "ssd": (exports["parquet"], ServeOptions(port=port, mem_fraction=0.05, limits=Limits(max_examples=64))),
        "driven": (exports["parquet"], ServeOptions(port=port, mem_fraction=0.05, driver="device")),
        "hex": (exports["criteo"], ServeOptions(port=port)),
        "swap": (str(root), ServeOptions(port=port, watch_s=0.3)),
        "delta": (str(delta), ServeOptions(port=port, watch_s=0.3, mem_fraction=0.05)),
    }
    targets = []
    for name, (path, opts) in apps.items():
        opts = ServeOptions(**{**opts.__dict__, "replica_cpus": 0, "name": name, "route_prefix": f"/{name}"})
        targets.append(serve.RunTarget(build_app(path, opts), name=name, route_prefix=f"/{name}"))
    handles = dict(zip(apps, serve.run_many(targets)))  # the replicas start side by side
    yield {"base": f"http://127.0.0.1:{port}", "handles": handles, "root": root, "delta": str(delta)}
    serve.shutdown()


def _post(served, app: str, examples=None, data: bytes | None = None) -> requests.Response:
    url = f"{served['base']}/{app}/predict"
    if data is not None:
        return requests.post(url, data=data, timeout=60)
    return requests.post(url, json={"examples": examples}, timeout=60)


@pytest.mark.parametrize("app,fmt", [("mem", "parquet"), ("ssd", "parquet"), ("driven", "parquet"), ("hex", "criteo")])
def test_http_predictions_equal_the_reference_trainer(served, planted, trained, app, fmt):
    batch, examples = raw_examples(planted, 320, fmt=fmt)
    want = trained.predict(batch)
    got = []
    for i in range(0, len(examples), 64):
        r = _post(served, app, examples[i : i + 64])
        assert r.status_code == 200, r.text
        got += r.json()["probabilities"]
    assert close(got, want), np.max(np.abs(np.asarray(got) - want))


def test_device_driven_app_answers_concurrent_requests_like_the_reference(served, planted, trained):
    """Requests sent at once meet in dynamic batches: each answer is still its examples'
    reference predictions, missed rows read in merged ranges (fewer reads than rows), and
    every batch uploads its keys once and downloads its probabilities once."""
    from concurrent.futures import ThreadPoolExecutor

    batch, examples = raw_examples(planted, 320, start_block=100_002)
    want = trained.predict(batch)
    slices = [(i, i + 32) for i in range(0, 320, 32)] * 3
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda ab: _post(served, "driven", examples[ab[0] : ab[1]]), slices))
    for (a, b), r in zip(slices, answers):
        assert r.status_code == 200, r.text
        assert close(r.json()["probabilities"], want[a:b])
    stats = served["handles"]["driven"].stats.remote().result()
    assert stats["mode"] == "device-driven" and stats["ssd_reads"] > 0 and 0 < stats["reads_per_missed_row"] < 1
    t = stats["transfers"]
    assert t["host_to_device"]["keys"] == t["device_to_host"]["probabilities"]


def test_python_handle_takes_a_batch(served, planted, trained):
    batch, _ = raw_examples(planted, 200, start_block=100_001)
    for app in ("mem", "ssd"):
        probs = served["handles"][app].predict.remote(batch).result()
        assert close(probs, trained.predict(batch))
    stats = served["handles"]["ssd"].stats.remote().result()
    assert stats["mode"] == "tiered" and stats["ssd_reads"] > 0 and stats["hits"] > 0


def test_bad_requests_answer_400_with_the_reason(served, planted):
    _, examples = raw_examples(planted, 70)
    ex = examples[0]
    cases = [
        (dict(data=b"{this is not json"), "body is not JSON"),
        (dict(data=b'{"rows": []}'), 'must be a JSON object {"examples"'),
        (dict(examples=[{k: v for k, v in ex.items() if k != "C2"}]), "missing column(s) ['C2']"),
        (dict(examples=[{**ex, "C99": 1}]), "unknown column(s) ['C99']"),
        (dict(examples=[{**ex, "I1": "high"}]), "dense column 'I1' takes numbers"),
        (dict(examples=[{**ex, "C1": 2.5}]), "categorical column 'C1' takes a string, an integer or a list"),
        (dict(examples=examples[:65]), "65 examples exceed the limit of 64 per request"),
        (dict(data=b" " * ((1 << 20) + 1)), "exceeds the limit of 1048576"),
    ]
    for kwargs, reason in cases:
        r = _post(served, "ssd", **kwargs)
        assert r.status_code == 400, (reason, r.status_code, r.text)
        assert reason in r.json()["error"], (reason, r.text)
    assert requests.get(f"{served['base']}/ssd/predict", timeout=30).status_code == 405
    assert requests.post(f"{served['base']}/ssd/other", data=b"{}", timeout=30).status_code == 404
    r = _post(served, "ssd", examples[:3])  # the replica is still serving
    assert r.status_code == 200 and len(r.json()["probabilities"]) == 3


def _swap_under_a_request_stream(served, app: str, examples, old, new, publish) -> list[str]:
    """Three clients send ``examples`` to ``app`` continuously; once they are being answered (and
    at least 1.5 s have passed) ``publish()`` lands a newer model. Every request must be answered
    200, each by the old or the new model (never a mix), and the new one must take over (at most
    the requests in flight finish on the old one). Returns which model answered each request."""
    results: list[tuple[int, list | str]] = []
    stop = threading.Event()

    def client() -> None:
        s = requests.Session()
        while not stop.is_set():
            r = s.post(f"{served['base']}/{app}/predict", json={"examples": examples}, timeout=60)
            results.append((r.status_code, r.json()["probabilities"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)
        warm_deadline = time.time() + 60  # a loaded machine may take a while to answer the first ones
        while len(results) < 3 and time.time() < warm_deadline:
            time.sleep(0.1)
        n_before = len(results)
        publish()
        deadline = time.time() + 90
        while time.time() < deadline:
            if sum(1 for code, p in results[n_before:] if code == 200 and close(p, new)) >= 10:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert n_before > 0 and len(results) > n_before
    failed = [(code, p) for code, p in results if code != 200]
    assert not failed, failed[:3]
    which = ["old" if close(p, old) else "new" if close(p, new) else "neither" for _, p in results]
    assert "neither" not in which
    assert which.count("new") >= 10
    first_new = which.index("new")
    assert "old" not in which[first_new + 3 :]  # at most the requests already in flight finish on the old model
    return which


def test_hot_swap_under_a_request_stream_loses_no_request(served, planted, trained, exports):
    """A newer export lands in the watched directory while clients keep sending."""
    from hpsray.data.generate import dataset_schema
    from hpsray.export import export

    batch, examples = raw_examples(planted, 16, start_block=100_002)
    old = trained.predict(batch)
    keys, rows, dense = trained.export()
    rows = rows.copy()
    rows[:, : trained.config.dim] *= -1.5  # a visibly different model
    staging = str(served["root"].parent / "v2-staging")
    export(
        (keys, rows, dense),
        staging,
        trained.config,
        n_slots=N_SLOTS,
        n_dense=N_DENSE,
        schema=dataset_schema(planted, "parquet"),
    )
    new = ServableModel.load(staging).predict(batch)
    assert not close(old, new)

    def publish() -> None:
        shutil.copytree(staging, served["root"] / "v2")  # manifest.json lands last, as export writes it
        os.utime(served["root"] / "v2" / "manifest.json")

    _swap_under_a_request_stream(served, "swap", examples, old, new, publish)
    assert served["handles"]["swap"].stats.remote().result()["swaps"] == 1


def test_hot_swap_to_a_new_delta_loses_no_request(served, planted, trained, retrained):
    """``hpsray train --export DIR --incremental`` adds a delta to the served export (5 % of its
    rows in memory) while clients keep sending: no request fails, and the answers after the swap
    are the reference trainer's in its new state."""
    from hpsray.export import export

    batch, examples = raw_examples(planted, 16, start_block=100_003)
    old, new = trained.predict(batch), retrained.predict(batch)
    assert not close(old, new)

    def publish() -> None:
        export(retrained.export(), served["delta"], retrained.config, incremental=True)

    _swap_under_a_request_stream(served, "delta", examples, old, new, publish)
    stats = served["handles"]["delta"].stats.remote().result()
    assert stats["swaps"] == 1 and stats["delta"] == 1 and stats["carried"] > 0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_load_a_few_thousand_requests_no_errors_steady_memory(served, planted):
    """3,000 requests from 16 concurrent aiohttp clients against the 5 %-in-memory model."""
    bodies = []
    for i in range(50):
        _, examples = raw_examples(planted, 8, start_block=100_010 + i)
        bodies.append(json.dumps({"examples": examples}).encode())
    url = f"{served['base']}/ssd/predict"
    pid = served["handles"]["ssd"].stats.remote().result()["pid"]
    warm = drive(url, bodies, 16, n_requests=500)
    rss_before = _rss_mb(pid)
    run = drive(url, bodies, 16, n_requests=3000)
    rss_after = _rss_mb(pid)
    print(
        f"\nload: {run['requests']} requests, {run['errors']} errors, {run['requests_per_s']:.0f} req/s, "
        f"{run['examples_per_s']:.0f} examples/s, p50 {run['p50_ms']:.1f} ms, p99 {run['p99_ms']:.1f} ms, "
        f"replica RSS {rss_before:.0f} -> {rss_after:.0f} MB"
    )
    assert warm["errors"] == 0 and run["errors"] == 0, run["error_samples"]
    assert run["requests"] == 3000
    assert np.isfinite(run["p99_ms"])
    assert rss_after - rss_before < 50, (rss_before, rss_after)
