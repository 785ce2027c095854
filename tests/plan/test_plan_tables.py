"""``hpsray plan`` per table (issue 43): each table's keys counted apart (the sample's keys tagged
as the readers tag them), its bytes at its own row width, the refusal naming the tables, and the
plan's SSD-PS bytes per table against what a run of ``hpsray train`` leaves in the files."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpsray.data.generate import to_toml
from hpsray.job import JobConfig
from hpsray.plan.estimate import estimate_keys
from hpsray.plan.plan import _problems, make_plan
from hpsray.plan.sample import read_sample
from hpsray.tiers.ssd import SSDPS
from hpsray.tiers.tagcount import by_tag

SYNTHETIC = {"rows": 16_000, "slots": 4, "nnz": 6, "keys": 3000, "dense": 2}
ONE_WIDTH = [  # one width, each its own pooling / lr
    {"name": "small", "slots": [0, 2]},
    {"name": "lists", "slots": [1], "pooling": "mean"},
    {"name": "ids", "slots": [3], "lr": 0.002},
]
MIXED = [  # each its own width and optimizer
    {"name": "small", "slots": [0, 2], "dim": 4},
    {"name": "lists", "slots": [1], "dim": 16, "pooling": "mean"},
    {"name": "ids", "slots": [3], "dim": 8, "optimizer": "adam", "lr": 0.002},
]


def job_dict(tables, **tiers):
    return {
        "data": {"synthetic": SYNTHETIC},
        "model": {"dim": 4, "hidden": [8]},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
        "tiers": {"mem_rows": 200_000, **tiers},
        "pipeline": {"batch_size": 2000, "minibatch_size": 500},
        "cluster": {"nodes": 1},
        "tables": tables,
    }


def test_each_table_is_counted_from_its_own_keys():
    job = JobConfig.from_dict(job_dict(ONE_WIDTH), where="job.toml")
    sample = read_sample(job, 6_000)  # 3 of the 8 batches: extrapolated per table
    assert sample.n_tables == 3
    keys = estimate_keys(sample, 1)
    every = np.unique(np.concatenate(sample.batch_keys))
    exact = by_tag(every)[:3]
    assert exact.sum() == every.size and np.all(exact > 0)  # tagged: tables 0..2 in the top byte
    whole = estimate_keys(read_sample(job, 16_000), 1)  # the whole input: counted, not extrapolated
    full = by_tag(np.unique(np.concatenate(read_sample(job, 16_000).batch_keys)))[:3]
    for t in range(3):
        assert whole.table_distinct[t] == pytest.approx(full[t], rel=0.03)
        assert keys.table_distinct[t] >= exact[t] * 0.97  # the extrapolation never undercounts the sample
    assert sum(whole.table_distinct) == pytest.approx(whole.total_distinct, rel=0.03)


def test_each_table_is_sized_at_its_own_width():
    job = JobConfig.from_dict(job_dict(MIXED), where="job.toml")
    plan = make_plan(job, calibrate_stages=False)
    tables = plan.per_node["tables"]
    assert list(tables) == ["small", "lists", "ids"]
    # row bytes: weights + adagrad's per-element state (dims 4, 16) and adam's two moments (dim 8)
    assert [t["row_bytes"] for t in tables.values()] == [4 * 8, 4 * 32, 4 * 24]
    for t in tables.values():
        assert t["ssd_live_bytes"] == pytest.approx(t["shard_rows"] * (16 + t["row_bytes"]), abs=1)
        assert t["mem_ps_rows"] == pytest.approx(t["shard_rows"])  # the budget holds every row
    ssd = plan.per_node["ssd_ps"]
    assert ssd["live_bytes"] == pytest.approx(sum(t["ssd_live_bytes"] for t in tables.values()), abs=3)
    assert sum(t["lookup_share"] for t in tables.values()) == pytest.approx(1.0)


def test_the_working_set_is_planned_one_table_per_row_group():
    """The trainer's HBM-PS holds each group's rows at its width: the plan's table rows are
    what a trainer has once it held the sample's batches, and its bytes fewer than one table of
    the widest rows would take."""
    from hpsray.plan.sizing import hbm_capacity, hbm_table_bytes
    from hpsray.tiers.loans import Loan
    from hpsray.training.engine import TrainerEngine

    job = JobConfig.from_dict(job_dict(MIXED), where="job.toml")
    trainer = make_plan(job, calibrate_stages=False).per_node["trainer"]
    sample = read_sample(job, 16_000)
    cfg = job.train_config()
    engine = TrainerEngine(cfg, sample.n_slots, sample.n_dense, capacity=hbm_capacity(job, sample.n_slots))
    for keys in sample.batch_keys:
        k = np.unique(keys)
        engine.borrow(0, [k], [Loan(np.zeros((k.size, cfg.row_width), np.float32))])
    assert [t.width for t in engine.hbm.tables] == [8, 32, 24]
    assert trainer["hbm_table_rows"] == sum(t.capacity for t in engine.hbm.tables)
    padded, _ = hbm_table_bytes(trainer["hbm_capacity_rows"], cfg.row_width, 1, trainer["hbm_working_set_rows"])
    assert trainer["hbm_bytes"] < 0.85 * padded


def test_a_small_budget_goes_to_the_tables_by_their_lookups():
    job = JobConfig.from_dict(job_dict(MIXED, mem_rows=5000), where="job.toml")
    tables = make_plan(job, calibrate_stages=False).per_node["tables"]
    rows = [t["mem_ps_rows"] for t in tables.values()]
    assert sum(rows) == pytest.approx(5000)
    shares = np.array([t["lookup_share"] for t in tables.values()])
    assert np.allclose(np.array(rows) / 5000, shares)  # no table's whole shard fits its share here


def test_a_disk_that_cannot_hold_the_tables_is_refused_naming_them():
    job = JobConfig.from_dict(job_dict(MIXED), where="job.toml")
    plan = make_plan(job, calibrate_stages=False)
    plan.per_node["ssd_ps"]["free_bytes"] = 1000  # a full disk
    errors = [p for p in _problems(job, plan, 4.0) if p.severity == "error"]
    assert [p.setting for p in errors] == ["tiers.ssd_path"]
    message = errors[0].message
    assert "by table: 'lists'" in message  # the widest rows take the most
    for name, t in plan.per_node["tables"].items():
        assert f"'{name}' {int(t['ssd_live_bytes']):,}" in message


def hpsray(*args, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hpsray", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("tables", [ONE_WIDTH, MIXED], ids=["one-width", "own-widths"])
def test_plan_bytes_per_table_within_5_percent_of_a_run(tmp_path, tables):
    from hpsray.tiers.rowgroups import RowGroups
    from hpsray.tiers.ssd.grouped import GroupedSSDPS
    from hpsray.tiers.ssd.paramfile import record_bytes

    path = tmp_path / "job.toml"
    d = job_dict(tables, ssd_path=str(tmp_path / "ssd"), mem_rows=6000)  # of ~9,200 keys: rows spill
    d.pop("tables")
    d["data.synthetic"] = d.pop("data")["synthetic"]
    entries = "".join("\n[[tables]]\n" + to_toml({"t": t}).split("\n", 1)[1] for t in tables)
    path.write_text(to_toml(d) + entries)
    out = hpsray("plan", str(path), "--json", "--no-calibrate")
    assert out.returncode == 0, out.stderr[-3000:]
    planned = json.loads(out.stdout)["per_node"]["tables"]
    report_path, export = tmp_path / "run.json", tmp_path / "export"
    run = hpsray("train", str(path), "--report", str(report_path), "--export", str(export), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    config = JobConfig.load(path).train_config()
    groups = RowGroups.of_config(config, 4)
    node = str(tmp_path / "ssd" / "node-0")  # flushed by the export
    store = SSDPS(node, background=False) if groups is None else GroupedSSDPS(node, groups, background=False)
    try:
        live = store.live_rows_by_tag()
        live_bytes = live * store.record if isinstance(store, SSDPS) else store.live_bytes_by_tag()
    finally:
        store.close()
    widths = config.tables_for(4).widths
    reported = json.loads(report_path.read_text())["tables"]
    for t, (name, plan) in enumerate(planned.items()):
        measured = int(live_bytes[t])
        assert abs(plan["ssd_live_bytes"] - measured) <= 0.05 * measured, (name, plan, measured)
        # the report's: what the files held at its time (before the export flushed MEM-PS's rows)
        assert 0 < reported[name]["ssd_live_bytes"] <= measured
        assert reported[name]["ssd_live_bytes"] == reported[name]["ssd_live_rows"] * record_bytes(widths[t])
    assert int(live[3:].sum()) == 0  # no key outside the three tables' tags
