"""``[tiers] init_from``: training that starts from an imported table equals the reference
started from the same table."""

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.pipelines import SyntheticSource
from hpsray.reference import ReferenceTrainer
from hpsray.tiers.ssd import TableImport, read_table

from small_pipeline import small_config, small_pipeline  # tests/small_pipeline.py

GEN = PlantedCTR(n_slots=4, keys_per_slot=3000, n_dense=3, seed=1)
SOURCE = SyntheticSource(GEN, rows=4000)
BATCH = 1000


def _export_like(directory, cfg: TrainConfig) -> np.ndarray:
    """A table holding half of the keys the data touches plus as many it never touches, with
    trained-looking rows (weights and optimizer state), written as two Parquet files."""
    touched = np.unique(np.concatenate([b.keys for b in SOURCE.open(BATCH)]))
    rng = np.random.default_rng(5)
    keys = np.concatenate([touched[::2], rng.integers(1, 2**62, touched.size // 2, dtype=np.uint64)])
    keys = np.unique(keys)
    weights = rng.normal(0, 0.1, (keys.size, cfg.dim)).astype(np.float32)
    state = rng.uniform(0, 0.5, (keys.size, cfg.row_width - cfg.dim)).astype(np.float32)
    directory.mkdir()
    for i, part in enumerate(np.array_split(np.arange(keys.size), 2)):
        cols = {
            "key": pa.array(keys[part]),
            "weights": pa.FixedSizeListArray.from_arrays(pa.array(weights[part].reshape(-1)), cfg.dim),
            "state": pa.FixedSizeListArray.from_arrays(pa.array(state[part].reshape(-1)), state.shape[1]),
        }
        pq.write_table(pa.table(cols), directory / f"part-{i}.parquet")
    return keys


def test_training_from_an_import_equals_the_reference_from_it(ray_local, tmp_path):
    """Imported rows are read from SSD-PS, trained, evicted (3500 rows of MEM-PS against ~6000
    distinct keys) and read back; every row and dense weight equals the reference's bit for bit."""
    cfg = small_config(hidden=(16,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)
    imported = _export_like(tmp_path / "table", cfg)
    spec = TableImport(str(tmp_path / "table"), cfg.dim, float(cfg.row_init().state_value))
    with small_pipeline(
        SOURCE,
        cfg,
        mem_rows=3500,
        batch_size=BATCH,
        ssd_dir=tmp_path / "ssd",
        ssd_options=dict(rows_per_file=512, init_from=spec),
    ) as p:
        report = p.fit(progress=False)
        keys, rows = p.export_rows()
        dense = p.dense_state()
    ref = ReferenceTrainer(SOURCE.n_slots, SOURCE.n_dense, cfg)
    ref.store.preload(*read_table(spec.path, spec.dim, cfg.row_width, spec.state_value))
    ref.fit(SOURCE.open(BATCH))
    ref_keys, ref_rows, ref_dense = ref.export()
    assert report["ssd"]["bytes_read"] > 0 and report["ssd"]["bytes_written"] > 0
    assert np.isin(imported, keys).all()  # untouched imported rows are kept, as imported
    np.testing.assert_array_equal(keys, ref_keys)
    np.testing.assert_array_equal(rows, ref_rows)
    for name, value in ref_dense.items():
        np.testing.assert_array_equal(dense[name].numpy(), value.numpy(), err_msg=name)


def test_hpsray_train_init_from_equals_the_reference_from_it(tmp_path):
    """The user's path: ``hpsray train --init-from DIR --export OUT``, then the reference started
    from the same table compares equal (``--reference --compare OUT``); a bad table is refused
    naming its file, before any row is trained."""
    cfg = small_config(hidden=(16,), minibatch_size=250, sparse_optimizer="adagrad", sparse_lr=0.05)
    _export_like(tmp_path / "table", cfg)
    job = tmp_path / "job.toml"
    job.write_text(
        "[data.synthetic]\nrows = 4000\nslots = 4\nkeys = 3000\ndense = 3\nseed = 1\n"
        '[model]\ndim = 4\nhidden = [16]\n[optimizer]\nsparse = "adagrad"\nsparse_lr = 0.05\n'
        "[tiers]\nmem_rows = 3500\n[pipeline]\nbatch_size = 1000\nminibatch_size = 250\n"
    )
    out = tmp_path / "out"
    run = hpsray("train", str(job), "--init-from", str(tmp_path / "table"), "--export", str(out), "--quiet")
    assert run.returncode == 0, run.stderr
    ref = hpsray("train", str(job), "--init-from", str(tmp_path / "table"), "--reference", "--compare", str(out))
    assert ref.returncode == 0, ref.stderr + ref.stdout
    with open(tmp_path / "table" / "part-1.parquet", "r+b") as f:
        f.truncate(100)
    bad = hpsray("train", str(job), "--init-from", str(tmp_path / "table"), "--quiet")
    assert bad.returncode != 0 and "part-1.parquet: not a readable Parquet file" in bad.stderr


def hpsray(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "hpsray", *args], capture_output=True, text=True, timeout=300, env=env)


def test_job_settings_name_init_from(tmp_path):
    """``[tiers] init_from`` resolves against the job file; a missing directory, or a job of
    several nodes, is refused before anything starts, naming the setting."""
    from hpsray.errors import ConfigError
    from hpsray.job import JobConfig, build

    (tmp_path / "table").mkdir()
    body = '[data.synthetic]\nrows = 100\n[model]\ndim = 4\n[optimizer]\nsparse = "adagrad"\n'
    job_file = tmp_path / "job.toml"
    job_file.write_text(body + '[tiers]\ninit_from = "table"\n')
    job = JobConfig.load(str(job_file))
    spec = build.init_from(job)["init_from"]
    assert spec.path == str(tmp_path / "table") and spec.dim == 4
    job_file.write_text(body + '[tiers]\ninit_from = "nowhere"\n')
    with pytest.raises(ConfigError, match=r"tiers\.init_from.*nowhere: no such directory"):
        JobConfig.load(str(job_file))
    job_file.write_text(body + '[tiers]\ninit_from = "table"\n[cluster]\nnodes = 2\n')
    with pytest.raises(ConfigError, match=r"tiers\.init_from.*cluster\.nodes = 1"):
        build.init_from(JobConfig.load(str(job_file)))
