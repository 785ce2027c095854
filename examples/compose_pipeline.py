"""Composing a training pipeline in Python instead of a TOML job file.

    python examples/compose_pipeline.py

The pieces: a source (planted synthetic data here; ``FileSource(paths, schema)`` for files), a
custom transform that runs inside the reader actor, the three storage/compute stages with their
budgets, the read-ahead queue capacity, then ``fit``, ``evaluate`` and an export.
"""

from __future__ import annotations

import dataclasses
import tempfile

import numpy as np

from hpsray.config import TrainConfig
from hpsray.data import Batch, PlantedCTR
from hpsray.export import export, load_export
from hpsray.pipelines import (
    MemPSSettings,
    Pipeline,
    SSDPSSettings,
    SyntheticSource,
    TrainerSettings,
)
from hpsray.pipelines.report import format_stage_table


def clip_dense(batch: Batch) -> Batch:
    """A feature-engineering stage: clip dense features to [-3, 3]. Runs in the reader, per batch,
    on whole arrays (never per row); it must return a Batch with the same slots."""
    return dataclasses.replace(batch, dense=np.clip(batch.dense, -3.0, 3.0))


def main() -> None:
    gen = PlantedCTR(n_slots=8, keys_per_slot=20_000, n_dense=4, seed=0)
    train = SyntheticSource(gen, rows=100_000)
    held_out = SyntheticSource(gen, rows=10_000, start_row=100_000)  # the rows after the training rows

    config = TrainConfig(dim=8, hidden=(64, 32), sparse_optimizer="adagrad", sparse_lr=0.05, minibatch_size=1000)
    pipeline = Pipeline(
        train,
        trainer=TrainerSettings(config, n_devices=2),  # two trainer processes (one per GPU on CUDA)
        mem=MemPSSettings(capacity_rows=40_000),  # below the distinct keys: rows go to SSD-PS and back
        ssd=SSDPSSettings(options={"rows_per_file": 4096}),  # a temporary directory
        transforms=[clip_dense],
        batch_size=10_000,
        read_queue=2,  # the reader may run two batches ahead of the pull stage
    )
    with pipeline:
        report = pipeline.fit()
        metrics = pipeline.evaluate(held_out)
        print(f"held-out AUC {metrics['auc']:.4f}, log-loss {metrics['logloss']:.4f}")
        print(format_stage_table(report))
        with tempfile.TemporaryDirectory() as out:
            manifest = export(pipeline, out, config)
            _keys, rows, dense = load_export(out)
            print(f"exported {manifest['rows']:,} rows of width {rows.shape[1]} and {len(dense)} dense tensors")


if __name__ == "__main__":
    main()
