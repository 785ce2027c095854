"""The planner's memory and disk figures for SSD-PS (issue 27): the key map's bytes equal a real
map's, and a job whose key map cannot fit in its node's memory (a real memory cgroup) is refused
by ``hpsray plan`` and by ``hpsray train`` before Ray starts, naming ``cluster.nodes``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpsray.data import PlantedCTR, write_synthetic
from hpsray.data.generate import to_toml
from hpsray.plan.footprint import disk_high_water, ssd_memory
from hpsray.tiers.ssd import SSDPS, TableImport
from hpsray.tiers.ssd.keymap import KeyMap, map_bytes

DIM = 4


def test_key_map_bytes_equal_a_real_map_sized_once_or_grown():
    n = 60_000
    keys = np.arange(1, n + 1, dtype=np.uint64)
    sized = KeyMap(n)
    sized.place(keys, np.zeros(n, np.int32), np.zeros(n, np.int32))
    assert sized.nbytes == map_bytes(n)[0] and 19.9 < sized.nbytes / n < 20.1
    grown = KeyMap()
    for part in np.array_split(keys, 120):  # a dump at a time: each growth by half
        grown.grow(part.size)
        grown.place(part, np.zeros(part.size, np.int32), np.zeros(part.size, np.int32))
    steady, peak = map_bytes(n, 0)
    assert grown.nbytes == steady and 20 <= steady / n <= 30 and peak > steady


def _table(path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path)
    keys = np.arange(rows, dtype=np.uint64)
    values = pa.array(np.ones(rows * DIM, np.float32))
    pq.write_table(
        pa.table({"key": pa.array(keys), "row": pa.FixedSizeListArray.from_arrays(values, DIM)}), path / "t.parquet"
    )


def test_an_imported_store_is_sized_like_the_plan_says(tmp_path):
    _table(tmp_path / "table", 50_000)
    with SSDPS(tmp_path / "s", 2 * DIM) as s:
        s.bulk_load(TableImport(str(tmp_path / "table"), DIM))
        st = s.stats
    plan = ssd_memory(50_000, 2 * DIM, imported=50_000)
    assert plan["key_map_bytes"] == st["key_map_bytes"]
    disk = disk_high_water(50_000, 2 * DIM, 0, 1.5, 2.0)
    assert disk["live_bytes"] <= st["disk_bytes"] <= disk["live_bytes"] * 1.02  # headers and file rounding


def _hpsray(*args, cgroup=None, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    pre = None
    if cgroup is not None:
        pre = cgroup.join
    return subprocess.run(
        [sys.executable, "-m", "hpsray", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
        preexec_fn=pre,
    )


def test_a_job_whose_key_map_cannot_fit_is_refused_before_ray_starts(tmp_path):
    from hpsray.bench.memory_cgroup import Cgroup

    gen = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=2, seed=3)
    write_synthetic(str(tmp_path / "data"), gen, 4_000, "criteo", shard_rows=4_000)
    _table(tmp_path / "table", 3_000_000)
    d = {
        "data": {"paths": ["data/"]},
        "model": {"dim": DIM, "hidden": [8]},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
        "tiers": {"mem_rows": 20_000, "init_from": "table"},
        "pipeline": {"batch_size": 1000, "minibatch_size": 500},
        "cluster": {"nodes": 1},
    }
    job = tmp_path / "job.toml"
    job.write_text(to_toml(d))
    out = _hpsray("plan", str(job), "--json", "--no-calibrate")
    assert out.returncode == 0, out.stderr[-3000:]
    node = json.loads(out.stdout)["per_node"]
    assert node["ssd_ps"]["rows"] == 3_000_000 and node["ssd_ps"]["imported_rows"] == 3_000_000
    m = node["memory"]
    ssd = node["ssd_ps"]
    assert m["key_map_bytes"] == ssd["key_map_bytes"] + ssd["block_table_bytes"] + ssd["heat_bytes"]
    # a node that holds everything but half the key map: the key map is what cannot fit
    try:
        group = Cgroup(f"hpsray-test-plan-{os.getpid()}", m["total_bytes"] - m["key_map_bytes"] // 2)
    except RuntimeError as e:  # no root or no memory controller: the refusal cannot be staged
        pytest.fail(f"needs a memory cgroup (root): {e}")
    try:
        out = _hpsray("plan", str(job), "--no-calibrate", cgroup=group)
        assert out.returncode == 1 and "cluster.nodes" in out.stdout and "key map" in out.stdout, out.stdout
        assert "raise cluster.nodes to >= 2" in out.stdout, out.stdout
        refused = _hpsray("train", str(job), cgroup=group)
        assert refused.returncode == 2 and "cluster.nodes" in refused.stderr, refused.stderr[-3000:]
        assert "Started a local Ray instance" not in refused.stderr
    finally:
        group.remove(wait_s=5)
