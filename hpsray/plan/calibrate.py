"""A short calibration of each stage on this machine: the real engines on the job's own sampled
batches (the job's batch size), no Ray.

* **read**: the sample's own read (decode, hash, ``distinct_sorted``) per example, plus the copy
  of the batch into the object store;
* **pull**: :class:`hpsray.tiers.mem.MemPS` at the job's MEM-PS budget over the sampled batches
  in the pipeline's order (``pull(t)`` before ``write_back(t-1)``), per distinct row, plus the
  copy of the rows it lends; the same run gives the MEM-PS hit rate of the sample's later half;
* **load**: :class:`hpsray.tiers.ssd.SSDPS` ``dump`` and ``load`` of a batch's rows in a
  temporary directory on the job's SSD-PS disk, per row, plus the copy of the loan;
* **train**: the trainer's engine on a batch (:class:`~hpsray.training.engine.TrainerEngine`:
  borrow, the find-once index, the mini-batch steps, the rows back), with the trainer's torch
  threads, after one warm-up batch; its wall seconds at most one thread's CPU seconds.

Every stage is timed ``repeats`` times and the fastest kept (a busy machine only slows a
timing), in wall seconds and in CPU seconds of this process (all its threads); a stage's seconds
are the lesser of the two (a busy machine stretches the wall seconds of a stage that computes;
the load stage keeps its wall seconds: it waits for the disk), so the rate predicted is the idle
machine's. The pipeline
overlaps the four stages (one actor each), but they share the node's cores: the predicted
seconds per batch are ``max(slowest stage, CPU seconds of all stages / cores)``, and the
bottleneck is that stage, or ``"cores"`` when the sum decides (:func:`predict_rate`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hpsray.data.batch import Batch
from hpsray.kernels.distinct import distinct_sorted
from hpsray.kernels.init import initial_rows
from hpsray.plan.pipeline_cost import StageCosts, apply_costs
from hpsray.plan.sample import Sample
from hpsray.plan.sizing import mem_capacity_rows
from hpsray.tiers.loans import Loan
from hpsray.tiers.mem import MemPS
from hpsray.tiers.ssd import SSDPS

if TYPE_CHECKING:
    from hpsray.job import JobConfig

__all__ = ["STAGES", "Calibration", "bottleneck", "calibrate", "node_cores", "predict_rate"]

STAGES = ("read", "pull", "load", "train")
REPEATS = 3
TRAIN_REPEATS = 5  # the train step varies most from one call to the next


@dataclass(frozen=True)
class Calibration:
    """Seconds per unit measured here: per example (read, train), per distinct row (pull), per
    row moved to or from SSD-PS (load/dump), per byte copied into the object store;
    ``cpu_per_wall``: CPU seconds per wall second of each stage (its threads); ``dense_params``:
    the DNN's parameters; ``memps_hit_rate``: MEM-PS hits of the sample's later half at the
    job's budget (``None``: not simulated)."""

    read_s_per_example: float
    train_s_per_example: float
    pull_s_per_row: float
    ssd_load_s_per_row: float
    ssd_dump_s_per_row: float
    dense_params: int
    cores: int
    seconds: float  # how long calibrating took
    copy_s_per_byte: float = 0.0
    cpu_per_wall: dict = field(default_factory=dict)
    memps_hit_rate: float | None = None
    threads: int = 1
    row_width: int = 0


def node_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _least(run: Callable[[], object], repeats: int = REPEATS) -> tuple[float, float]:
    """The least wall and the least CPU seconds of ``repeats`` calls of ``run`` (each its own
    least: on a busy machine either can be the one stretched)."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        run()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu


def _fastest(run: Callable[[], object], repeats: int = REPEATS) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of the fastest of ``repeats`` calls of ``run``."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        run()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if wall < best[0]:
            best = (wall, cpu)
    return best


class _Nothing:
    """A backing store with no rows: MEM-PS initialises every miss (its hits are its own)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((keys.size, self.width), np.float32), np.zeros(keys.size, bool)

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None:
        pass

    def delete(self, keys: np.ndarray) -> int:
        return 0


