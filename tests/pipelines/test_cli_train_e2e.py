"""``hpsray train`` and ``hpsray demo`` end to end, as a user runs them (real subprocesses), and
the export format against the in-process Pipeline."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpsray.data import PlantedCTR, write_synthetic
from hpsray.data.generate import to_toml
from hpsray.export import compare_exports, export, load_export
from hpsray.job import JobConfig, build

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUIRED = (
    "auc",
    "logloss",
    "examples_per_s",
    "batches",
    "stage_busy_s",
    "pipeline_efficiency",
    "cache_hit_rate",
    "ssd",
    "bad_input",
    "bad_rows",
    "per_batch_s",
    "wall_s",
    "examples",
)


def hpsray(*args, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "hpsray", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    """A tiny generated data set (4 training files, 1 held-out) and a job whose MEM-PS budget is
    below its distinct keys."""
    root = tmp_path_factory.mktemp("job")
    gen = PlantedCTR(n_slots=4, keys_per_slot=3000, n_dense=2, seed=7)
    files = write_synthetic(str(root / "data"), gen, 5000, "criteo", shard_rows=1000)
    per_batch = np.unique(gen.generate(1000).keys).size
    job = {
        "data": {"paths": ["data/part-0000[0-3].tsv"], "eval_paths": ["data/part-00004.tsv"]},
        "model": {"dim": 4, "hidden": [16]},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05},
        "tiers": {"mem_rows": int(2.5 * per_batch)},
        "tiers.ssd": {"rows_per_file": 256},
        "pipeline": {"batch_size": 1000, "minibatch_size": 250},
    }
    assert len(files) == 5
    with open(files[3], "a") as f:  # one malformed row: skipped and counted (lenient mode)
        f.write("1\tnot-a-number\n")
    path = root / "job.toml"
    path.write_text(to_toml(job))
    return path


@pytest.fixture(scope="module")
def trained(job_file):
    """``hpsray train JOB --report --export --json`` once for the module: (report, export dir, stdout report)."""
    root = job_file.parent
    out = hpsray(
        "train",
        str(job_file),
        "--report",
        str(root / "out" / "run.json"),
        "--export",
        str(root / "export"),
        "--json",
        "--quiet",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((root / "out" / "run.json").read_text()), root / "export", json.loads(out.stdout)


def test_train_writes_the_report_and_its_plots(trained, job_file):
    report, _, printed = trained
    assert printed["examples"] == report["examples"] == 4000
    for key in REQUIRED:
        assert key in report, key
    assert report["batches"] == 4
    assert set(report["stage_busy_s"]) == {"read", "pull", "load", "train"}
    assert 0 < report["pipeline_efficiency"] <= 1.0 + 1e-9
    assert sorted(report["cache_hit_rate"], key=int) == ["0", "1", "2", "3"]
    assert report["ssd"]["bytes_written"] > 0 and "bytes_read" in report["ssd"]
    assert report["cache"]["evicted"] > 0  # rows went to SSD-PS
    assert report["bad_rows"] == 1 and report["bad_input"]["rows_ok"] == 4000
    assert sum(report["bad_input"]["counts"].values()) == 1
    assert 0.5 < report["auc"] <= 1.0 and report["eval_examples"] == 1000
    assert report["config"]["pipeline"]["batch_size"] == 1000
    stem = job_file.parent / "out" / "run"
    for name in ("stage_times", "cache_hit_rate", "ssd_io", "loss"):
        png = stem.with_name(f"run.{name}.png")
        data = png.read_bytes()
        assert data[:8] == PNG_SIGNATURE, png
        import matplotlib.image

        img = matplotlib.image.imread(str(png))
        assert img.shape[0] > 100 and img.shape[1] > 100


def test_reference_run_matches_the_pipeline_export(trained, job_file):
    """The losslessness check a user runs: the reference trainer ends with the same rows."""
    _, hps_dir, _ = trained
    ref_dir = job_file.parent / "ref"
    out = hpsray("train", str(job_file), "--reference", "--export", str(ref_dir), "--compare", str(hps_dir), "--quiet")
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout
    assert "EQUAL within 1e-05" in out.stdout
    hk, hr, hd = load_export(hps_dir)
    rk, rr, rd = load_export(ref_dir)
    assert np.array_equal(hk, rk)
    np.testing.assert_allclose(hr, rr, atol=1e-5, rtol=0)
    for name in rd:
        np.testing.assert_allclose(hd[name].numpy(), rd[name].numpy(), atol=1e-5, rtol=0)
    assert json.loads((ref_dir / "manifest.json").read_text())["trainer"] == "reference"


def test_export_round_trip_equals_pipeline_export_rows(trained, job_file, tmp_path, ray_local):
    _, hps_dir, _ = trained
    job = JobConfig.load(job_file)
    with build.pipeline(job) as pipe:
        pipe.fit(progress=False)
        keys, rows = pipe.export_rows()
        manifest = export(pipe, tmp_path / "exp", job.train_config())
        dense = pipe.dense_state()
    assert manifest["rows"] == keys.size and manifest["state_width"] == 4 and manifest["model"]["n_slots"] == 4
    perm = np.random.default_rng(0).permutation(keys.size)  # order-insensitive comparison
    for directory in (tmp_path / "exp", hps_dir):
        ek, er, ed = load_export(directory)
        diff = compare_exports((keys[perm], rows[perm], dense), (ek, er, ed))
        assert diff["keys_only_in_a"] == diff["keys_only_in_b"] == 0, directory
        assert diff["max_abs_row_diff"] <= 1e-6 and diff["max_abs_dense_diff"] <= 1e-6, (directory, diff)


def test_train_refuses_bad_jobs_before_starting_ray(tmp_path, job_file, capsys):
    from hpsray.__main__ import main  # in-process: these fail before Ray would start

    bad = tmp_path / "bad.toml"
    bad.write_text("[data.synthetic]\nrows = 100\n[pipeline]\nbatch_size = -5\n")
    assert main(["train", str(bad)]) == 2
    assert f"{bad}: pipeline.batch_size: must be a positive integer, got -5" in capsys.readouterr().err
    stale = tmp_path / "stale.toml"
    (tmp_path / "ssd" / "node-0").mkdir(parents=True)
    (tmp_path / "ssd" / "node-0" / "MANIFEST").write_text("x")
    stale.write_text('[data.synthetic]\nrows = 100\n[tiers]\nssd_path = "ssd"\n')
    assert main(["train", str(stale)]) == 2
    err = capsys.readouterr().err
    assert "tiers.ssd_path" in err and "earlier run" in err
    assert main(["train", str(job_file), "--compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and "manifest.json" in err
    no_schema = tmp_path / "noschema.toml"
    (tmp_path / "raw").mkdir()
    no_schema.write_text('[data]\npaths = ["raw"]\n')
    assert main(["train", str(no_schema)]) == 2
    assert "data.schema: missing" in capsys.readouterr().err


def test_demo_at_a_tiny_size(tmp_path):
    out = hpsray("demo", "--rows", "2000", "--json", "--quiet", "--report", str(tmp_path / "demo.json"))
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    assert report["examples"] == 2000 and report["auc"] is not None
    assert report["demo"]["rows_evicted"] > 0 and report["demo"]["mem_rows"] < report["demo"]["distinct_keys"]
    assert (tmp_path / "demo.ssd_io.png").read_bytes()[:8] == PNG_SIGNATURE
