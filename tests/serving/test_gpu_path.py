"""The GPU path without a GPU (numba's CUDA simulator, in a subprocess) and on a real one (``gpu``).

The simulator must be switched on before ``numba.cuda`` is first imported and must not touch this
process, so the cases of ``cudasim_cases.py`` run in a subprocess, as in tests/kernels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cudasim_cases.py"
_spec = importlib.util.spec_from_file_location("_hpsray_serving_cudasim_cases", SCRIPT)
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
CASE_NAMES = list(_cases.CASES)


def _run(tmp_path: Path, simulator: bool, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = tmp_path / ("sim.json" if simulator else "gpu.json")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"case runner failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sim_report(tmp_path_factory) -> dict:
    report = _run(tmp_path_factory.mktemp("serving-cudasim"), True, timeout=300)
    assert report["simulator"] and report["cuda"], report
    return report


@pytest.mark.parametrize("name", CASE_NAMES)
def test_gpu_path_under_simulator(sim_report, name):
    result = sim_report["results"][name]
    if result != "ok":
        pytest.fail(f"{name} failed in the simulator subprocess:\n{result}", pytrace=False)


@pytest.mark.gpu
def test_gpu_path_on_a_real_gpu(tmp_path):
    probe = subprocess.run(
        [sys.executable, "-c", "from numba import cuda; print(cuda.is_available())"],
        env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.stdout.strip() != "True":
        pytest.skip("no CUDA device (numba.cuda.is_available() is false)")
    report = _run(tmp_path, False, timeout=600)
    assert not report["simulator"]
    failed = {k: v for k, v in report["results"].items() if v != "ok"}
    assert not failed, "\n".join(f"--- {k}\n{v}" for k, v in failed.items())


def test_device_rows_needs_the_cuda_device(tmp_path, capsys):
    from hpsray.__main__ import main
    from hpsray.serving import LoadOptions

    assert LoadOptions(device="cuda", device_rows=5).device_rows == 5
    assert LoadOptions(device="cuda").device_rows is None  # default: sized at load (device_rows_for)
    with pytest.raises(ValueError, match="needs device 'cuda'"):
        LoadOptions(device_rows=5)
    with pytest.raises(ValueError, match=">= 0"):
        LoadOptions(device="cuda", device_rows=-1)
    assert main(["serve", str(tmp_path), "--device-rows", "5"]) == 2  # before any Ray starts
    assert "needs device 'cuda'" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--device", "cuda", "--device-rows", "5"]) == 2
    assert "no export here" in capsys.readouterr().err


def test_device_rows_reach_the_replicas():
    """``ServeOptions(device_rows=...)`` (``hpsray serve --device-rows``) becomes the replicas'
    LoadOptions, handed to them as a dict; the replica's side rebuilds the same options."""
    from dataclasses import asdict

    from hpsray.serving import Limits, ServeOptions
    from hpsray.serving.deployment import _options
    from hpsray.serving.server import load_options

    load = load_options(ServeOptions(mem_fraction=0.05, device="cuda", limits=Limits(4096, 8), device_rows=1000))
    assert load.device_rows == 1000 and load.mem_fraction == 0.05 and load.limits == Limits(4096, 8)
    assert _options(asdict(load)) == load
