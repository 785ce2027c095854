"""``hpsray plan`` against real runs of ``hpsray train`` (subprocesses, their own Ray), on
generated Criteo-format files.

* the plan's MEM-PS rows and SSD-PS bytes are within ±25 % of what the run then holds (the run
  report's ``cache.size``; the SSD-PS store left in ``ssd_path`` after ``--export`` flushed it);
* a budget below the pinned rows: ``hpsray plan`` exits 1 naming ``mem_rows >= N``, ``hpsray
  train`` refuses before Ray starts with the same fix, and ``--no-plan`` lets the run reach the
  CapacityError at exactly ``N`` rows.
"""

import json
import os
import subprocess
import sys

import pytest

from hpsray.data import PlantedCTR, write_synthetic
from hpsray.data.generate import to_toml
from hpsray.tiers.ssd import SSDPS


def hpsray(*args, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hpsray", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    gen = PlantedCTR(n_slots=6, keys_per_slot=4000, n_dense=2, seed=3)
    write_synthetic(str(root / "data"), gen, 16_000, "criteo", shard_rows=4_000)
    return root


def job(root, name, mem_rows, ssd=None):
    d = {
        "data": {"paths": ["data/"]},
        "model": {"dim": 4, "hidden": [8]},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
        "tiers": {"mem_rows": mem_rows, **({"ssd_path": ssd} if ssd else {})},
        "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        "cluster": {"nodes": 1},
    }
    path = root / f"{name}.toml"
    path.write_text(to_toml(d))
    return str(path)


def within(predicted, measured, share=0.25):
    return abs(predicted - measured) <= share * measured


@pytest.mark.slow
def test_plan_predicts_the_rows_and_ssd_bytes_a_run_uses(data):
    path = job(data, "roomy", 200_000, ssd="ssd")
    out = hpsray("plan", path, "--sample-rows", "6000", "--json", "--no-calibrate")  # 3 of the 8 batches
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    assert plan["input"]["rows"] == pytest.approx(16_000, rel=0.02) and plan["input"]["files"] == 4
    run = hpsray("train", path, "--report", str(data / "run.json"), "--export", str(data / "export"), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((data / "run.json").read_text())
    mem = plan["per_node"]["mem_ps"]
    assert within(mem["resident_rows"], report["cache"]["size"]), (mem["resident_rows"], report["cache"])
    store = SSDPS(str(data / "ssd" / "node-0"), background=False)
    try:
        ssd = store.stats
    finally:
        store.close()
    predicted = plan["per_node"]["ssd_ps"]
    assert within(predicted["live_bytes"], ssd["live_bytes"]), (predicted, ssd["live_bytes"])
    assert ssd["disk_bytes"] <= predicted["disk_bytes_max"]


@pytest.mark.slow
def test_train_refuses_a_job_that_cannot_fit_before_ray_starts(data):
    out = hpsray("plan", job(data, "probe", 10**6), "--json", "--no-calibrate")
    need = json.loads(out.stdout)["per_node"]["mem_ps"]["pinned_rows_max"]
    tight = job(data, "tight", need - 1)
    fix = f"set [tiers] mem_rows >= {need:,}"

    out = hpsray("plan", tight, "--no-calibrate")
    assert out.returncode == 1 and fix in out.stdout, out.stdout

    refused = hpsray("train", tight)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "would have to be held" not in refused.stderr  # refused by the plan, not by MEM-PS in a run
    assert fix in refused.stderr and "hpsray train: error:" in refused.stderr
    assert "Ray" not in refused.stderr and "ray" not in refused.stdout, refused.stderr  # no Ray started

    ran = hpsray("train", tight, "--no-plan", "--quiet")
    # the run meets the error the plan predicted, at exactly the plan's number, and fails
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert "training failed" in ran.stderr and f"{need} rows would have to be held" in ran.stderr, ran.stderr[-3000:]
