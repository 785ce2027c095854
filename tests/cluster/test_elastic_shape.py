"""Elastic clusters on a real multi-node Ray cluster (simulated on this machine): a checkpoint of
2 nodes resumed on 1, one of 1 resumed on 3, and a 3-node job that loses every actor of a node
with no spare node and finishes on the 2 left. Each ends with the reference trainer's rows and
dense weights for that history: the batches up to the checkpoint on the old shape, the rest on
the new one (each reader past the checkpoint's batches of its new share), every row at its owner
under the new ``h % N``. About 60 s on 2 busy cores (three cluster pipelines started twice)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import ray

from hpsray.checkpoint import Checkpoints
from hpsray.data import PlantedCTR
from hpsray.pipelines import (
    CheckpointSettings,
    MemPSSettings,
    Pipeline,
    SSDPSSettings,
    SyntheticSource,
    TrainerSettings,
)
from hpsray.reference import ReferenceTrainer, global_batches
from hpsray.tiers.partition import owner_of

from recovery_drivers import pid_of  # tests/recovery_drivers.py
from small_pipeline import CLUSTER_CFG  # tests/small_pipeline.py

pytestmark = pytest.mark.slow

CFG = CLUSTER_CFG
GEN = PlantedCTR(n_slots=4, keys_per_slot=300, n_dense=2, seed=3)
BATCH = 200
SOURCE = SyntheticSource(GEN, rows=BATCH * 8)  # 8 batches on 1 node, 4 on 2, 3 on 3


def pipeline(tmp_path, nodes: int, resume: bool = False, max_failures: int = 2, devices: int = 1) -> Pipeline:
    return Pipeline(
        SOURCE,
        TrainerSettings(CFG, n_devices=devices),
        MemPSSettings(capacity_rows=700),  # rows travel to SSD-PS and back (one node holds two batches)
        SSDPSSettings(str(tmp_path / f"ssd-{nodes}"), options=dict(rows_per_file=128)),
        batch_size=BATCH,
        nodes=nodes,
        checkpoint=CheckpointSettings(
            str(tmp_path / "ckpt"), every_batches=1, max_failures=max_failures, resume=resume
        ),
    )


def reference_across(shapes: list[tuple]):
    """The reference after training batches ``[start, stop)`` of each ``(nodes, stop[, devices])``
    in turn, each shape's readers past the batches trained before it."""
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, CFG)
    ref.model.train()
    done = 0
    for nodes, stop, *devices in shapes:
        batches = global_batches(SOURCE, BATCH, nodes, CFG.minibatch_size, *devices)
        for t, minibatches in enumerate(batches):
            if t >= stop:
                break
            if t >= done:
                ref.train_minibatches(minibatches)
        done = stop
    return ref.export()


def stored_rows_by_node(p: Pipeline) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each node's rows as its SSD-PS holds them after a flush."""
    out = {}
    for i, node in enumerate(p._nodes):
        ray.get(node.mem.flush.remote())
        parts = ray.get(node.ssd.scan.remote())
        out[i] = (np.concatenate([k for k, _ in parts]), np.concatenate([r for _, r in parts]))
    return out


def check_equal(p: Pipeline, shapes: list[tuple]) -> None:
    keys, rows = p.export_rows()
    ref_keys, ref_rows, ref_dense = reference_across(shapes)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, atol=1e-5, rtol=0)
    dense = p.dense_state()
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), atol=1e-5, rtol=0, err_msg=name)
    n = len(p._nodes)
    for node, (k, r) in stored_rows_by_node(p).items():  # every row at its owner of the new shape
        assert np.all(owner_of(k, n) == node)
        np.testing.assert_allclose(r, ref_rows[np.searchsorted(ref_keys, k)], atol=1e-5, rtol=0)


def at_batch_end(p: Pipeline, batch: int, do) -> None:
    """Call ``do()`` in the driver once batch ``batch`` has trained, before its end's
    checkpoint (``every_batches = 1``: the checkpoint of ``batch`` is the one before it)."""
    original = p._after_batch
    done = []

    def hooked(batch_id, schedule):
        if batch_id == batch and not done:
            done.append(batch_id)
            do()
        original(batch_id, schedule)

    p._after_batch = hooked


@pytest.mark.parametrize(("old", "new", "devices"), [(2, 1, 2), (1, 3, 1)])
def test_resume_on_another_shape_equals_the_reference(three_nodes_cluster, tmp_path, old, new, devices):
    """2 nodes → 1 node of 2 devices (n_devices changes too), 1 node → 3 nodes."""
    with pipeline(tmp_path, old) as p:
        # as Ctrl-C: checkpoint at the batch's end and stop (3 nodes have 3 batches each: stop early)
        at_batch_end(p, 1 if old == 2 else 0, p.interrupt)
        with pytest.raises(KeyboardInterrupt):
            p.fit(progress=False)
    ckpt = Checkpoints(tmp_path / "ckpt").latest()
    assert ckpt is not None and ckpt.meta["nodes"] == old
    k = ckpt.batch
    with pipeline(tmp_path, new, resume=True, devices=devices) as p:
        report = p.fit(progress=False)
        assert report["nodes"] == new and len(p._nodes) == new
        assert report["reshaped"]["from_nodes"] == old and report["reshaped"]["to_nodes"] == new
        assert report["reshaped"]["batch"] == k
        check_equal(p, [(old, k), (new, 10**9, devices)])
    assert Checkpoints(tmp_path / "ckpt").latest().meta["nodes"] == new


def test_a_node_lost_with_no_spare_shrinks_the_job_onto_the_others(three_nodes_cluster, tmp_path):
    """Every actor of node 1 of 3 is killed (SIGKILL) after batch 1's checkpoint; the cluster
    has no fourth node, so the job re-partitions onto nodes 0 and 2 and finishes there."""
    with pipeline(tmp_path, 3) as p:
        p._start()
        victim_ray_node = p._nodes[1].node_id
        killed: list[int] = []

        def kill_node_1():
            node = p._nodes[1]
            pids = [pid_of(a) for a in (node.reader, node.mem, node.ssd, node.trainer)]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.extend(pids)

        at_batch_end(p, 1, kill_node_1)
        report = p.fit(progress=False)
        assert len(killed) == 4
        assert report["nodes"] == 2 and len(p._nodes) == 2
        (rec,) = report["recovery"]
        assert [lost["node"] for lost in rec["lost_nodes"]] == [1]
        assert rec["lost_nodes"][0]["ray_node"] == victim_ray_node and rec["lost_nodes"][0]["at"]
        assert rec["nodes"] == 2 and victim_ray_node not in rec["ray_nodes"]
        assert rec["reshaped"]["from_nodes"] == 3 and rec["reshaped"]["to_nodes"] == 2
        check_equal(p, [(3, rec["resumed_from_batch"]), (2, 10**9)])
