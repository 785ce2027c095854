"""A short calibration of each stage on this machine: the real engines on the sample, no Ray.

* **read**: the sample's own read (decode, hash, ``distinct_sorted``) per example;
* **pull**: :meth:`hpsray.tiers.mem.MemPS.pull` + ``write_back`` + ``unpin`` of a sampled batch's
  keys over a backing store that holds nothing (every first pull initialises its rows);
* **load**: :class:`hpsray.tiers.ssd.SSDPS` ``dump`` and ``load`` of those rows in a temporary
  directory, per row;
* **train**: the trainer's local step (hpsray/actors/trainer.py, ``_train_local``): HBM-PS insert,
  then per mini-batch the :class:`~hpsray.models.step.DenseReplicas` step and the sparse update in
  the HBM-PS tables, timed on a sampled batch after one warm-up batch.

The predicted rate of the pipeline is ``examples per batch / max(slowest stage, sum of stages /
cores)``: the four stages overlap (one actor each), but on a machine with fewer cores than stages
they share them.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from hpsray.kernels.distinct import distinct_sorted
from hpsray.kernels.init import initial_rows
from hpsray.models.device import StepDevice
from hpsray.models.dnn import DNN
from hpsray.models.step import DenseReplicas
from hpsray.plan.sample import Sample
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.mem import MemPS
from hpsray.tiers.ssd import SSDPS

__all__ = ["Calibration", "calibrate", "predict_rate"]


@dataclass(frozen=True)
class Calibration:
    """Seconds per unit measured here: per example (read, train), per distinct row (pull), per
    row moved to or from SSD-PS (load/dump); ``dense_params``: the DNN's parameters."""

    read_s_per_example: float
    train_s_per_example: float
    pull_s_per_row: float
    ssd_load_s_per_row: float
    ssd_dump_s_per_row: float
    dense_params: int
    cores: int
    seconds: float  # how long calibrating took


class _Nothing:
    """A backing store with no rows: MEM-PS initialises every miss."""

    def __init__(self, width: int) -> None:
        self.width = width

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((keys.size, self.width), np.float32), np.zeros(keys.size, bool)

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None:
        pass


def _time_train(job, sample: Sample) -> tuple[float, int]:
    cfg, p = job.train_config(), job.pipeline
    batches = sample.batches[:2] if len(sample.batches) >= 2 else sample.batches * 2
    keys = [distinct_sorted(b.keys) for b in batches]
    hbm = HbmPS(2 * max(k.size for k in keys) + 64, cfg.row_width, cfg.row_init(), p.n_devices)
    model = DNN(sample.n_slots, cfg.dim, sample.n_dense, cfg.hidden, seed=cfg.seed)
    dense = DenseReplicas(model, p.n_devices, cfg.dense_optimizer, cfg.dense_lr, StepDevice("cpu"))
    optimizer = cfg.optimizer()
    step = 0
    seconds = 0.0
    for i, (batch, k) in enumerate(zip(batches, keys)):
        t0 = time.perf_counter()
        hbm.insert(k, initial_rows(k, cfg.row_width, cfg.row_init()))
        hbm.retain(k)
        dense.train(True)
        losses = []
        for mb in batch.minibatches(cfg.minibatch_size):
            loss, gkeys, grads = dense.step(mb, lambda u: hbm.get(u, columns=cfg.dim))
            step += 1
            hbm.apply_gradients(gkeys, grads, optimizer, step)
            losses.append(loss)
        float(torch.stack(losses).sum())
        hbm.get(k)
        if i == len(batches) - 1:  # the first one warms up (numba compiles, torch allocates)
            seconds = time.perf_counter() - t0
    return seconds / max(len(batches[-1]), 1), sum(q.numel() for q in model.parameters())


def _time_tiers(job, sample: Sample) -> tuple[float, float, float]:
    width = job.train_config().row_width
    keys = [distinct_sorted(b.keys) for b in sample.batches[:2]] or sample.batch_keys[:2]
    n = int(sum(k.size for k in keys))
    mem = MemPS(n + 16, width, _Nothing(width), job.train_config().row_init())
    t0 = time.perf_counter()
    for t, k in enumerate(keys):
        rows = mem.pull(t, k)
        mem.write_back(t, k, rows)
        mem.unpin(t)
    pull = (time.perf_counter() - t0) / max(n, 1)
    k = keys[-1]
    rows = initial_rows(k, width, job.train_config().row_init())
    options = {key: v for key, v in dict(job.tiers.ssd).items() if key in ("rows_per_file", "block_rows")}
    with tempfile.TemporaryDirectory(prefix="hpsray-plan-", dir=_ssd_parent(job)) as d:
        store = SSDPS(d, width, background=False, **options)
        try:
            t0 = time.perf_counter()
            store.dump(k, rows)
            dump = (time.perf_counter() - t0) / max(k.size, 1)
            t0 = time.perf_counter()
            store.load(k[::2])
            load = (time.perf_counter() - t0) / max(k[::2].size, 1)
        finally:
            store.close()
    return pull, load, dump


def _ssd_parent(job) -> str | None:
    """The existing directory nearest the job's SSD-PS path (so the disk timed is the one used)."""
    path = job.tiers.ssd_path
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        path = parent if parent != path else None
    return path


def calibrate(job, sample: Sample) -> Calibration:
    """Time each stage's engine on ``sample`` (a few seconds)."""
    t0 = time.perf_counter()
    train, params = _time_train(job, sample)
    pull, load, dump = _time_tiers(job, sample)
    return Calibration(
        read_s_per_example=sample.read_s / max(sample.examples, 1),
        train_s_per_example=train,
        pull_s_per_row=pull,
        ssd_load_s_per_row=load,
        ssd_dump_s_per_row=dump,
        dense_params=params,
        cores=os.cpu_count() or 1,
        seconds=time.perf_counter() - t0,
    )


def predict_rate(cal: Calibration, examples: float, distinct: float, ssd_rows: float) -> tuple[float, dict]:
    """Predicted examples/s of one node, and the seconds per batch of each stage: ``examples`` per
    batch with ``distinct`` rows, of which ``ssd_rows`` are loaded from (and as many dumped to) SSD-PS."""
    stages = {
        "read": examples * cal.read_s_per_example,
        "pull": distinct * cal.pull_s_per_row,
        "load": ssd_rows * (cal.ssd_load_s_per_row + cal.ssd_dump_s_per_row),
        "train": examples * cal.train_s_per_example,
    }
    per_batch = max(max(stages.values()), sum(stages.values()) / max(cal.cores, 1))
    return (examples / per_batch if per_batch > 0 else 0.0), stages
