"""``hpsray serve`` as a user runs it: a subprocess, its own local Ray, a real HTTP client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from conftest import close, raw_examples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_a_directory_without_an_export(tmp_path, capsys):
    from hpsray.__main__ import main

    assert main(["serve", str(tmp_path)]) == 2  # before any Ray starts
    assert "no export here" in capsys.readouterr().err


def test_serve_rejects_both_memory_options(tmp_path, capsys):
    from hpsray.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), "--mem-rows", "5", "--mem-fraction", "0.1"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_hpsray_serve_answers_on_localhost(exports, planted, trained, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpsray",
            "serve",
            exports["parquet"],
            "--port",
            str(port),
            "--mem-fraction",
            "0.05",
            "--watch",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
    )
    try:
        batch, examples = raw_examples(planted, 40, start_block=100_020)
        url = f"http://127.0.0.1:{port}/predict"
        deadline, r = time.time() + 180, None
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                r = requests.post(url, json={"examples": examples}, timeout=30)
                if r.status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # not up yet, or a cold first batch
                pass
            time.sleep(1)
        assert r is not None and r.status_code == 200, (tmp_path / "serve.log").read_text()[-3000:]
        assert close(r.json()["probabilities"], trained.predict(batch))
        # listens on 127.0.0.1 only: the machine's other addresses are refused
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            with pytest.raises(requests.ConnectionError):
                requests.post(f"http://{other}:{port}/predict", json={"examples": examples}, timeout=10)
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30)  # Prometheus' text format
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'hpsray_serve_requests_total{replica="' in metrics.text and 'code="200"} ' in metrics.text
        assert "hpsray_serve_request_seconds_count" in metrics.text
        while "serving " not in (tmp_path / "serve.log").read_text() and time.time() < deadline:
            time.sleep(0.5)  # serve.run returns a moment after the application answers
        proc.send_signal(signal.SIGTERM)  # a service manager's stop: clean, no Ray stack dump
        code = proc.wait(timeout=120)
        text = (tmp_path / "serve.log").read_text()
        assert code == 0, text[-3000:]
        assert "hpsray serve: SIGTERM: stopping" in text and "hpsray serve: stopped" in text, text[-3000:]
        for noise in ("Traceback", "SIGTERM received", "*** ", "will not be applied", "Token authentication", "\x1b["):
            assert noise not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_ctrl_c_while_deploying_stops_without_a_traceback(exports, tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpsray", "serve", exports["parquet"], "--port", str(_free_port()), "--watch", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.time() + 120
            while "deploying" not in log.read_text() and time.time() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            time.sleep(1.0)  # Ray is starting
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    if "serving " in text:  # deployed before the signal came: a clean stop all the same
        assert code == 0, text[-3000:]
    else:
        assert code == 130 and "SIGINT: stopping (while deploying)" in text, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "hpsray serve: stopped" in text, text[-3000:]


_SIGNAL_IN_A_FORK_HOOK = """
import os, signal, sys
from hpsray.cli import serve
serve._on_signals() if sys.argv[1] == "hooked" else signal.signal(signal.SIGINT, serve._raise_stop)
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGINT))
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
try:
    serve._stop_if_signalled()
except serve._Stop as e:
    print("stopped by", e)
"""


@pytest.mark.parametrize("mode", ["hooked", "bare"])
def test_a_signal_during_a_fork_stops_serve_without_exception_ignored(mode):
    """A Ctrl-C landing in an at-fork hook (Ray's start forks; logging's hook runs there) is not
    printed as "Exception ignored ... Traceback" and still stops serve; without the hook it is."""
    command = [sys.executable, "-c", _SIGNAL_IN_A_FORK_HOOK, mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert "stopped by SIGINT" in done.stdout, done.stdout + done.stderr
    if mode == "hooked":
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    else:  # the fault the hook guards against
        assert "Exception ignored" in done.stderr, done.stderr


def test_a_first_signal_while_ray_starts_is_held_until_it_is_up_and_a_second_stops_at_once():
    """Raised inside ``ray.init`` a Ctrl-C can abort Ray's C++ side (exit -6, no clean stop): while
    Ray starts, the first signal is only recorded (raised by ``_stop_if_signalled`` once Ray is
    up); a second one is raised at once."""
    from hpsray.cli import serve

    old = signal.getsignal(signal.SIGINT)
    serve._RECEIVED.clear()
    try:
        serve._on_signals()
        serve._DEFERRING.append(True)
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next bytecode
        time.sleep(0.05)
        assert serve._RECEIVED == [int(signal.SIGINT)]
        with pytest.raises(serve._Stop):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        serve._DEFERRING.clear()
        with pytest.raises(serve._Stop, match="SIGINT"):
            serve._stop_if_signalled()
    finally:
        serve._DEFERRING.clear()
        serve._RECEIVED.clear()
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.unraisablehook = sys.__unraisablehook__


def test_hpsray_train_export_serves_raw_criteo_text(tmp_path):
    """``hpsray train JOB --reference --export DIR`` records the Criteo schema; raw TSV fields sent
    as JSON (hex strings, numbers) give the keys and predictions of the file read by the readers."""
    import numpy as np

    from hpsray.data import DataReader, PlantedCTR, write_synthetic
    from hpsray.data.generate import dataset_schema, to_toml
    from hpsray.serving import ServableModel

    gen = PlantedCTR(n_slots=4, keys_per_slot=3000, n_dense=2, seed=7)
    files = write_synthetic(str(tmp_path / "data"), gen, 3000, "criteo", shard_rows=1000)
    job = {
        "data": {"paths": ["data/part-0000[0-1].tsv"]},
        "model": {"dim": 4, "hidden": [16]},
        "pipeline": {"batch_size": 1000, "minibatch_size": 250},
    }
    (tmp_path / "job.toml").write_text(to_toml(job))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpsray",
            "train",
            str(tmp_path / "job.toml"),
            "--reference",
            "--export",
            str(tmp_path / "export"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = ServableModel.load(tmp_path / "export")
    assert model.parser.spec.encoding == "hex"

    held_out = files[2]
    batch = next(iter(DataReader([held_out], dataset_schema(gen, "criteo"), batch_size=200)))
    lines = open(held_out).read().splitlines()[:200]
    examples = []
    for line in lines:
        f = line.split("\t")
        ex = {f"c{i}": (float(f[i]) if f[i] else None) for i in (1, 2)}
        ex.update({f"c{i}": (f[i] or None) for i in range(3, 7)})
        examples.append(ex)
    parsed = model.parser.parse_examples(examples)
    assert np.array_equal(parsed.keys, batch.keys) and np.array_equal(parsed.dense, batch.dense)
    assert np.array_equal(model.predict(parsed), model.predict(batch))
