"""Every training path, in one process and without Ray, ready to run a batch: one node
(``local``), BSP over two nodes, SSP / ASP / A-BSP over two nodes and one node of two devices,
each a strategy of :mod:`hpsray.training.strategies` over real engines, with the in-process
collectives of ``inprocess.py``. :func:`path` trains a first batch (the first call allocates)
and returns a function that trains the next one, for the budget and sync checks to run."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from inprocess import ExchangeBoard, ThreadGroup, ThreadMesh, run_ranks  # tests/training/inprocess.py

from hpsray.config import TrainConfig
from hpsray.data import PlantedCTR
from hpsray.data.batch import Batch
from hpsray.kernels.init import initial_rows
from hpsray.tiers.loans import Loan, Refresh
from hpsray.training.devices import DevicePart, DeviceSteps
from hpsray.training.engine import TrainerEngine
from hpsray.training.layout import BatchIndex, index_positions, positions_of
from hpsray.training.relaxed import RelaxedSteps
from hpsray.training.strategies import BspSteps, LocalSteps, Strategy

PATHS = ("local", "bsp", "ssp", "asp", "absp", "devices")
OPTIMIZERS = ("sgd", "adagrad", "adagrad_row", "adam")
N_SLOTS, N_DENSE, ROWS, MINIBATCH = 6, 3, 512, 256


@dataclass(frozen=True)
class Inputs:
    """A batch's inputs, resolved (as ``TrainData``)."""

    batch: Batch | None
    keys: list[np.ndarray]
    loans: list[Loan]
    refreshed: list[Refresh] = field(default_factory=list)
    layout: BatchIndex | None = None


@dataclass(frozen=True)
class Sync:
    """The relaxed modes' settings (as ``SyncSettings``)."""

    consistency: str
    staleness: int = 2
    work_per_clock: int = 2
    dense_staleness: int | None = None
    before_minibatch: None = None


def config(optimizer: str) -> TrainConfig:
    return TrainConfig(dim=16, hidden=(32, 16), minibatch_size=MINIBATCH, sparse_optimizer=optimizer)


def _batches(seed: int) -> list[Batch]:
    gen = PlantedCTR(
        n_slots=N_SLOTS, keys_per_slot=800, n_dense=N_DENSE, seed=seed, nnz_per_slot=PlantedCTR.spread_nnz(N_SLOTS, 26)
    )
    return [gen.generate(ROWS) for _ in range(2)]


def _strategies(name: str, cfg: TrainConfig, device: str) -> list[Strategy]:
    if name == "local":
        return [LocalSteps(TrainerEngine(cfg, N_SLOTS, N_DENSE, 20_000, 1, device))]
    if name == "devices":
        mesh = ThreadMesh(2)
        out: list[Strategy] = []
        for d in range(2):
            m = mesh.member(d)
            out.append(DeviceSteps(TrainerEngine(cfg, N_SLOTS, N_DENSE, 20_000, 1, device), 2, d, m, m.allreduce_sum))
        return out
    group, board = ThreadGroup(2), ExchangeBoard(2)
    engines = [TrainerEngine(cfg, N_SLOTS, N_DENSE, 20_000, 2, device) for _ in range(2)]
    members = [group.member(r) for r in range(2)]
    if name == "bsp":
        return [BspSteps(e, m, m.allreduce_sum) for e, m in zip(engines, members, strict=True)]
    return [
        RelaxedSteps(e, r, 2, Sync(name), board.member(r), members[r], lambda clock: None)
        for r, e in enumerate(engines)
    ]


def path(
    name: str, optimizer: str, device: str = "cpu", layouts: bool = False, returned: list | None = None
) -> tuple[Callable[[], None], list[Strategy]]:
    """``(train the next batch, the strategies)`` of path ``name`` (one per node or device).
    ``layouts``: each batch comes with its layout over key positions, as the read stage makes
    it, staged as the trainer stages it; ``returned``: gets each rank's ``BatchResult`` of each batch, in rank order."""
    cfg = config(optimizer)
    strategies = _strategies(name, cfg, device)
    parts: queue.Queue[DevicePart] = queue.Queue()
    if name == "devices":  # device 0 takes device 1's part of the batch, as from its process
        assert isinstance(strategies[0], DeviceSteps)
        strategies[0].peers = lambda: [parts.get(timeout=120)]
    shares = [_batches(5)] if name in ("local", "devices") else [_batches(5), _batches(6)]
    t = [0]

    def one(rank: int) -> None:
        batch = shares[0 if name == "devices" else rank][t[0]]
        keys = np.unique(batch.keys)
        loan = Loan(initial_rows(keys, cfg.row_width, cfg.row_init()))
        steps = strategies[rank]
        layout = index_positions(batch, MINIBATCH, positions_of(batch.keys, 1)[1], keys.size) if layouts else None
        if layout is not None:  # staged for the upload as the trainer actor stages it (a no-op on the CPU)
            layout = steps.engine.stage(layout)
        got = Inputs(batch, [keys], [loan], layout=layout)
        sizes = [len(s[t[0]]) for s in shares]
        if isinstance(steps, DeviceSteps) and rank > 0:
            parts.put(steps.run_part(t[0], got, sizes, lambda k: None))
        else:
            result = steps.run_batch(t[0], got, sizes, lambda k: None)
            if returned is not None:
                returned.append((t[0], rank, result))

    def go() -> None:
        run_ranks(len(strategies), one)
        t[0] += 1

    go()  # the first batch allocates
    return go, strategies
