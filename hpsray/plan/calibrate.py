"""A short calibration of each stage on this machine: the real engines on the job's own sampled
batches (the job's batch size), no Ray.

* **read**: the sample's own read (decode, hash, ``distinct_sorted``) per example, plus the copy
  of the batch into the object store;
* **pull** and **load**: :class:`hpsray.tiers.mem.MemPS` at the job's MEM-PS budget over the
  sampled batches in the pipeline's order (``pull(t)``, its misses loaded, ``write_back(t-1)``)
  over a new :class:`hpsray.tiers.ssd.SSDPS` with the job's options on its disk, as a run starts:
  pull is MEM-PS's seconds per distinct row (its dumps taken out), load the store's seconds per
  row loaded and per row dumped, so the dumps' sizes, overwrites and compactions are the job's
  own; one whole warm-up pass first (every kernel met, evictions too, as the actors warm up
  before the clock); each plus the copy of the rows lent. The same run gives the MEM-PS hit
  rate of the sample's later half;
* **train**: the trainer's engine on a batch (:class:`~hpsray.training.engine.TrainerEngine`:
  borrow, the find-once index, the mini-batch steps, the rows back), with the trainer's torch
  threads, after one warm-up batch; its wall seconds at most one thread's CPU seconds.

The engines' OpenMP threads sleep between parallel regions, as in the stage actors
(:func:`~hpsray.env.omp_threads_sleep`, where this module is imported before torch or numba's
parallel loops start). Every stage is timed ``REPEATS`` times (the train step
``TRAIN_REPEATS``) and the fastest kept (a busy machine only slows a timing), in wall seconds
and in CPU seconds of this process (all its threads); a stage's seconds are the lesser of the
two (a busy machine stretches the wall seconds of a stage that computes; the load stage keeps
its wall seconds: it waits for the disk), so the rate predicted is the idle machine's. The
pipeline overlaps the four stages (one actor each), but they share the node's cores: the predicted
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
from hpsray.env import omp_threads_sleep
from hpsray.errors import CapacityError
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

# The engines are timed as the stage actors run them: their OpenMP threads (numba's parallel loops,
# torch's pool) sleep between parallel regions (hpsray.actors). Spinning ones took the cores from
# the threads doing the work: pull and load timed 2-7x slower than with sleeping ones (2 cores).
omp_threads_sleep()

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


class _TimedStore:
    """SSD-PS behind the simulated MEM-PS, its calls timed: the load stage's engine work (the
    pipeline's SSD-PS actor runs these calls; MEM-PS only submits its dumps)."""

    def __init__(self, store: SSDPS) -> None:
        self.store, self.width = store, store.width
        self.load_s = self.load_cpu = self.dump_s = self.dump_cpu = 0.0
        self.loaded = self.dumped = 0

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w0, c0 = time.perf_counter(), time.process_time()
        out = self.store.load(keys)
        self.load_s, self.load_cpu = self.load_s + time.perf_counter() - w0, self.load_cpu + time.process_time() - c0
        self.loaded += keys.size
        return out

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        self.store.dump(keys, rows)
        self.dump_s, self.dump_cpu = self.dump_s + time.perf_counter() - w0, self.dump_cpu + time.process_time() - c0
        self.dumped += keys.size

    def delete(self, keys: np.ndarray) -> int:
        return self.store.delete(keys)


def _time_train(job: JobConfig, sample: Sample, threads: int) -> tuple[float, float, int]:
    """``(wall, cpu)`` seconds per example of the trainer's step on a sampled batch, and the
    dense parameters."""
    # imported here: a plan without calibration (``hpsray train``'s check) needs no torch
    from hpsray.models.kinds import build_model
    from hpsray.models.threads import torch_threads
    from hpsray.training.engine import TrainerEngine

    cfg = job.train_config()
    batches = sample.batches[:2] if len(sample.batches) >= 2 else sample.batches * 2
    keys = [distinct_sorted(b.keys) for b in batches]
    model = build_model(cfg, sample.n_slots, sample.n_dense)
    capacity = 2 * max(q.size for q in keys) + 64
    engine = TrainerEngine(cfg, sample.n_slots, sample.n_dense, capacity, model=model)

    def one(batch: Batch, k: np.ndarray) -> None:
        engine.forget()
        engine.borrow(0, [k], [Loan(initial_rows(k, cfg.row_width, cfg.row_init()))])
        engine.close_batch(engine.train_local(engine.index(batch)))
        engine.rows(k)

    with torch_threads(threads):  # as the trainer actor sets them
        for b, k in zip(batches, keys):  # warm-up: numba loads its kernels (per array type), torch allocates
            one(b, k)
        wall, cpu = _least(lambda: one(batches[-1], keys[-1]), TRAIN_REPEATS)
    if threads > 1:  # on a busy machine threads wait for each other: one thread's CPU seconds
        with torch_threads(1):  # bound the step's wall seconds with them (threads only help)
            wall = min(wall, _least(lambda: one(batches[-1], keys[-1]))[1])
    n = max(len(batches[-1]), 1)
    return wall / n, cpu / n, sum(q.numel() for q in model.parameters())


