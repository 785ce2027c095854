"""The SSD-PS disk in the plan (hpsray/plan/disk.py): its random-read bound, cached per disk
unless measured on a busy machine, and the load stage's seconds for the rows the page cache
cannot hold."""

from __future__ import annotations

import json
import os

import pytest

from hpsray.blockio import queue_depth
from hpsray.job import JobConfig
from hpsray.plan import make_plan
from hpsray.plan.calibrate import STAGES, Calibration, predict_rate
from hpsray.plan.disk import (
    READS_PER_MISSED_ROW,
    cache_file,
    cold_share,
    disk_key,
    disk_s_per_row,
    load_bound,
    measure_bound,
)
from hpsray.tiers.ssd.probe import DiskBound

BOUND = DiskBound(4096, True, 1 << 30, 1, {1: 1000.0, 4: 4000.0, 8: 8000.0}, {}, {}, {}, 0.5, measured_at="then")
CAL = Calibration(
    read_s_per_example=1e-3,
    train_s_per_example=1e-3,
    pull_s_per_row=1e-3,
    ssd_load_s_per_row=5e-4,
    ssd_dump_s_per_row=5e-4,
    dense_params=0,
    cores=4,
    seconds=0.0,
    cpu_per_wall=dict.fromkeys(STAGES, 1.0),
    row_width=4,
)


def test_missed_rows_beyond_the_page_cache_cost_random_reads_at_the_deepest_depth():
    assert cold_share(10e9, 4e9) == pytest.approx(0.6)  # the cache holds 4 of the store's 10 GB
    assert cold_share(1e9, 4e9) == 0.0 and cold_share(1e9, -5.0) == 1.0 and cold_share(0, 1) == 0.0
    # a load's ranges are hinted at once: the device sees more in flight than the 4 I/O threads
    assert disk_s_per_row(BOUND, 4, 1.0) == pytest.approx(READS_PER_MISSED_ROW / 8000.0)
    assert disk_s_per_row(BOUND, 6, 0.5) == pytest.approx(0.5 * READS_PER_MISSED_ROW / 8000.0)
    assert disk_s_per_row(BOUND, 16, 1.0) == pytest.approx(READS_PER_MISSED_ROW / 8000.0)  # clamped: not probed
    _, bare = predict_rate(CAL, 1000, 1000, 500)
    _, disk = predict_rate(CAL, 1000, 1000, 500, disk_s_per_row=disk_s_per_row(BOUND, 4, 1.0))
    assert disk["load"] - bare["load"] == pytest.approx(500 * 2 / 8000.0)  # 1,000 reads at 8,000/s
    assert disk["train"] == bare["train"]


def test_the_bound_is_cached_per_disk_and_not_when_the_machine_is_busy(tmp_path, monkeypatch):
    monkeypatch.setenv("HPSRAY_CACHE_DIR", str(tmp_path / "cache"))
    ssd = str(tmp_path / "ssd" / "not-yet")  # the nearest existing directory's disk
    assert load_bound(ssd) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    bound, why = measure_bound(ssd, 4, 4, seconds=0.05, nbytes=1 << 20)
    assert why is not None and "load average 99.0" in why and load_bound(ssd) is None
    # 1, 8, 32, the 4 I/O threads and the depth loads keep in flight (a ring's 128, else the threads)
    assert set(bound.reads_per_s) == {1, 4, 8, 32, queue_depth(4)} and bound.read_bytes == 4096
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    bound, why = measure_bound(ssd, 4, 4, seconds=0.05, nbytes=1 << 20)
    if not bound.direct:
        assert why == bound.note and load_bound(ssd) is None  # a bound of the cache is no disk's
        return
    assert why is None and load_bound(ssd) == bound
    assert not [n for n in os.listdir(tmp_path) if n.startswith("hpsray-disk-")]  # scratch removed
    d = json.loads(open(cache_file()).read())
    d["key"] = "another-host|8:0"
    open(cache_file(), "w").write(json.dumps(d))
    assert load_bound(ssd) is None
    d["key"], d["extra"] = disk_key(ssd), {}  # measured before the probe said what issued its reads
    open(cache_file(), "w").write(json.dumps(d))
    assert load_bound(ssd) is None


def test_a_plan_says_what_the_disk_adds_to_the_load_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("HPSRAY_CACHE_DIR", str(tmp_path / "cache"))
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 8_000, "slots": 6, "keys": 3000, "dense": 2, "seed": 5}},
            "model": {"dim": 4, "hidden": [8]},
            "tiers": {"mem_rows": 9000},
            "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        },
        where="job.toml",
        base_dir=str(tmp_path),
    )
    plan = make_plan(job, 8_000)
    assert any("no random-read bound of the SSD-PS disk" in n for n in plan.notes)
    plan = make_plan(job, 8_000, disk_bound=BOUND)
    ssd = plan.per_node["ssd_ps"]
    assert ssd["disk_reads_per_s"] == 8000.0  # the deepest depth probed, not the store's 4 I/O threads
    assert ssd["cold_share"] == 0.0 and ssd["disk_s_per_batch"] == 0.0  # a small store: the page cache holds it
    assert any("SSD-PS disk 8,000 random reads/s of 4096 bytes at depth 8 (4 I/O threads" in n for n in plan.notes)


def test_a_one_row_block_costs_one_read_a_wider_block_two():
    from hpsray.plan.disk import reads_per_missed_row

    assert reads_per_missed_row(128) == 1.0 and reads_per_missed_row(32) == READS_PER_MISSED_ROW == 2.0
    assert disk_s_per_row(BOUND, 4, 1.0, 128) == pytest.approx(1 / 8000.0)
    assert disk_s_per_row(BOUND, 4, 1.0, 32) == pytest.approx(2 / 8000.0)
