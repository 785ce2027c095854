"""``n_devices = D``: one trainer process per device, meeting in a device mesh over gloo (the CPU
path of one GPU per trainer): each process holds exactly its device's keys, rows and gradients
travel between them by all-to-all, and the result is the reference trainer's."""

import os

import numpy as np
import pytest
import ray

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.pipelines import (
    CheckpointSettings,
    MemPSSettings,
    Pipeline,
    SSDPSSettings,
    SyncSettings,
    SyntheticSource,
    TrainerSettings,
)
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.partition import device_of

from recovery_drivers import Killer  # tests/recovery_drivers.py

GEN = PlantedCTR(n_slots=4, keys_per_slot=2000, n_dense=3, seed=3)
SOURCE = SyntheticSource(GEN, rows=3000)
BATCH = 1000
CFG = TrainConfig(dim=4, hidden=(8,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)


@pytest.fixture(scope="module")
def reference():
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG)
    ref.fit(SOURCE.open(BATCH))
    return ref.export()


def _held(actor, n_devices: int) -> tuple[int, np.ndarray]:
    """A device process's pid and the devices of the keys its table holds."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: (os.getpid(), device_of(self.hbm.tables[0].keys(), self.n_nodes, n_devices))
        )
    )


@pytest.mark.parametrize("devices", [2, 4])
def test_device_processes_train_like_the_reference(ray_local, reference, devices):
    with Pipeline(
        SOURCE,
        TrainerSettings(CFG, n_devices=devices),
        MemPSSettings(capacity_rows=20_000),
        batch_size=BATCH,
        name=f"devices{devices}",
    ) as p:
        report = p.fit(progress=False)
        leader = p._nodes[0].trainer
        workers = [ray.get_actor(f"devices{devices}:Trainer[node 0, device {d}]") for d in range(1, devices)]
        held = [_held(a, devices) for a in [leader, *workers]]
        stats = ray.get(leader.stats.remote())
        assert ray.get(leader.replicas_equal.remote())
        keys, rows = p.export_rows()
        dense = p.dense_state()
    pids = [pid for pid, _ in held]
    assert len(set(pids)) == devices, "one process per device"
    for d, (_, where) in enumerate(held):  # each holds its device's keys only, and some
        assert where.size > 0 and (where == d).all()
    assert stats["exchanged_bytes_per_step"] > 0  # rows and gradients went between the processes
    assert report["examples"] == 3000
    ref_keys, ref_rows, ref_dense = reference
    np.testing.assert_array_equal(keys, ref_keys)
    # to float32 rounding: D slices sum a row's (and the dense) gradient in another order than
    # the reference's one pass, and Adagrad's small early accumulators magnify the last bit
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-4, atol=5e-5)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), rtol=1e-4, atol=5e-5, err_msg=name)


def test_device_processes_synchronise_bsp_only():
    with pytest.raises(ValueError, match="n_devices = 2 runs the device mesh, which synchronises BSP"):
        Pipeline(SOURCE, TrainerSettings(CFG, n_devices=2), sync=SyncSettings("ssp", staleness=1), batch_size=BATCH)


class DeviceKiller(Killer):
    """Kills ``("Device", node, after_batch)``: device 1's process of that node's trainer."""

    def _actor(self, kind: str, node: int):
        trainer = super()._actor("Trainer", node)
        if kind != "Device" or trainer is None:
            return trainer
        return ray.get(trainer.__ray_call__.remote(lambda self: self.workers[0]), timeout=30)


def test_a_killed_device_process_restarts_the_node_trainer_and_stays_lossless(ray_local, tmp_path):
    """A device process dies mid-pass: its node's trainer (device 0) exits too, the pipeline
    restarts it (with new device processes) from the last checkpoint, and the result is still
    the reference's."""
    batch = 500
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, CFG)
    ref.fit(SOURCE.open(batch))
    ref_keys, ref_rows, _ = ref.export()
    ckpt = tmp_path / "ckpt"
    pipeline = Pipeline(
        SOURCE,
        TrainerSettings(CFG, n_devices=2),
        MemPSSettings(capacity_rows=20_000),
        SSDPSSettings(str(tmp_path / "ssd")),
        batch_size=batch,
        checkpoint=CheckpointSettings(str(ckpt), every_batches=1, keep=2, max_failures=2),
    )
    with pipeline:
        pipeline._start()
        killer = DeviceKiller(pipeline, ckpt, [("Device", 0, 2)], seed=3)
        report = killer.fit()
        assert [k for k, _, _ in killer.killed] == ["Device"]
        assert len(report["recovery"]) == 1 and report["examples"] == SOURCE.rows
        keys, rows = pipeline.export_rows()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-4, atol=5e-5)


def test_two_device_processes_equal_the_reference_bit_for_bit(ray_local):
    """Invariant 1 to the bit with D = 2 on one node: each device's slice of a mini-batch is a
    share of its own (docs/architecture.md: invariant 1); adagrad rows and an adam MLP over 60
    batches, the devices' slices sharing keys."""
    gen = PlantedCTR(n_slots=3, keys_per_slot=40, n_dense=2, seed=11)
    cfg = TrainConfig(dim=4, hidden=(8,), minibatch_size=32, sparse_optimizer="adagrad", dense_optimizer="adam")
    source = SyntheticSource(gen, rows=64 * 60)
    with Pipeline(
        source, TrainerSettings(cfg, n_devices=2), MemPSSettings(capacity_rows=400), batch_size=64, name="bitwise2"
    ) as p:
        p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    ref = ReferenceTrainer(gen.n_slots, gen.n_dense, cfg)
    ref.fit_nodes(source, 64, 1, n_devices=2)
    ref_keys, ref_rows, ref_dense = ref.export()
    first = next(iter(source.open(64)))
    assert np.intersect1d(first.slice(0, 16).keys, first.slice(16, 32).keys).size > 0  # the slices share keys
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)
    for name, value in ref_dense.items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)
