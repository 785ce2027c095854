"""The demo's job: a synthetic click log from a planted model and the job file that trains it with a
MEM-PS budget well below its distinct keys (rows travel to SSD-PS and back).

``hpsray demo`` runs it; the plan's stage-cost probe (:mod:`hpsray.job.probe`) and
``hpsray bench plan`` use it as their reference jobs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpsray.job import JobConfig

__all__ = ["BATCHES", "DENSE", "KEYS_PER_SLOT", "SLOTS", "demo_config", "demo_job"]

SLOTS, KEYS_PER_SLOT, DENSE = 8, 100_000, 4
BATCHES = 20  # the demo splits its rows into this many batches


def demo_job(workdir: str, rows: int, quiet: bool = True) -> dict:
    """Write the demo's data to ``workdir/data`` and return its job table (also ``workdir/job.toml``).

    The MEM-PS budget is 2.5 × the distinct keys of one batch: enough for the two batches in
    flight, well below the distinct keys of the whole run.
    """
    import numpy as np

    from hpsray.data import PlantedCTR, write_synthetic
    from hpsray.data.generate import to_toml

    batch = max(1, rows // BATCHES)
    eval_rows = batch
    rows = batch * BATCHES
    gen = PlantedCTR(n_slots=SLOTS, keys_per_slot=KEYS_PER_SLOT, n_dense=DENSE, seed=0)
    data = os.path.join(workdir, "data")
    if os.path.isdir(data):
        shutil.rmtree(data)

    def progress(done: int, total: int, path: str) -> None:
        if not quiet and done == total:
            print(f"demo: wrote {total:,} rows of synthetic click log to {data}", file=sys.stderr)

    files = write_synthetic(data, gen, rows + eval_rows, "parquet", shard_rows=batch, progress=progress)
    per_batch = int(np.unique(gen.generate(batch).keys).size)
    job: dict[str, dict[str, Any]] = {
        "data": {
            "paths": [os.path.relpath(f, workdir) for f in files[:-1]],
            "eval_paths": [os.path.relpath(files[-1], workdir)],
        },
        "model": {"dim": 8, "hidden": [64, 32], "seed": 0},
        "optimizer": {"sparse": "adagrad", "sparse_lr": 0.05, "dense": "adam", "dense_lr": 0.001},
        "tiers": {"mem_rows": int(2.5 * per_batch)},  # SSD-PS in a temporary directory
        "tiers.ssd": {"rows_per_file": 2048},
        "pipeline": {"batch_size": batch, "minibatch_size": min(1000, batch), "read_queue": 2},
    }
    with open(os.path.join(workdir, "job.toml"), "w") as f:
        f.write("# written by `hpsray demo`; rerun with: hpsray train job.toml\n\n" + to_toml(job))
    return job


def demo_config(workdir: str, rows: int) -> JobConfig:
    """:func:`demo_job` in ``workdir``, loaded, with its SSD-PS in ``workdir/ssd``."""
    from hpsray.job import JobConfig

    demo_job(workdir, rows)
    job = JobConfig.load(os.path.join(workdir, "job.toml"))
    return dataclasses.replace(job, tiers=dataclasses.replace(job.tiers, ssd_path=os.path.join(workdir, "ssd")))
