"""Recovery from dead actors: SIGKILL of each stage actor's process at seeded instants during
``fit()``; the run finishes by itself and ends equal to the reference trainer (rows and dense)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hpsray.checkpoint import Checkpoints
from hpsray.data import PlantedCTR
from hpsray.errors import DiskFullError, TrainingStopped, caused_by
from hpsray.pipelines import (
    CheckpointSettings,
    MemPSSettings,
    Pipeline,
    SSDPSSettings,
    SyntheticSource,
    TrainerSettings,
)
from hpsray.reference import ReferenceTrainer

from recovery_drivers import Killer, kill_plan  # tests/recovery_drivers.py
from small_pipeline import small_config, small_pipeline  # tests/small_pipeline.py

GEN = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=3, seed=5)
SOURCE = SyntheticSource(GEN, rows=15000)
BATCH = 500
CFG = small_config(minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)


ADMISSION = {"admit_after": 2, "expire_after_batches": 3}  # training state a checkpoint must keep too


def reference_of(**rules) -> tuple:
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG, **rules)
    ref.fit(SOURCE.open(BATCH))
    return ref.export()


@pytest.fixture(scope="module")
def reference():
    return reference_of()


def assert_equal_to_reference(pipeline, reference) -> None:
    keys, rows = pipeline.export_rows()
    dense = pipeline.dense_state()
    ref_keys, ref_rows, ref_dense = reference
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


KILLS = 6  # per one-node run: every kind once, two more at random


def run_with_kills(tmp_path, seed: int, nodes: int, **rules):
    ckpt = tmp_path / "ckpt"
    batches = SOURCE.rows // BATCH // nodes
    plan = kill_plan(seed, nodes, batches, KILLS)
    pipeline = Pipeline(
        SOURCE,
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=1500, **rules),  # rows travel to SSD-PS and back
        SSDPSSettings(str(tmp_path / "ssd"), options=dict(rows_per_file=256)),
        batch_size=BATCH,
        nodes=nodes,
        checkpoint=CheckpointSettings(str(ckpt), every_batches=2, keep=2, max_failures=len(plan)),
    )
    pipeline._start()
    killer = Killer(pipeline, ckpt, plan, seed)
    report = killer.fit()
    return pipeline, report, killer


# 2 runs x 6 kills here and 2 x 4 on a cluster (tests/cluster/test_recovery_cluster.py): 20 trials
@pytest.mark.parametrize("seed,rules", [(11, {}), (13, ADMISSION)], ids=["11", "13-admission"])
def test_one_node_recovers_from_every_actor_kind_killed(ray_local, tmp_path, reference, seed, rules):
    pipeline, report, killer = run_with_kills(tmp_path, seed, nodes=1, **rules)
    with pipeline:
        assert [k for k, _, _ in killer.killed] == [k for k, _, _ in kill_plan(seed, 1, 30, KILLS)]
        assert len(report["recovery"]) == len(killer.killed)
        for entry in report["recovery"]:
            assert entry["resumed_from_batch"] <= entry["failed_at_batch"] and entry["restart_s"] > 0
        assert report["batches"] == 30 and report["examples"] == SOURCE.rows
        assert report["checkpoints"]["count"] >= 15
        assert_equal_to_reference(pipeline, reference_of(**rules) if rules else reference)


def test_killing_a_busy_pipeline_without_checkpoints_still_stops_with_the_cause(ray_local, tmp_path):
    """No [checkpoint]: a dead actor ends fit() with TrainingStopped naming it (as before)."""
    pipeline = small_pipeline(SOURCE, CFG, mem_rows=20000, batch_size=BATCH, name="no-ckpt")
    with pipeline:
        pipeline._start()
        killer = Killer(pipeline, tmp_path / "none", [("Trainer", 0, -1)], seed=1)
        killer.start()
        with pytest.raises(TrainingStopped) as stopped:
            pipeline.fit(progress=False)
        killer.join(timeout=30)
    assert "died" in str(stopped.value) or "Actor" in str(stopped.value)


@pytest.fixture
def small_fs(tmpfs):
    """A 192 KiB tmpfs (tests/conftest.py: ``tmpfs``)."""
    return tmpfs("192k")


def test_a_full_checkpoint_disk_stops_clearly_and_the_last_checkpoint_resumes(ray_local, tmp_path, small_fs, reference):
    ckpt = small_fs / "ckpt"
    stages = (TrainerSettings(CFG), MemPSSettings(capacity_rows=1500), SSDPSSettings(str(tmp_path / "ssd")))
    with Pipeline(
        SOURCE, *stages, batch_size=BATCH, checkpoint=CheckpointSettings(str(ckpt), every_batches=2, keep=1)
    ) as p:
        with pytest.raises(TrainingStopped) as stopped:
            p.fit(progress=False)
    assert caused_by(stopped.value, DiskFullError)
    message = str(stopped.value)
    assert str(small_fs) in message and "bytes" in message
    last = Checkpoints(ckpt).latest()
    assert last is not None and last.batch >= 2
    last.verify(deep=True)
    # the last checkpoint, moved to a disk with room, resumes and ends with the reference's model
    roomy = tmp_path / "roomy"
    shutil.copytree(ckpt, roomy)
    with Pipeline(
        SOURCE, *stages, batch_size=BATCH, checkpoint=CheckpointSettings(str(roomy), every_batches=10, resume=True)
    ) as p:
        report = p.fit(progress=False)
        assert report["batches"] == 30 - last.batch
        assert_equal_to_reference(p, reference)


def test_a_full_ssd_disk_stops_naming_the_directory(ray_local, small_fs):
    # preflight=False: the run itself meets the full disk (the pre-flight plan would refuse it first)
    with small_pipeline(SOURCE, CFG, mem_rows=1500, batch_size=BATCH, ssd_dir=small_fs / "ssd", preflight=False) as p:
        with pytest.raises(TrainingStopped) as stopped:
            p.fit(progress=False)
    assert caused_by(stopped.value, DiskFullError)
    assert str(small_fs / "ssd") in str(stopped.value)