def _time_train(job: JobConfig, sample: Sample, threads: int) -> tuple[float, float, int]:
    """``(wall, cpu)`` seconds per example of the trainer's step on a sampled batch, and the
    dense parameters."""
    import torch  # here: a plan without calibration (``hpsray train``'s check) needs no torch

    from hpsray.models.dnn import DNN
    from hpsray.training.engine import TrainerEngine

    cfg = job.train_config()
    batches = sample.batches[:2] if len(sample.batches) >= 2 else sample.batches * 2
    keys = [distinct_sorted(b.keys) for b in batches]
    model = DNN(sample.n_slots, cfg.dim, sample.n_dense, cfg.hidden, seed=cfg.seed)
    capacity = 2 * max(q.size for q in keys) + 64
    engine = TrainerEngine(cfg, sample.n_slots, sample.n_dense, capacity, model=model)

    def one(batch: Batch, k: np.ndarray) -> None:
        engine.forget()
        engine.borrow(0, [k], [Loan(initial_rows(k, cfg.row_width, cfg.row_init()))])
        engine.close_batch(engine.train_local(engine.index(batch)))
        engine.rows(k)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # as the trainer actor sets them
    try:
        for b, k in zip(batches, keys):  # warm-up: numba loads its kernels (per array type), torch allocates
            one(b, k)
        wall, cpu = _least(lambda: one(batches[-1], keys[-1]), TRAIN_REPEATS)
        if threads > 1:  # on a busy machine threads wait for each other: one thread's CPU seconds
            torch.set_num_threads(1)  # bound the step's wall seconds with them (threads only help)
            wall = min(wall, _least(lambda: one(batches[-1], keys[-1]))[1])
    finally:
        torch.set_num_threads(before)
    n = max(len(batches[-1]), 1)
    return wall / n, cpu / n, sum(q.numel() for q in model.parameters())


def _simulate_mem(job: JobConfig, sample: Sample, width: int) -> tuple[float, float, float | None]:
    """``(wall, cpu)`` seconds per distinct row of MEM-PS over the sampled batches at the job's
    budget, and the hit rate of the later half of them (``None`` when the budget cannot hold
    two batches: the plan reports that as an error)."""
    keys = sample.batch_keys or [distinct_sorted(b.keys) for b in sample.batches]
    capacity = mem_capacity_rows(job, sample.n_slots)
    init = job.train_config().row_init()
    rows = sum(k.size for k in keys)
    hit_rate: list[float | None] = [None]

    def run(keys: list[np.ndarray] = keys) -> None:
        mem = MemPS(capacity, width, _Nothing(width), init)
        hits = looked = 0
        previous = None
        for t, k in enumerate(keys):
            pulled, _ = mem.pull(t, k)  # as the pipeline's pull: the misses are the load stage's
            if t >= len(keys) // 2:
                s = mem.batch_stats(t)
                hits, looked = hits + s["hits"], looked + s["hits"] + s["misses"]
            if previous is not None:
                mem.write_back(t - 1, *previous)
                mem.unpin(t - 1)
            previous = (k, pulled)
        hit_rate[0] = hits / looked if looked else None

    try:
        run(keys[:3])  # warm-up: numba loads MEM-PS's kernels
        wall, cpu = _fastest(run, repeats=1)
    except Exception:  # noqa: BLE001 - CapacityError: the plan's own check names the fix
        capacity = max(capacity, 2 * max(k.size for k in keys) + 16)
        wall, cpu = _fastest(run, repeats=1)
        hit_rate[0] = None
    return wall / max(rows, 1), cpu / max(rows, 1), hit_rate[0]


def _time_ssd(job: JobConfig, sample: Sample, width: int) -> tuple[float, float, float, float]:
    """``(load wall, load cpu, dump wall, dump cpu)`` seconds per row of SSD-PS."""
    k = (sample.batch_keys or [distinct_sorted(b.keys) for b in sample.batches])[-1]
    rows = initial_rows(k, width, job.train_config().row_init())
    options = {key: v for key, v in dict(job.tiers.ssd).items() if key in ("rows_per_file", "block_rows")}
    half = k[::2]
    with tempfile.TemporaryDirectory(prefix="hpsray-plan-", dir=_ssd_parent(job)) as d:
        dumps, loads = [], []
        for i in range(REPEATS):
            store = SSDPS(os.path.join(d, str(i)), width, background=False, **options)
            try:
                w0, c0 = time.perf_counter(), time.process_time()
                store.dump(k, rows)
                dumps.append((time.perf_counter() - w0, time.process_time() - c0))
                w0, c0 = time.perf_counter(), time.process_time()
                store.load(half)
                loads.append((time.perf_counter() - w0, time.process_time() - c0))
            finally:
                store.close()
    (dw, dc), (lw, lc) = min(dumps), min(loads)
    return lw / max(half.size, 1), lc / max(half.size, 1), dw / max(k.size, 1), dc / max(k.size, 1)


