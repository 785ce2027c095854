"""On two nodes, tables of their own width, pooling and sparse optimizer (issue 43) end bit for
bit where the reference trainer ends, with rows spilled to SSD-PS at each table's width."""

from __future__ import annotations

import numpy as np
import torch

from hpsray.job import JobConfig, build
from hpsray.reference_job import train_reference

THREE = [
    {"name": "small", "slots": [0, 2], "dim": 4},
    {"name": "lists", "slots": [1], "dim": 16, "pooling": "mean"},
    {"name": "ids", "slots": [3], "dim": 8, "optimizer": "adam", "lr": 0.02},
]


def test_two_nodes_train_three_widths_equal_to_the_reference(two_nodes_cluster, tmp_path):
    job = JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 2000, "eval_rows": 400, "slots": 4, "keys": 2000, "dense": 3, "seed": 2}},
            "model": {"dim": 4, "hidden": [8]},
            "optimizer": {"sparse": "adagrad", "sparse_lr": 0.5, "dense_lr": 0.01},
            "tiers": {"mem_rows": 1100, "ssd_path": str(tmp_path / "ssd"), "ssd": {"rows_per_file": 256}},
            "pipeline": {"batch_size": 250, "minibatch_size": 125},
            "cluster": {"nodes": 2},
            "tables": THREE,
        },
        where=str(tmp_path / "job.toml"),
    )
    with build.pipeline(job, address=two_nodes_cluster.address) as pipe:
        report = pipe.fit(progress=False)
        keys, rows = pipe.export_rows()
        dense = pipe.dense_state()
        assert report["cache"]["evicted"] > 0  # rows went to SSD-PS and back
    _, ref_model = train_reference(job, quiet=True)
    np.testing.assert_array_equal(keys, ref_model[0])
    np.testing.assert_array_equal(rows, ref_model[1])  # each table at its width, zeros past it
    for name, value in ref_model[2].items():
        assert torch.equal(dense[name], value), name
