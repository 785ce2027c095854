"""On two nodes, each model kind with two passes, evaluation while training and early stopping
ends bit for bit where the reference trainer ends, with rows spilled to SSD-PS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.first_order import FIRST_ORDER_KINDS
from hpsray.job import JobConfig, build
from hpsray.reference_job import train_reference

KINDS = {
    "dlrm": {"bottom": [8], "top": [8]},
    "dcn": {"cross_layers": 2, "low_rank": 3, "hidden": [8]},
    "deepfm": {"hidden": [8]},
    "wide_deep": {"hidden": [8]},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_two_nodes_train_each_kind_over_passes_with_early_stopping_equal_to_the_reference(
    kind, two_nodes_cluster, tmp_path
):
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 2000, "eval_rows": 400, "slots": 4, "keys": 2000, "dense": 3, "seed": 2}},
            "model": {"kind": kind, "dim": 5, **KINDS[kind]},
            "optimizer": {"sparse": "adagrad", "sparse_lr": 0.5, "dense_lr": 0.01},
            "tiers": {
                "mem_rows": 1800 if kind in FIRST_ORDER_KINDS else 900,
                "ssd_path": str(tmp_path / "ssd"),
                "ssd": {"rows_per_file": 256},
            },
            "pipeline": {"batch_size": 250, "minibatch_size": 125, "passes": 2},
            "eval": {"every_batches": 2, "early_stopping": {"metric": "logloss", "patience": 2}},
            "cluster": {"nodes": 2},
        },
        where=str(tmp_path / "job.toml"),
    )
    with build.pipeline(job, address=two_nodes_cluster.address) as pipe:
        report = pipe.fit(progress=False)
        evals = pipe.evaluations
        assert evals is not None
        model = evals.best_model
        if model is None:  # no early stopping best kept: patience never ran out
            keys, rows = pipe.export_rows()
            model = (keys, rows, pipe.dense_state())
        assert report["cache"]["evicted"] > 0  # rows went to SSD-PS and back
    ref_report, ref_model = train_reference(job, quiet=True)
    assert report["batches"] == ref_report.batches
    assert ref_report.evaluations is not None
    ours = [{k: v for k, v in p.items() if k != "seconds"} for p in report["evaluations"]["points"]]
    assert ours == [{k: v for k, v in p.items() if k != "seconds"} for p in ref_report.evaluations["points"]]
    np.testing.assert_array_equal(model[0], ref_model[0])
    np.testing.assert_array_equal(model[1], ref_model[1])
    for name, value in ref_model[2].items():
        assert torch.equal(model[2][name], value), name
