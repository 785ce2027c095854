"""The small pipeline the tests train: its usual shape built in one place, every setting overridable.

``small_config(**changes)`` is :data:`CFG` with the settings a test is about; ``small_pipeline()`` is
``Pipeline`` over 1,000 rows of :data:`GEN` with :data:`CFG`, a MEM-PS
of 10,000 rows (every key fits) and batches of 500; the caller names only what its test is about.
Tests that need another shape (several sources, a killed actor, a cluster fixture's address)
build ``Pipeline`` themselves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.pipelines import MemPSSettings, Pipeline, SSDPSSettings, SyntheticSource, TrainerSettings

GEN = PlantedCTR(n_slots=4, keys_per_slot=3000, n_dense=3, seed=1)
CFG = TrainConfig(dim=4, hidden=(8,), minibatch_size=500)


def small_config(**changes: Any) -> TrainConfig:
    """:data:`CFG` with ``changes`` (the settings a test is about): the tests' one model shape."""
    return dataclasses.replace(CFG, **changes)


CLUSTER_CFG = small_config(hidden=(16, 8), minibatch_size=64, seed=3)
"""The multi-node tests' model: a deeper MLP, mini-batches of 64."""


def small_pipeline(
    source: Any = None,
    cfg: TrainConfig = CFG,
    *,
    mem_rows: int = 10_000,
    batch_size: int = 500,
    ssd_dir: str | os.PathLike | None = None,
    ssd_options: dict | None = None,
    trainer: dict | None = None,
    mem: dict | None = None,
    **pipeline: Any,
) -> Pipeline:
    """``Pipeline(source, TrainerSettings(cfg, **trainer), MemPSSettings(capacity_rows=mem_rows, **mem),
    SSDPSSettings(ssd_dir, options=ssd_options), batch_size=batch_size, **pipeline)``; ``source``
    defaults to 1,000 rows of :data:`GEN`, ``ssd_dir`` to a temporary directory."""
    return Pipeline(
        SyntheticSource(GEN, rows=1000) if source is None else source,
        TrainerSettings(cfg, **(trainer or {})),
        MemPSSettings(capacity_rows=mem_rows, **(mem or {})),
        SSDPSSettings(None if ssd_dir is None else os.fspath(ssd_dir), options=dict(ssd_options or {})),
        batch_size=batch_size,
        **pipeline,
    )
