"""``hpsray bench consistency`` at a tiny size: the report's shape, BSP learns, every mode keeps
its staleness bound, the plot is written."""

import json
import os
import subprocess
import sys

import pytest

from hpsray.bench.consistency import mode_list, time_to

pytestmark = pytest.mark.slow


def test_time_to_target_interpolates_between_points():
    assert time_to([(2.0, 0.6), (4.0, 0.7)], 0.65) == pytest.approx(3.0)
    assert time_to([(2.0, 0.6)], 0.55) == pytest.approx(1.0)  # from (0, 0.5)
    assert time_to([(2.0, 0.6)], 0.7) is None


def test_modes_cover_lapsers_experiment():
    import argparse

    from hpsray.bench.consistency import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = [name for name, _ in mode_list(parser.parse_args([]))]
    assert names[0] == "bsp" and "absp4-push" in names and "asp-pull" in names
    assert {f"ssp{s}-{p}" for s in (1, 2, 4, 8) for p in ("push", "pull")} <= set(names)


def test_bench_consistency_tiny(tmp_path):
    out = tmp_path / "consistency.json"
    args = [
        *("--rows 2000 --passes 2 --batch 1000 --minibatch 128 --slots 4 --keys 300 --dense 2 --dim 4").split(),
        *("--hidden 16 --eval-rows 2000 --delay 0.005 --modes bsp,ssp2-pull,asp-push").split(),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "hpsray", "bench", "consistency", "--json", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"bsp", "ssp2-pull", "asp-push"}  # A-BSP: tests/cluster/test_consistency_modes.py
    assert {"setup", "target_auc", "fastest_to_target", "plot"} <= set(report)
    bsp = report["modes"]["bsp"]
    assert bsp["final_auc"] > 0.5 and bsp["max_staleness"] == 0 and bsp["time_to_target_vs_bsp"] == 1.0
    for name, mode in report["modes"].items():
        assert {"wall_s", "time_to_target_s", "final_auc", "max_staleness", "wall_vs_bsp", "auc_points"} <= set(mode)
        assert len(mode["auc_points"]) == 2
        if mode["slack"] is not None:
            assert mode["max_staleness"] <= mode["slack"], name
            assert mode["within_bound"]
    assert report["modes"]["ssp2-pull"]["slack"] == 2
    assert report["modes"]["asp-push"]["slack"] is None
    assert os.path.getsize(report["plot"]) > 1000 and report["plot"] == str(tmp_path / "consistency.png")
