"""Every model kind, named in a job file, trains through the pipeline with rows spilled to SSD-PS
and ends equal to the reference trainer (atol 0 on CPU); its export serves the trained model's
predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.export import export, load_export, schema_of_source
from hpsray.first_order import FIRST_ORDER_KINDS
from hpsray.job import JobConfig, build
from hpsray.reference import ReferenceTrainer
from hpsray.reference_job import train_reference
from hpsray.serving.model import ServableModel

KINDS = {
    "dlrm": {"bottom": [8], "top": [8]},
    "dcn": {"cross_layers": 2, "low_rank": 3, "structure": "parallel", "hidden": [8]},
    "deepfm": {"hidden": [8]},
    "wide_deep": {"hidden": [8]},
}


def _job(kind: str, tmp_path) -> JobConfig:
    rows = 4000 if kind in FIRST_ORDER_KINDS else 2000  # deepfm, wide_deep: each key's rows in two tables
    return JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 2000, "eval_rows": 500, "slots": 4, "keys": 3000, "dense": 3, "seed": 1}},
            "model": {"kind": kind, "dim": 5, **KINDS[kind]},
            "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
            "tiers": {"mem_rows": rows, "ssd_path": str(tmp_path / "ssd"), "ssd": {"rows_per_file": 256}},
            "pipeline": {"batch_size": 500, "minibatch_size": 125},
            "cluster": {"nodes": 1},
        },
        where=str(tmp_path / "job.toml"),
    )


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_trains_through_the_pipeline_equal_to_the_reference_and_serves(kind, ray_local, tmp_path):
    job = _job(kind, tmp_path)
    with build.pipeline(job) as pipe:
        pipe.fit(progress=False)
        keys, rows = pipe.export_rows()
        dense = pipe.dense_state()
        assert pipe.report is not None and pipe.report.cache["evicted"] > 0  # rows went to SSD-PS and back
    _, (ref_keys, ref_rows, ref_dense) = train_reference(job, quiet=True)
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)
    assert ref_dense.keys() == dense.keys()
    for name, value in ref_dense.items():
        assert torch.equal(dense[name], value), name

    source = build.source(job)
    manifest = export(
        (keys, rows, dense),
        str(tmp_path / "export"),
        job.train_config(),
        n_slots=4,
        n_dense=3,
        schema=schema_of_source(source),
    )
    assert manifest["model"]["kind"] == kind
    if kind in FIRST_ORDER_KINDS:  # each key's w_i is a width-1 row of the first-order table
        assert {e["name"]: e["dim"] for e in manifest["tables"]} == {"default": 5, "first_order": 1}
        assert set((keys >> np.uint64(56)).tolist()) == {0, 1}
    served = ServableModel.load(str(tmp_path / "export"))
    batch = next(iter(source.open(125)))  # one of the reference's mini-batches: the same matmul shapes
    model = job.train_config()
    trained = ReferenceTrainer(4, 3, model)
    if trained.tables is None:
        trained.store.preload(*load_export(str(tmp_path / "export"))[:2])
    else:  # deepfm, wide_deep: the first-order rows' table too (each row its own width)
        for t, store in enumerate(trained.stores):
            mine = trained.tables.table_of(keys) == t
            store.preload(keys[mine], rows[mine, : trained.tables.widths[t]])
    trained.model.load_state_dict(ref_dense)
    np.testing.assert_array_equal(served.predict(batch), trained.predict(batch))