def _copy_s_per_byte(sample: Sample) -> float:
    """Seconds per byte of one copy the size of a sampled batch (an object-store put)."""
    b = sample.batches[0]
    n = max(int(b.keys.nbytes + b.dense.nbytes + b.labels.nbytes), 1 << 16)
    src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
    wall, _ = _fastest(lambda: np.copyto(dst, src))
    return wall / n


def _ssd_parent(job: JobConfig) -> str | None:
    """The existing directory nearest the job's SSD-PS path (so the disk timed is the one used)."""
    path = job.tiers.ssd_path
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        path = parent if parent != path else None
    return path


def calibrate(job: JobConfig, sample: Sample) -> Calibration:
    """Time each stage's engine on ``sample`` (a few seconds)."""
    t0 = time.perf_counter()
    width = job.train_config().row_width
    cores = node_cores()
    threads = job.pipeline.threads or max(1, cores // job.pipeline.n_devices)
    train, train_cpu, params = _time_train(job, sample, threads)
    pull, pull_cpu, hit_rate = _simulate_mem(job, sample, width)
    load, load_cpu, dump, dump_cpu = _time_ssd(job, sample, width)
    read_cpu = sample.read_cpu_s / max(sample.read_examples or sample.examples, 1)
    # a busy machine stretches a timing's wall seconds, not its CPU seconds: a stage's seconds
    # are the lesser of the two (the load stage's wall: it waits for the disk)
    read = min(sample.read_s / max(sample.read_examples or sample.examples, 1), read_cpu) or read_cpu
    train, pull = min(train, train_cpu) or train, min(pull, pull_cpu) or pull
    return Calibration(
        read_s_per_example=read,
        train_s_per_example=train,
        pull_s_per_row=pull,
        ssd_load_s_per_row=load,
        ssd_dump_s_per_row=dump,
        dense_params=params,
        cores=cores,
        seconds=time.perf_counter() - t0,
        copy_s_per_byte=_copy_s_per_byte(sample),
        cpu_per_wall={
            "read": read_cpu / read if read else 1.0,
            "pull": pull_cpu / pull if pull else 1.0,
            "load": (load_cpu + dump_cpu) / (load + dump) if load + dump else 1.0,
            "train": train_cpu / train if train else 1.0,
        },
        memps_hit_rate=hit_rate,
        threads=threads,
        row_width=width,
    )


def predict_rate(
    cal: Calibration,
    examples: float,
    distinct: float,
    ssd_rows: float,
    batch_bytes: float = 0.0,
    costs: StageCosts | None = None,
    batches: int = 0,
) -> tuple[float, dict]:
    """Predicted examples/s of one node, and the seconds per batch of each stage: ``examples``
    per batch (``batch_bytes`` in the object store) with ``distinct`` rows, of which ``ssd_rows``
    are loaded from (and as many dumped to) SSD-PS. With ``costs``, each stage's seconds in the
    pipeline and the batch's by :func:`~hpsray.plan.pipeline_cost.apply_costs` (a pass of
    ``batches``; 0: endless)."""
    row_bytes = 4.0 * distinct * cal.row_width
    copy = cal.copy_s_per_byte
    stages = {
        "read": examples * cal.read_s_per_example + batch_bytes * copy,
        "pull": distinct * cal.pull_s_per_row + row_bytes * copy,
        "load": ssd_rows * (cal.ssd_load_s_per_row + cal.ssd_dump_s_per_row) + row_bytes * copy,
        "train": examples * cal.train_s_per_example + row_bytes * copy,
    }
    if costs is not None:
        per_batch, stages, _ = apply_costs(costs, stages, cal.cores, batches)
    else:
        per_batch = max(max(stages.values()), _cpu(cal, stages) / max(cal.cores, 1))
    return (examples / per_batch if per_batch > 0 else 0.0), stages


def _cpu(cal: Calibration, stages: dict) -> float:
    """CPU seconds per batch of all stages together."""
    return sum(s * cal.cpu_per_wall.get(name, 1.0) for name, s in stages.items())


def bottleneck(cal: Calibration, stages: dict, costs: StageCosts | None = None) -> str:
    """The stage that sets the predicted rate, or ``"cores"`` when the stages' CPU seconds
    together, spread over the cores, exceed the slowest stage (with ``costs``: ``stages`` are
    :func:`predict_rate`'s seconds in the pipeline, summed as they are)."""
    slowest = max(stages, key=lambda k: stages[k])
    busy = sum(stages.values()) if costs is not None else _cpu(cal, stages)
    return "cores" if busy / max(cal.cores, 1) > stages[slowest] else slowest
