"""benchmarks/gpu_check and gpu_check_ray on a machine without CUDA, and without the packages the
GPU machine lacks (Ray, hypothesis, xdist: blocked by benchmarks/gpu_site/sitecustomize.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK, CHECK_RAY = ROOT / "benchmarks" / "gpu_check", ROOT / "benchmarks" / "gpu_check_ray"
BLOCKED = "ray,hypothesis,xdist"
# without them pytest must not load their plugins, as on a machine that lacks them
NO_PLUGINS = ["-p", "no:xdist", "-p", "no:xdist.looponfail", "-p", "no:hypothesispytest"]

_loader = importlib.machinery.SourceFileLoader("_hpsray_gpu_check", str(CHECK))
_spec = importlib.util.spec_from_loader(_loader.name, _loader)
gpu_check = importlib.util.module_from_spec(_spec)
_loader.exec_module(gpu_check)


def _env(blocked: str = BLOCKED) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "NUMBA_ENABLE_CUDASIM", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "gpu_site"), str(ROOT)])
    env["HPSRAY_BLOCK_IMPORTS"] = blocked
    env["CUDA_VISIBLE_DEVICES"] = ""  # no device, even on a machine with one
    return env


def _run(args: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, **kw)


def test_the_blocker_hides_the_packages_the_gpu_machine_lacks():
    r = _run([sys.executable, "-c", "import ray"])
    assert r.returncode != 0 and "No module named 'ray'" in r.stderr
    r = _run([sys.executable, "-c", "import numpy, hpsray.bench.kernels, hpsray.bench.serve_in_process; print('ok')"])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr  # the Ray-free parts import without Ray


def test_dry_run_says_what_it_would_run_and_exits_0():
    r = _run([str(CHECK), "--dry-run"])
    assert r.returncode == 0, r.stderr
    for name, limit, _ in gpu_check.PARTS:
        assert f"{name} (limit {limit} s)" in r.stdout
    assert "-p no:xdist" in r.stdout and "-o addopts=" in r.stdout and "--ignore=tests/training" in r.stdout
    assert "profile_device_step.py --device cuda --keys-per-example 26,100 --graph" in r.stdout
    # six minutes on the GPU machine, one part cut short included
    assert sum(limit for _, limit, _ in gpu_check.PARTS) + gpu_check.GRACE_S <= 360
    bad = _run([str(CHECK), "--dry-run", "--parts", "tests,nope"])
    assert bad.returncode == 2 and "unknown parts" in bad.stderr


def test_without_cuda_it_says_so_writes_the_json_and_exits_0(tmp_path):
    r = _run([str(CHECK), "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda"] is False and "no CUDA device" in report["reason"]
    env = report["parts"]["env"]
    assert env["status"] == "ok" and env["result"]["torch_cuda"] is False
    assert env["result"]["packages"]["torch"] and env["result"]["importable"]["ray"] is False
    assert list(report["parts"]) == ["env"]  # nothing measured
    assert all(t["value"] is None and t["met"] is None for t in report["targets"].values())
    assert "===== env" in (tmp_path / "gpu_check.log").read_text()


def test_a_part_that_fails_or_runs_out_of_time_is_recorded_and_the_next_one_runs(tmp_path):
    """The parts run even without CUDA (``--even-without-cuda``): the tests part, given 2 s, is
    interrupted (its time and status recorded); the kernels part fails for want of a device,
    its error recorded; the command still writes the JSON and exits 0."""
    cmd = [str(CHECK), "--out", str(tmp_path), "--even-without-cuda", "--parts", "tests,kernels", "--limit", "tests=2"]
    r = _run(cmd)
    assert r.returncode == 0, r.stderr
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert list(parts) == ["env", "tests", "kernels"]
    assert parts["tests"]["status"] == "timeout" and parts["tests"]["limit_s"] == 2
    assert 2 <= parts["tests"]["seconds"] <= 2 + gpu_check.GRACE_S + 5
    assert parts["kernels"]["status"] == "failed" and "exit status 1" in parts["kernels"]["error"]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "===== tests: timeout" in log and "===== kernels: failed" in log and "Traceback" in log


def test_the_step_part_writes_the_json_the_check_reads(tmp_path):
    """profile_device_step at 26 and 100 keys (tiny, on the CPU) writes ``by_keys`` with the
    figures :func:`_targets` reads; the CUDA-graph variant says why it did not run here."""
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_device_step.py"), "--keys-per-example", "26,100"]
    cmd += ["--keys-per-slot", "400", "--minibatch", "64", "--minibatches-per-batch", "2", "--batches", "1"]
    r = _run([*cmd, "--repeat", "1", "--graph", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    step = json.loads(out.read_text())
    for k in ("26", "100"):
        fig = step["by_keys"][k]
        assert fig["keys_per_example"] == int(k) and fig["ratio_vs_pytorch"] > 0 and fig["pytorch_examples_per_s"] > 0
        assert fig["hpsray_step_examples_per_s"] >= fig["hpsray_examples_per_s"]  # the index left out
        assert fig["graph"] == {"skipped": "CUDA graphs need --device cuda"}
    t = gpu_check._targets({"step": {"result": step}})
    assert t["step_vs_pytorch_100"]["value"] == step["by_keys"]["100"]["ratio_vs_pytorch"]


def test_gpu_check_ray_without_cuda_says_so_and_exits_0(tmp_path):
    r = _run([str(CHECK_RAY), "--dry-run"])
    assert r.returncode == 0 and "bench peers --device cuda" in r.stdout and "bench serve --device cuda" in r.stdout
    assert "gpu_wheelhouse.py stash" in r.stdout and "--target" in r.stdout
    r = _run([str(CHECK_RAY), "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout
    report = json.loads((tmp_path / "gpu_check_ray.json").read_text())
    assert report["cuda"] is False and report["steps"] == {}


def _collect(paths: list[str], *extra: str) -> subprocess.CompletedProcess:
    flags = ["-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rs", *NO_PLUGINS, *extra]
    return _run([sys.executable, "-m", "pytest", "--collect-only", *flags, *paths], timeout=300)


def test_gpu_tests_collect_without_ray_hypothesis_or_xdist(tmp_path):
    """Every test module, imported as ``pytest -m gpu`` imports them: none errors for want of
    Ray, hypothesis or xdist; those that need them are skipped, naming what they need."""
    r = _collect(["tests"], f"--junitxml={tmp_path / 'c.xml'}")
    assert r.returncode in (0, 5), r.stdout[-4000:] + r.stderr[-2000:]
    assert "error" not in r.stdout.splitlines()[-1].lower(), r.stdout[-4000:]
    assert "needs 'ray', which is not installed here" in r.stdout  # modules that need Ray say so
    assert "needs 'hypothesis', which is not installed here" in r.stdout
    skipped = {t["name"]: t["message"] for t in gpu_check._junit(tmp_path / "c.xml")["tests"]}
    assert "needs 'ray'" in skipped["tests.cluster"]  # the directory whose conftest needs Ray, by name


def test_without_the_hook_those_modules_error_at_collection():
    """The guard above, shown failing: with the collection hook switched off, a module that
    needs Ray and one that needs hypothesis are collection errors."""
    modules = ["tests/pipelines/test_edge.py", "tests/tiers/test_tiers_mem.py"]
    r = _collect(modules, "-p", "no:hpsray-optional-collect")
    assert r.returncode == 2 and "2 errors" in r.stdout.splitlines()[-1], r.stdout[-3000:]
    r = _collect(modules)
    assert r.returncode in (0, 5) and r.stdout.count("which is not installed here") == 2, r.stdout[-3000:]


def test_a_test_that_imports_ray_is_skipped_naming_it_and_other_import_errors_still_fail(tmp_path):
    """At run time too: a test (or fixture) whose ``import ray`` fails is skipped with the
    reason; an import of a package outside the optional ones still fails; with the hook off,
    the Ray test fails (the guard, shown failing)."""
    (tmp_path / "test_imports.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef cluster():\n    import ray\n    return ray\n\n"
        "def test_in_a_fixture(cluster):\n    pass\n\ndef test_in_the_body():\n    import ray.serve  # noqa: F401\n\n"
        "def test_not_optional():\n    import no_such_package_here  # noqa: F401\n"
    )
    env = _env()
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests")  # tests/conftest.py as a plugin, outside tests/
    flags = ["-p", "conftest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rs", *NO_PLUGINS]
    cmd = [sys.executable, "-m", "pytest", *flags, "--rootdir", str(tmp_path), str(tmp_path)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed, 2 skipped" in r.stdout.splitlines()[-1], r.stdout[-3000:]
    assert r.stdout.count("needs 'ray', which is not installed here") == 2
    hook_off = [*cmd, "-p", "no:hpsray-optional-collect"]
    off = subprocess.run(hook_off, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "2 failed, 1 error" in off.stdout.splitlines()[-1], off.stdout[-3000:]  # the fixture: an error


def test_junit_results_and_targets_are_read_as_the_json_reports_them(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.training.test_sync" name="test_local[sgd]" time="1.5"/>'
        '<testcase classname="tests.training.test_sync" name="test_bsp" time="0.2">'
        '<failure message="RuntimeError: called a synchronizing CUDA operation">trace</failure></testcase>'
        '<testcase classname="" name="tests.cluster" time="0"><skipped message="needs \'ray\'"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = gpu_check._junit(xml)
    assert got["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    bsp = got["tests"][1]
    assert bsp["name"] == "tests.training.test_sync::test_bsp" and "synchronizing" in bsp["message"]
    parts = {
        "step": {"result": {"by_keys": {"26": {"ratio_vs_pytorch": 1.2}, "100": {"ratio_vs_pytorch": 0.8}}}},
        "serve": {"result": {"driven_vs_host_driven": 1.6}},
        "training": {"result": got},
    }
    t = gpu_check._targets(parts)
    assert t["step_vs_pytorch_26"]["met"] is True and t["step_vs_pytorch_100"]["met"] is False
    assert t["serve_driven_vs_host_driven"]["met"] is True and t["kernels_find_vs_hierarchicalkv"]["met"] is None
    assert t["training_paths_without_syncs"]["met"] is False  # one path synced


@pytest.mark.parametrize("script", ["gpu_check", "gpu_check_ray", "gpu_wheelhouse.py"])
def test_the_commands_are_small_enough_to_carry(script):
    """What a GPU run carries is the tree without .git and .venv: far under the tool's 64 MiB."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    size = sum((ROOT / p).stat().st_size for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    assert size < 16 << 20, f"the tracked tree is {size / 2**20:.1f} MiB"
    assert os.access(ROOT / "benchmarks" / script, os.X_OK) or script.endswith(".py")
