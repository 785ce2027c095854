"""The ``hpsray`` command as a user runs it: a real subprocess each time."""

import json
import subprocess
import sys

import pytest

import hpsray


def hpsray_cmd(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hpsray", *args], capture_output=True, text=True, timeout=timeout)


def test_version_and_help():
    out = hpsray_cmd("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"hpsray {hpsray.__version__}"
    out = hpsray_cmd("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout and "reference" in out.stdout


def test_bench_help_lists_every_benchmark():
    from hpsray.bench import BENCHMARKS

    out = hpsray_cmd("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in BENCHMARKS)


@pytest.mark.parametrize("command", ["train", "demo", "serve", "gen-data"])
def test_a_command_parses_without_the_benchmarks_imports(command):
    """The start of a command: parsing its options imports neither torch nor numba (the other
    commands' and the benchmarks' modules do: seconds before anything starts)."""
    code = (
        "import sys; from hpsray.__main__ import build_parser; "
        f"build_parser([{command!r}, 'x']); "
        "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_command_prints_help_and_fails():
    out = hpsray_cmd()
    assert out.returncode == 2 and "usage: hpsray" in out.stdout


def test_unknown_option_is_refused_with_its_name():
    out = hpsray_cmd("reference", "--bogus")
    assert out.returncode == 2 and "--bogus" in out.stderr


def test_reference_trains_and_reports_json():
    out = hpsray_cmd(
        "reference",
        "--rows",
        "20000",
        "--eval-rows",
        "5000",
        "--slots",
        "4",
        "--keys",
        "300",
        "--dense",
        "2",
        "--hidden",
        "16",
        "--batch",
        "10000",
        "--minibatch",
        "500",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["examples"] == 20000
    assert 0.6 < report["auc"] <= report["planted_auc"] + 0.02
    assert report["examples_per_s"] > 0


@pytest.mark.slow
def test_bench_kernels_json_has_the_promised_keys(tmp_path):
    out_file = tmp_path / "k.json"
    out = hpsray_cmd(
        "bench",
        "kernels",
        "--sizes",
        "20000,50000",
        "--queries",
        "20000",
        "--dict-queries",
        "5000",
        "--repeat",
        "1",
        "--json",
        "--out",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report == json.loads(out_file.read_text())
    for key in (
        "find_keys_per_s",
        "find_gather_keys_per_s",
        "insert_keys_per_s",
        "dict_find_keys_per_s",
        "gather_bound_keys_per_s",
        "scatter_add_keys_per_s",
    ):
        assert report[key] > 0, key
    assert report["by_size"]["50000"]["keys"] == 50000
    assert report["find_keys_per_s"] == report["by_size"]["50000"]["find_keys_per_s"]
