"""Stage descriptions a user composes into a :class:`~hpsray.pipelines.Pipeline`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hpsray.config import CONSISTENCY_MODES, DENSE_SYNC, DEVICES, TrainConfig
from hpsray.tiers.admission import check_admission


@dataclass
class MemPSStage:
    """Host-memory tier: budget in rows or bytes (exactly one), plus cache options.

    ``admit_after`` and ``expire_after_batches``: feature admission and expiry, off by default
    (docs/architecture.md: Admission and expiry): a key gets a row from the ``admit_after``-th
    batch it is seen in, and rows of keys not seen for ``expire_after_batches`` batches are
    dropped from every tier. The reference trainer takes the same two arguments.
    """

    capacity_rows: int | None = None
    capacity_bytes: int | None = None
    options: dict = field(default_factory=dict)  # lru_fraction, aging, history
    admit_after: int = 0
    expire_after_batches: int | None = None

    def __post_init__(self) -> None:
        if (self.capacity_rows is None) == (self.capacity_bytes is None):
            raise ValueError("MemPSStage: give exactly one of capacity_rows and capacity_bytes")
        try:
            check_admission(self.admit_after, self.expire_after_batches)
        except ValueError as e:
            raise ValueError(f"MemPSStage: {e}") from None


@dataclass
class SSDPSStage:
    """Disk tier: the directory of parameter files (a fresh temporary one when ``None``)."""

    path: str | None = None
    options: dict = field(default_factory=dict)  # rows_per_file, compact_trigger, ...


@dataclass
class TrainerStage:
    """What each node's trainer runs: config, model, devices."""

    config: TrainConfig = field(default_factory=TrainConfig)
    model: torch.nn.Module | None = None
    n_devices: int = 1
    device: str = "cpu"
    threads: int | None = None
    hbm_capacity: int | None = None  # rows; estimated from the batch when None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"TrainerStage.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.n_devices < 1:
            raise ValueError(f"TrainerStage.n_devices must be >= 1, got {self.n_devices}")


@dataclass
class SyncStage:
    """How the trainers of several nodes stay consistent and combine dense gradients
    (docs/architecture.md: Consistency).

    ``consistency``: ``"bsp"`` (lossless: every mini-batch synchronised), ``"ssp"`` (a trainer
    runs at most ``staleness`` mini-batches ahead of the slowest), ``"asp"`` (no waiting).
    ``dense``: ``"allreduce"`` (the collective group) or ``"chunked"`` (PHub-style: fixed
    ``chunk_bytes`` chunks, each owned by one aggregation worker of one node, streamed between
    the trainers and summed as they arrive; docs/architecture.md: Chunked aggregation).

    ``before_minibatch``: an injection point for tests and experiments, ``None`` in production:
    under ``ssp``/``asp`` every trainer calls ``before_minibatch(node, clock)`` before computing
    each mini-batch (e.g. a straggler that sleeps on one node). It travels to the trainers'
    processes, so it must pickle (a closure or lambda does).
    """

    consistency: str = "bsp"
    staleness: int = 2
    dense: str = "allreduce"
    chunk_bytes: int = 32768
    before_minibatch: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCY_MODES:
            raise ValueError(f"SyncStage.consistency must be one of {CONSISTENCY_MODES}, got {self.consistency!r}")
        if self.dense not in DENSE_SYNC:
            raise ValueError(f"SyncStage.dense must be one of {DENSE_SYNC}, got {self.dense!r}")
        if self.staleness < 0:
            raise ValueError(f"SyncStage.staleness must be >= 0, got {self.staleness}")
        if self.chunk_bytes < 4:
            raise ValueError(f"SyncStage.chunk_bytes must be >= 4, got {self.chunk_bytes}")


@dataclass
class CheckpointStage:
    """Checkpoints and recovery (docs/operations.md: Checkpoints, recovery and resume).

    Every ``every_batches`` batches (and at the start of each pass) the pipeline writes a
    checkpoint to ``directory``, keeping the ``keep`` newest. When a stage actor dies during
    ``fit()`` the pipeline restarts the stages from the newest checkpoint and replays the
    batches since, up to ``max_failures`` times per ``fit()``. ``resume``: the first ``fit()``
    continues from the newest checkpoint in ``directory`` (a job whose driver died).
    """

    directory: str
    every_batches: int = 50
    keep: int = 2
    max_failures: int = 3
    resume: bool = False

    def __post_init__(self) -> None:
        if self.every_batches < 1:
            raise ValueError(f"CheckpointStage.every_batches must be >= 1, got {self.every_batches}")
        if self.keep < 1:
            raise ValueError(f"CheckpointStage.keep must be >= 1, got {self.keep}")
        if self.max_failures < 0:
            raise ValueError(f"CheckpointStage.max_failures must be >= 0, got {self.max_failures}")
