"""Several passes with evaluation while training and early stopping: the pipeline (rows spilled to
SSD-PS) evaluates at the same batches as the reference trainer, gets the same figures, stops at the
same batch and exports the same best model (atol 0 on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpsray.errors import ConfigError
from hpsray.job import JobConfig, build
from hpsray.reference_job import train_reference


def _job(tmp_path, **eval_table) -> JobConfig:
    return JobConfig.from_dict(
        {
            "data": {"synthetic": {"rows": 2000, "eval_rows": 500, "slots": 4, "keys": 3000, "dense": 3, "seed": 1}},
            "model": {"dim": 4, "hidden": [8]},
            "optimizer": {"sparse": "adagrad", "sparse_lr": 0.5, "dense_lr": 0.01},
            "tiers": {"mem_rows": 1500, "ssd_path": str(tmp_path / "ssd"), "ssd": {"rows_per_file": 256}},
            "pipeline": {"batch_size": 250, "minibatch_size": 125, "passes": 3},
            "eval": eval_table,
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_batches": 5},
            "cluster": {"nodes": 1},
        },
        where=str(tmp_path / "job.toml"),
    )


def test_early_stopping_in_a_later_pass_keeps_the_best_model_equal_to_the_reference(ray_local, tmp_path):
    job = _job(tmp_path, every_batches=2, early_stopping={"metric": "logloss", "patience": 2})
    with build.pipeline(job) as pipe:
        report = pipe.fit(progress=False)
        evals = pipe.evaluations
        assert evals is not None and evals.best_model is not None
        keys, rows, dense = evals.best_model
        assert report["cache"]["evicted"] > 0  # rows travelled to SSD-PS and back
    ref_report, (ref_keys, ref_rows, ref_dense) = train_reference(job, quiet=True)
    ours, theirs = report["evaluations"], ref_report.evaluations
    assert theirs is not None
    assert ours["stopped_early"] and theirs["stopped_early"]
    assert report["batches"] == ref_report.batches < 3 * 8  # stopped inside a later pass
    assert report["batches"] > 8
    strip = [{k: v for k, v in p.items() if k != "seconds"} for p in ours["points"]]
    assert strip == [{k: v for k, v in p.items() if k != "seconds"} for p in theirs["points"]]
    assert ours["best"]["batches"] < report["batches"]
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)
    for name, value in ref_dense.items():
        assert torch.equal(dense[name], value), name
    best = tmp_path / "ckpt" / "best" / "manifest.json"  # a crash does not lose it
    assert best.exists()


def test_passes_without_early_stopping_evaluate_at_every_pass_end(ray_local, tmp_path):
    job = _job(tmp_path, every_batches=0)
    with build.pipeline(job) as pipe:
        report = pipe.fit(progress=False)
        keys, rows = pipe.export_rows()
    ref_report, (ref_keys, ref_rows, _) = train_reference(job, quiet=True)
    assert report["batches"] == ref_report.batches == 24
    assert [p["batches"] for p in report["evaluations"]["points"]] == [8, 16, 24]
    assert [p["auc"] for p in report["evaluations"]["points"]] == [p["auc"] for p in ref_report.evaluations["points"]]
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)


def test_eval_without_held_out_data_or_with_a_bad_key_is_refused_naming_it(tmp_path):
    table = {"data": {"synthetic": {"rows": 100}}, "eval": {"every_batches": 2}}
    with pytest.raises(ConfigError, match="eval: needs held-out data"):
        JobConfig.from_dict(table, where="job.toml")
    table["data"]["synthetic"]["eval_rows"] = 10
    table["eval"] = {"early_stopping": {"metric": "auc", "patiense": 2}}
    with pytest.raises(ConfigError, match="eval.early_stopping.patiense: unknown key \\(did you mean 'patience'"):
        JobConfig.from_dict(table, where="job.toml")


def test_hpsray_train_with_a_model_kind_passes_and_early_stopping_exports_what_the_reference_exports(tmp_path):
    """The user's path: ``hpsray train`` of a job file (DeepFM, 3 passes, early stopping), then
    ``--reference --compare --tolerance 0`` against its export of the best model."""
    import json
    import os
    import subprocess
    import sys

    from hpsray.data.generate import to_toml

    job = {
        "data.synthetic": {"rows": 2000, "eval_rows": 500, "slots": 4, "keys": 3000, "dense": 3, "seed": 1},
        "model": {"kind": "deepfm", "dim": 5, "hidden": [8]},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.5, "dense_lr": 0.01},
        "tiers": {"mem_rows": 3000, "ssd_path": str(tmp_path / "ssd")},  # each key's rows in two tables
        "pipeline": {"batch_size": 250, "minibatch_size": 125, "passes": 3},
        "eval": {"every_batches": 2},
        "eval.early_stopping": {"metric": "logloss", "patience": 2},
    }
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job))

    def hpsray(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [sys.executable, "-m", "hpsray", "train", str(path), "--quiet", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            check=False,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out

    hpsray("--export", str(tmp_path / "export"), "--report", str(tmp_path / "run.json"))
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["evaluations"]["stopped_early"] and report["batches"] < 24
    best = report["evaluations"]["best"]
    assert (report["auc"], report["logloss"]) == (best["auc"], best["logloss"])  # the exported model's
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["model"]["kind"] == "deepfm"
    out = hpsray("--reference", "--compare", str(tmp_path / "export"), "--tolerance", "0")
    assert "EQUAL within 0" in out.stdout, out.stdout
