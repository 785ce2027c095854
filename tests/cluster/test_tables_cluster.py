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


def _job(tmp_path, rows: int = 2000, keys: int = 2000, lr: float = 0.5, **cluster):
    return JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": rows, "eval_rows": 2000, "slots": 4, "keys": keys, "dense": 3, "seed": 2}},
            "model": {"dim": 4, "hidden": [8]},
            "optimizer": {"sparse": "adagrad", "sparse_lr": lr, "dense_lr": 0.01},
            "tiers": {"mem_rows": 1100, "ssd_path": str(tmp_path / "ssd"), "ssd": {"rows_per_file": 256}},
            "pipeline": {"batch_size": 250, "minibatch_size": 125, **cluster.pop("pipeline", {})},
            "cluster": {"nodes": 2, **cluster},
            "tables": THREE,
        },
        where=str(tmp_path / "job.toml"),
    )


def test_two_nodes_of_two_devices_train_three_widths_equal_to_the_reference(two_nodes_cluster, tmp_path):
    """The device mesh (D = 2 per node) with rows of three layouts: every gradient row routed
    to the device that holds its key there, bit for bit where the reference ends."""
    job = _job(tmp_path, pipeline={"n_devices": 2})
    with build.pipeline(job, address=two_nodes_cluster.address) as pipe:
        report = pipe.fit(progress=False)
        keys, rows = pipe.export_rows()
        dense = pipe.dense_state()
        assert report["cache"]["evicted"] > 0
    _, ref_model = train_reference(job, quiet=True)
    np.testing.assert_array_equal(keys, ref_model[0])
    np.testing.assert_array_equal(rows, ref_model[1])
    for name, value in ref_model[2].items():
        assert torch.equal(dense[name], value), name


def test_ssp_and_asp_train_three_widths_as_well_as_bsp(two_nodes_cluster, tmp_path):
    """SSP (bound 2) and ASP exchange every table's row gradients in one payload: they learn
    what BSP learns (held-out AUC within 0.01 of the reference's), SSP within its bound, and
    every row keeps its table's layout (zeros past its width)."""
    widths = [8, 32, 24]  # the tables' rows: 4 + 4 Adagrad, 16 + 16, 8 + Adam's 16
    runs = {}
    for mode in ("ssp", "asp"):
        job = _job(tmp_path / mode, rows=12_000, keys=800, lr=0.1, consistency=mode)
        with build.pipeline(job, address=two_nodes_cluster.address) as pipe:
            report = pipe.fit(progress=False)
            keys, rows = pipe.export_rows()
            runs[mode] = (report, pipe.evaluate(build.eval_source(job)))
        assert report["examples"] == 12_000
        tag = (keys >> np.uint64(56)).astype(np.int64)
        for t, w in enumerate(widths):
            assert np.any(rows[tag == t, :w]) and not np.any(rows[tag == t, w:]), (mode, t)
    reference, _ = train_reference(job, quiet=True)  # BSP: the same data, in memory
    assert reference.evaluation.auc > 0.65
    assert runs["ssp"][0]["sync"]["staleness_bound"] == 2 and runs["ssp"][0]["sync"]["max_staleness_observed"] <= 2
    for mode, (_, got) in runs.items():
        assert abs(got["auc"] - reference.evaluation.auc) <= 0.01, (mode, got["auc"], reference.evaluation.auc)
