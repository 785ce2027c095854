"""Recovery on a real multi-node Ray cluster (simulated on this machine): SIGKILL of each actor
kind on either node at seeded instants, then a node removed from a 3-node cluster; every run
finishes by itself with the reference trainer's rows and dense weights, rows at their owners."""

from __future__ import annotations

import pytest

from hpsray.data import PlantedCTR
from hpsray.pipelines import (
    CheckpointSettings,
    MemPSSettings,
    Pipeline,
    SSDPSSettings,
    SyntheticSource,
    TrainerSettings,
)

from recovery_drivers import Killer, kill_plan  # tests/recovery_drivers.py
from small_pipeline import CLUSTER_CFG  # tests/small_pipeline.py
from test_multinode import check_lossless  # tests/cluster

pytestmark = pytest.mark.slow

CFG = CLUSTER_CFG
GEN = PlantedCTR(n_slots=4, keys_per_slot=300, n_dense=2, seed=3)
BATCH = 200
SOURCE = SyntheticSource(GEN, rows=BATCH * 2 * 16)  # 16 batches per node


def pipeline_on(tmp_path, max_failures: int) -> Pipeline:
    return Pipeline(
        SOURCE,
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=450),  # rows travel to SSD-PS and back
        SSDPSSettings(str(tmp_path / "ssd"), options=dict(rows_per_file=128)),
        batch_size=BATCH,
        nodes=2,
        checkpoint=CheckpointSettings(str(tmp_path / "ckpt"), every_batches=2, max_failures=max_failures),
    )


@pytest.mark.parametrize("seed", [21, 22])
def test_two_nodes_recover_from_every_actor_kind_killed(own_three_nodes_cluster, tmp_path, seed):
    plan = kill_plan(seed, nodes=2, batches=16)
    with pipeline_on(tmp_path, len(plan)) as p:
        p._start()
        killer = Killer(p, tmp_path / "ckpt", plan, seed)
        report = killer.fit()
        assert [(k, n) for k, n, _ in killer.killed] == [(k, n) for k, n, _ in plan]
        assert len(report["recovery"]) == len(plan)
        assert report["examples"] == SOURCE.rows
        check_lossless(p, SOURCE, 2)


def test_a_removed_node_is_replaced_by_a_spare_one(own_three_nodes_cluster, tmp_path):
    """Train on 2 of the 3 nodes; remove node 1's Ray node mid-run: its stages start again on
    the third node, rebuilt from the checkpoint, and the result is the reference's."""
    import threading
    import time

    from recovery_drivers import committed_batches

    with pipeline_on(tmp_path, 2) as p:
        p._start()
        victim = p._nodes[1].node_id
        spare = {n.node_id for n in own_three_nodes_cluster.cluster.worker_nodes} - {nd.node_id for nd in p._nodes}
        assert spare, "the test needs a node the job does not use"

        def remove_when_checkpointed():
            while max(committed_batches(tmp_path / "ckpt"), default=-1) < 6:
                time.sleep(0.05)
            node = next(n for n in own_three_nodes_cluster.cluster.worker_nodes if n.node_id == victim)
            own_three_nodes_cluster.cluster.remove_node(node)

        remover = threading.Thread(target=remove_when_checkpointed, daemon=True)
        remover.start()
        report = p.fit(progress=False)
        remover.join(timeout=60)
        assert p._nodes[1].node_id in spare
        assert report["recovery"] and report["recovery"][0]["restarted"]
        check_lossless(p, SOURCE, 2)