@dataclass(frozen=True)
class _Tiers:
    """Seconds (wall, CPU) per distinct row pulled, per missing row loaded and per row dumped,
    and MEM-PS's hit rate of the sample's later half (``None``: the budget cannot hold two batches)."""

    pull: tuple[float, float]
    load: tuple[float, float]
    dump: tuple[float, float]
    hit_rate: float | None


def _simulate_tiers(job: JobConfig, sample: Sample, width: int) -> _Tiers:
    """MEM-PS at the job's budget over the sampled batches in the pipeline's order (``pull(t)``,
    the misses loaded, ``write_back(t-1)``) over a new SSD-PS with the job's options on its disk,
    as a run starts: the pull stage's seconds are MEM-PS's (its dumps taken out), the load stage's
    the store's loads and dumps, so the rows dumped, their sizes, overwrites and compactions are
    the job's own. One whole warm-up pass (every kernel met, evictions too), then the least of
    ``REPEATS`` passes, each figure its own least."""
    keys = sample.batch_keys or [distinct_sorted(b.keys) for b in sample.batches]
    capacity = mem_capacity_rows(job, sample.n_slots)
    init = job.train_config().row_init()
    options = dict(job.tiers.ssd)
    rows = sum(k.size for k in keys)
    hit_rate: list[float | None] = [None]

    def run(directory: str) -> tuple[float, float, _TimedStore]:
        store = _TimedStore(SSDPS(directory, width, **options))
        try:
            mem = MemPS(capacity, width, store, init)
            hits = looked = 0
            previous = None
            w0, c0 = time.perf_counter(), time.process_time()
            for t, k in enumerate(keys):
                pulled, missing = mem.pull(t, k)
                if missing.size:  # the load stage's: it fills the loan (rows' values do not matter here)
                    store.load(k[missing])
                if t >= len(keys) // 2:
                    st = mem.batch_stats(t)
                    hits, looked = hits + st["hits"], looked + st["hits"] + st["misses"]
                if previous is not None:
                    mem.write_back(t - 1, *previous)
                    mem.unpin(t - 1)
                previous = (k, pulled)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            hit_rate[0] = hits / looked if looked else None
        finally:
            store.store.close()
        taken = store.load_s + store.dump_s, store.load_cpu + store.dump_cpu
        return max(wall - taken[0], 0.0), max(cpu - taken[1], 0.0), store

    def passes(d: str) -> list[tuple[float, float, _TimedStore]]:
        run(os.path.join(d, "warm-up"))
        return [run(os.path.join(d, str(i))) for i in range(REPEATS)]

    with tempfile.TemporaryDirectory(prefix="hpsray-plan-", dir=_ssd_parent(job)) as d:
        try:
            done = passes(d)
        except CapacityError:  # the plan's own check names the fix; time a budget that fits
            capacity = max(capacity, 2 * max(k.size for k in keys) + 16)
            done = passes(os.path.join(d, "fits"))
            hit_rate[0] = None

    def least(values: list[float], n: int) -> float:
        return min(values) / max(n, 1)

    return _Tiers(
        pull=(least([w for w, _, _ in done], rows), least([c for _, c, _ in done], rows)),
        load=(
            least([s.load_s for _, _, s in done], done[0][2].loaded),
            least([s.load_cpu for _, _, s in done], done[0][2].loaded),
        ),
        dump=(
            least([s.dump_s for _, _, s in done], done[0][2].dumped),
            least([s.dump_cpu for _, _, s in done], done[0][2].dumped),
        ),
        hit_rate=hit_rate[0],
    )


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
    tiers = _simulate_tiers(job, sample, width)
    (pull, pull_cpu), (load, load_cpu), (dump, dump_cpu) = tiers.pull, tiers.load, tiers.dump
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
        memps_hit_rate=tiers.hit_rate,
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
    disk_s_per_row: float = 0.0,
) -> tuple[float, dict]:
    """Predicted examples/s of one node, and the seconds per batch of each stage: ``examples``
    per batch (``batch_bytes`` in the object store) with ``distinct`` rows, of which ``ssd_rows``
    are loaded from (and as many dumped to) SSD-PS. With ``costs``, each stage's seconds in the
    pipeline and the batch's by :func:`~hpsray.plan.pipeline_cost.apply_costs` (a pass of
    ``batches``; 0: endless). ``disk_s_per_row``: the disk's seconds per row loaded, beyond the
    engine's (:func:`hpsray.plan.disk.disk_s_per_row`: a store bigger than the page cache)."""
    row_bytes = 4.0 * distinct * cal.row_width
    copy = cal.copy_s_per_byte
    stages = {
        "read": examples * cal.read_s_per_example + batch_bytes * copy,
        "pull": distinct * cal.pull_s_per_row + row_bytes * copy,
        "load": ssd_rows * (cal.ssd_load_s_per_row + cal.ssd_dump_s_per_row + disk_s_per_row) + row_bytes * copy,
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
