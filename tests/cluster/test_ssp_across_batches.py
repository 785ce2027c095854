"""Issue 19 item 1: SSP across batch boundaries on a 2-node Ray cluster.

Under SSP a straggler may fall up to ``staleness`` mini-batches behind across batch ends too:
the fast trainer goes on into the next batch without a barrier (measured: the report's
``max_staleness_across_batches``), never past its bound, the owners keep the freshest copy of
each row (never staler than the bound), and the model learns as well as under BSP. BSP's
equality with the reference is test_multinode.py's and test_pipeline_system.py's.
"""

import numpy as np
import pytest

from hpsray.data import PlantedCTR
from hpsray.kernels.init import RowInit
from hpsray.pipelines import MemPSSettings, Pipeline, SyncSettings, SyntheticSource, TrainerSettings
from hpsray.tiers.lending import Lender
from hpsray.tiers.loans import Returned
from hpsray.tiers.mem import MemPS
from hpsray.tiers.warmup import _DictStore

from hooks import straggler  # tests/cluster/hooks.py (pytest puts this directory on sys.path)
from loading import lend  # tests/loading.py
from small_pipeline import small_config  # tests/small_pipeline.py

GEN = PlantedCTR(n_slots=4, keys_per_slot=200, n_dense=2, seed=7)
CFG = small_config(hidden=(16, 8), minibatch_size=128, seed=7, sparse_lr=0.1)
W = 8
INIT = RowInit(dim=4, scale=0.1, seed=3)


def test_owner_keeps_the_freshest_copy_and_complete_copies_in_order():
    keys = np.array([3, 5, 9], np.uint64)
    lender = Lender(MemPS(64, W, _DictStore(W), INIT), 0, INIT)
    lend(lender, 1, keys, borrower=0)
    lend(lender, 1, keys[:2], borrower=1)
    fresh = np.full((3, W), 1.0, np.float32)  # borrower 0's copy: every update up to clock 10
    stale = np.full((2, W), 2.0, np.float32)  # borrower 1's copy: the others' only up to clock 8
    # borrower 1 returns last (the straggler's copy in the given order), yet the freshest wins
    lender.write_back(1, [Returned(0, keys, fresh, clock=10, applied=10), Returned(1, keys[:2], stale, 10, 8)])
    np.testing.assert_array_equal(lender.lookup(keys), fresh)
    assert lender.max_staleness == 0  # only complete copies were kept
    # a key only the stale copy holds is kept from it: the owner's staleness is that copy's
    lend(lender, 2, keys, borrower=0)
    lend(lender, 2, keys, borrower=1)
    lender.write_back(2, [Returned(0, keys[:1], fresh[:1], 20, 19), Returned(1, keys, stale[:1].repeat(3, 0), 20, 18)])
    np.testing.assert_array_equal(lender.lookup(keys[:1]), fresh[:1])
    np.testing.assert_array_equal(lender.lookup(keys[1:]), stale[:1].repeat(2, 0))
    assert lender.max_staleness == 2
    # complete copies (BSP, or a pass's final barrier): stored in order, the last one wins
    lend(lender, 3, keys, borrower=0)
    lend(lender, 3, keys, borrower=1)
    lender.write_back(3, [Returned(0, keys, stale[:1].repeat(3, 0)), Returned(1, keys, fresh)])
    np.testing.assert_array_equal(lender.lookup(keys), fresh)


def fit(sync: SyncSettings):
    with Pipeline(
        SyntheticSource(GEN, rows=9000),
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=2000),
        batch_size=1500,
        nodes=2,
        sync=sync,
    ) as p:
        report = p.fit(progress=False)
        auc = p.evaluate(SyntheticSource(GEN, rows=5000, start_row=500_000))["auc"]
        return report, auc


@pytest.mark.slow
def test_ssp_straggler_crosses_batch_ends_within_its_bound(two_nodes_cluster):
    bsp, bsp_auc = fit(SyncSettings("bsp"))
    # node 1 is 200 ms slower at every mini-batch: node 0 keeps at the bound, batch ends included
    # (200 ms, not 50: the straggler's two clocks must outlast the fast trainer's batch end on a
    # loaded machine; at 50 ms a CI run once saw every batch end caught up, across = 0)
    ssp, ssp_auc = fit(SyncSettings("ssp", staleness=2, before_minibatch=straggler(1, 0.2)))
    sync = ssp["sync"]
    assert ssp["examples"] == bsp["examples"] == 9000
    assert bsp["sync"]["max_staleness_across_batches"] == 0
    assert bsp["sync"]["max_owner_staleness"] == 0
    # the fast trainer went on past batch ends while the straggler was still in the batch before
    assert 1 <= sync["max_staleness_across_batches"] <= 2
    assert sync["max_staleness_observed"] <= 2  # the bound, inside and across batches
    assert sync["max_owner_staleness"] <= 2  # owners never keep a copy staler than the bound
    assert abs(ssp_auc - bsp_auc) <= 0.01, (ssp_auc, bsp_auc)


@pytest.mark.slow
def test_ssp_across_batches_recovers_from_a_killed_trainer(two_nodes_cluster, tmp_path):
    """A trainer killed mid-pass under SSP (no batch-end barrier, updates carried across batch
    ends): the pipeline restarts from the newest checkpoint, the pass completes within the
    bound, and the model learns as well as an uninterrupted SSP run."""
    from hpsray.pipelines import CheckpointSettings

    from recovery_drivers import Killer  # tests/recovery_drivers.py

    source, held_out = SyntheticSource(GEN, rows=9000), SyntheticSource(GEN, rows=5000, start_row=500_000)
    sync = SyncSettings("ssp", staleness=2, before_minibatch=straggler(1, 0.02))
    _, clean_auc = fit(sync)
    ckpt = tmp_path / "ckpt"
    pipeline = Pipeline(
        source,
        TrainerSettings(CFG),
        MemPSSettings(capacity_rows=2000),
        batch_size=1500,
        nodes=2,
        sync=sync,
        checkpoint=CheckpointSettings(str(ckpt), every_batches=1, keep=2, max_failures=2),
    )
    with pipeline:
        pipeline._start()
        killer = Killer(pipeline, ckpt, [("Trainer", 1, 1)], seed=5)
        report = killer.fit()
        auc = pipeline.evaluate(held_out)["auc"]
    assert [k for k, _, _ in killer.killed] == ["Trainer"] and len(report["recovery"]) == 1
    assert report["examples"] == 9000 and report["sync"]["max_staleness_observed"] <= 2
    assert abs(auc - clean_auc) <= 0.02, (auc, clean_auc)
