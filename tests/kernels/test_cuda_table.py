"""The CUDA hash table against the CPU one, without a GPU (numba's simulator) and on a GPU.

The simulator has to be switched on before ``numba.cuda`` is first imported, and must not touch
this process (the other tests run CPU numba), so the cases in ``cudasim_cases.py`` run in a
subprocess: once per module with ``NUMBA_ENABLE_CUDASIM=1``, reported here case by case; and,
marked ``gpu``, once more without it where a real CUDA device is present.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpsray.kernels import CpuHashTable, make_table

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cudasim_cases.py"

_spec = importlib.util.spec_from_file_location("_hpsray_cudasim_cases", SCRIPT)
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)  # only numpy at import time; numba.cuda is imported inside cases
CASE_NAMES = list(_cases.CASES)


def _run_cases(tmp_path: Path, names: list[str], simulator: bool, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = tmp_path / ("sim.json" if simulator else "gpu.json")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"case runner failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sim_report(request, tmp_path_factory) -> dict:
    """Runs, in one simulator subprocess, the cases selected in this session."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_cuda_matches_cpu_under_simulator"
    ]
    report = _run_cases(tmp_path_factory.mktemp("cudasim"), selected or CASE_NAMES, True, timeout=300)
    assert report["simulator"] and report["cuda"], report
    return report


@pytest.mark.parametrize("name", CASE_NAMES)
def test_cuda_matches_cpu_under_simulator(sim_report, name):
    result = sim_report["results"][name]
    if result != "ok":
        pytest.fail(f"{name} failed in the simulator subprocess:\n{result}", pytrace=False)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    """What this machine has, without the simulator (asked in a subprocess)."""
    code = (
        "import json\n"
        "from numba import cuda\n"
        "from hpsray.kernels import make_table\n"
        "r = {'cuda': bool(cuda.is_available()), 'error': None}\n"
        "try:\n"
        "    make_table(8, 2, device='cuda')\n"
        "except RuntimeError as e:\n"
        "    r['error'] = str(e)\n"
        "print(json.dumps(r))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_make_table_cpu_and_bad_device():
    assert isinstance(make_table(10, 3), CpuHashTable)
    assert isinstance(make_table(10, 3, device="cpu"), CpuHashTable)
    with pytest.raises(ValueError, match="'cpu', 'cuda'"):
        make_table(10, 3, device="tpu")


def test_make_table_cuda_without_a_device_is_a_clear_error(probe):
    if probe["cuda"]:
        pytest.skip("this machine has a CUDA device")
    assert probe["error"] and "NUMBA_ENABLE_CUDASIM" in probe["error"]


@pytest.mark.gpu
def test_cuda_matches_cpu_on_a_real_gpu(probe, tmp_path):
    if not probe["cuda"]:
        pytest.skip("no CUDA device (numba.cuda.is_available() is false)")
    report = _run_cases(tmp_path, CASE_NAMES, False, timeout=600)
    assert not report["simulator"]
    failed = {k: v for k, v in report["results"].items() if v != "ok"}
    assert not failed, "\n".join(f"--- {k}\n{v}" for k, v in failed.items())
