"""Feature admission and expiry on two nodes (docs/architecture.md: Admission and expiry): each
owner counts its keys once per global batch, however many borrowers had them, and the run ends
with the reference's rows (fit_nodes, same rules) at their owners and the same counts."""

import numpy as np
import pytest
import ray

from hpsray.data import PlantedCTR
from hpsray.pipelines import SyntheticSource
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.partition import owner_of

from small_pipeline import CLUSTER_CFG, small_pipeline  # tests/small_pipeline.py

pytestmark = pytest.mark.slow

CFG = CLUSTER_CFG
GEN = PlantedCTR(n_slots=4, keys_per_slot=1500, n_dense=2, seed=3)
BATCH = 200
RULES = dict(admit_after=2, expire_after_batches=2)


def test_two_nodes_with_admission_and_expiry_equal_the_reference(two_nodes_cluster):
    source = SyntheticSource(GEN, rows=2400)  # 6 batches per node
    with small_pipeline(source, CFG, mem_rows=700, batch_size=BATCH, mem=RULES, nodes=2) as p:
        report = p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
        stored = [
            np.concatenate([k for k, _ in ray.get(node.ssd.scan.remote())] or [np.empty(0, np.uint64)])
            for node in p._nodes
        ]
    ref = ReferenceTrainer(GEN.n_slots, GEN.n_dense, CFG, **RULES)
    ref.fit_nodes(source, BATCH, 2)
    ref_keys, ref_rows, ref_dense = ref.export()
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_allclose(rows, ref_rows, atol=1e-5, rtol=0)
    for name, value in ref_dense.items():
        np.testing.assert_allclose(dense[name].numpy(), value.numpy(), atol=1e-5, rtol=0, err_msg=name)
    for node, k in enumerate(stored):  # every row at its owner only
        assert np.all(owner_of(k, 2) == node)
    assert sum(k.size for k in stored) == ref_keys.size
    for name in ("admitted", "rejected", "expired"):  # summed over the owners
        assert report["cache"][name] == ref.admission.stats[name] > 0, name
        assert sum(n["cache"][name] for n in report["per_node"]) == report["cache"][name]
