"""The settings a user gives a :class:`~hpsray.pipelines.Pipeline`, one dataclass per part
(MEM-PS, SSD-PS, trainer, synchronisation, checkpoints); each checks its values on creation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hpsray.cluster.faults import DEFAULT_FAULT_TIMEOUT_S
from hpsray.config import CONSISTENCY_MODES, DENSE_SYNC, DEVICES, PROPAGATIONS, TrainConfig, check_admission


@dataclass
class MemPSSettings:
    """Host-memory tier: budget in rows or bytes (exactly one), plus cache options.

    ``admit_after`` and ``expire_after_batches``: feature admission and expiry, off by default
    (docs/architecture.md: Admission and expiry): a key gets a row from the ``admit_after``-th
    batch it is seen in, and rows of keys not seen for ``expire_after_batches`` batches are
    dropped from every tier. The reference trainer takes the same two arguments.

    ``dumps_in_flight``: evicted rows are written to SSD-PS behind MEM-PS's back; at most this
    many such writes are in flight (their rows held in memory beside the budget until done)
    before a pull waits for the oldest (docs/architecture.md: The pipeline).
    """

    capacity_rows: int | None = None
    capacity_bytes: int | None = None
    options: dict = field(default_factory=dict)  # lru_fraction, aging, history
    admit_after: int = 0
    expire_after_batches: int | None = None
    dumps_in_flight: int = 4

    def __post_init__(self) -> None:
        if (self.capacity_rows is None) == (self.capacity_bytes is None):
            raise ValueError("MemPSSettings: give exactly one of capacity_rows and capacity_bytes")
        if self.dumps_in_flight < 1:
            raise ValueError(f"MemPSSettings.dumps_in_flight must be >= 1, got {self.dumps_in_flight}")
        try:
            check_admission(self.admit_after, self.expire_after_batches)
        except ValueError as e:
            raise ValueError(f"MemPSSettings: {e}") from None


@dataclass
class SSDPSSettings:
    """Disk tier: the directory of parameter files (a fresh temporary one when ``None``)."""

    path: str | None = None
    options: dict = field(default_factory=dict)  # rows_per_file, compact_trigger, ...


INDEX_STAGES = ("auto", "read", "train")
INDEX_IN_READ_CPUS = 4
"""``index_stage = "auto"`` makes the batch's layout in the read stage on nodes of at least this
many CPUs (Ray's count): on 2 cores the read stage's sort costs more than the trainer's
probe saves (docs/benchmarks.md: The batch's index in the read stage)."""


@dataclass
class TrainerSettings:
    """What each node's trainer runs: config, model, devices. ``index_stage``: where a batch's
    layout (the trainer's index) is made: ``"read"`` (the reader, off the train stage's time;
    one device per node), ``"train"`` (the trainer), ``"auto"`` (read on nodes of
    :data:`INDEX_IN_READ_CPUS` CPUs or more). ``stage_niceness``: how many steps nicer than the
    trainer the node's read, pull and load actors run, so that the train stage gets the cores
    when every stage wants them (:mod:`hpsray.actors.cpu`; 0, the default: equal shares; the
    measurements so far disagree, docs/benchmarks.md: The trainer's cores). ``stage_idle``: those
    actors' threads under ``SCHED_IDLE`` (a core only when nothing else of the machine wants it;
    for a node the job has to itself: beside any other busy process they all but stop)."""

    config: TrainConfig = field(default_factory=TrainConfig)
    model: torch.nn.Module | None = None
    n_devices: int = 1
    device: str = "cpu"
    threads: int | None = None
    hbm_capacity: int | None = None  # rows; estimated from the batch when None
    index_stage: str = "auto"
    stage_niceness: int = 0
    stage_idle: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"TrainerSettings.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.n_devices < 1:
            raise ValueError(f"TrainerSettings.n_devices must be >= 1, got {self.n_devices}")
        if not 0 <= self.stage_niceness <= 19:
            raise ValueError(f"TrainerSettings.stage_niceness must be in [0, 19], got {self.stage_niceness}")
        if self.index_stage not in INDEX_STAGES:
            raise ValueError(f"TrainerSettings.index_stage must be one of {INDEX_STAGES}, got {self.index_stage!r}")

    def bound(self, n_slots: int) -> TrainerSettings:
        """These settings for a source of ``n_slots`` slots: a model of first-order rows gets
        their table (:func:`hpsray.tables.with_first_order`), so every stage holds it."""
        from dataclasses import replace

        from hpsray.tables import with_first_order

        return replace(self, config=with_first_order(self.config, n_slots))

    def index_in_read(self, node_cpus: float) -> bool:
        """Whether a node of ``node_cpus`` CPUs makes its batches' layouts in the read stage."""
        if self.n_devices > 1 or self.index_stage == "train":
            return False
        return self.index_stage == "read" or node_cpus >= INDEX_IN_READ_CPUS


@dataclass
class SyncSettings:
    """How the trainers of several nodes stay consistent and combine dense gradients
    (docs/architecture.md: Consistency; docs/operations.md: Consistency modes).

    ``consistency``: ``"bsp"`` (lossless: every mini-batch synchronised), ``"ssp"`` (a trainer
    runs at most ``staleness`` mini-batches ahead of the slowest), ``"absp"`` (A-BSP: BSP whose
    clock is ``work_per_clock`` mini-batches: a trainer applies its own updates at once and
    everyone's at each clock's end, a barrier), ``"asp"`` (no waiting).
    ``dense_staleness``: the dense parameters' own slack under the relaxed modes (Lapser's
    per-item slack); ``None``: they travel with the embeddings' updates. ``0`` makes the dense
    weights identical on every node at every mini-batch (BSP for dense, SSP for embeddings).
    ``propagation`` (relaxed modes): ``"push"`` (every update sent to the other trainers at
    once), ``"pull"`` (fetched from its producer only when a trainer's copy is too old for the
    slack) or ``"relay"`` (through one clock-board actor; the baseline).
    ``dense``: ``"allreduce"`` (the collective group) or ``"chunked"`` (PHub-style: fixed
    ``chunk_bytes`` chunks, each owned by one aggregation worker of one node, streamed between
    the trainers and summed as they arrive; docs/architecture.md: Chunked aggregation).

    ``straggler_delay_s``: an experiment option, ``0`` (off) by default: the trainer of
    ``straggler_node`` sleeps before each mini-batch, with probability ``straggler_probability``,
    ``straggler_delay_s * U(0, 2)`` seconds drawn from a generator seeded by
    (``straggler_seed``, node, mini-batch), so every mode meets the same delays (``hpsray bench
    consistency``).

    ``before_minibatch``: an injection point for tests and experiments, ``None`` in production:
    under the relaxed modes every trainer calls ``before_minibatch(node, clock)`` before computing
    each mini-batch (e.g. a straggler that sleeps on one node). It travels to the trainers'
    processes, so it must pickle (a closure or lambda does).

    ``fault_timeout_s``: how long any wait on another process (the driver's on the stages, a
    collective, the chunked aggregation's sockets) may last before it fails with
    :class:`~hpsray.errors.FaultTimeout` naming who is missing (docs/operations.md: Network
    faults); above the slowest batch and Ray's detection of a silent node.
    """

    consistency: str = "bsp"
    staleness: int = 2
    dense: str = "allreduce"
    chunk_bytes: int = 32768
    before_minibatch: Callable[[int, int], None] | None = None
    work_per_clock: int = 4
    dense_staleness: int | None = None
    propagation: str = "push"
    straggler_delay_s: float = 0.0
    straggler_node: int = 1
    straggler_probability: float = 1.0
    straggler_seed: int = 0
    fault_timeout_s: float = DEFAULT_FAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.consistency not in CONSISTENCY_MODES:
            raise ValueError(f"SyncSettings.consistency must be one of {CONSISTENCY_MODES}, got {self.consistency!r}")
        if self.dense not in DENSE_SYNC:
            raise ValueError(f"SyncSettings.dense must be one of {DENSE_SYNC}, got {self.dense!r}")
        if self.propagation not in PROPAGATIONS:
            raise ValueError(f"SyncSettings.propagation must be one of {PROPAGATIONS}, got {self.propagation!r}")
        if self.staleness < 0:
            raise ValueError(f"SyncSettings.staleness must be >= 0, got {self.staleness}")
        if self.dense_staleness is not None and self.dense_staleness < 0:
            raise ValueError(f"SyncSettings.dense_staleness must be >= 0 or None, got {self.dense_staleness}")
        if self.work_per_clock < 1:
            raise ValueError(f"SyncSettings.work_per_clock must be >= 1, got {self.work_per_clock}")
        if self.chunk_bytes < 4:
            raise ValueError(f"SyncSettings.chunk_bytes must be >= 4, got {self.chunk_bytes}")
        if self.straggler_delay_s < 0 or not 0 <= self.straggler_probability <= 1:
            raise ValueError("SyncSettings: straggler_delay_s must be >= 0 and straggler_probability in [0, 1]")
        if not self.fault_timeout_s > 0:
            raise ValueError(f"SyncSettings.fault_timeout_s must be > 0, got {self.fault_timeout_s}")

    @property
    def slack(self) -> int | None:
        """The embeddings' staleness bound in mini-batches (``None``: unbounded, ASP)."""
        return {"bsp": 0, "ssp": self.staleness, "absp": self.work_per_clock - 1}.get(self.consistency)


@dataclass
class CheckpointSettings:
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
            raise ValueError(f"CheckpointSettings.every_batches must be >= 1, got {self.every_batches}")
        if self.keep < 1:
            raise ValueError(f"CheckpointSettings.keep must be >= 1, got {self.keep}")
        if self.max_failures < 0:
            raise ValueError(f"CheckpointSettings.max_failures must be >= 0, got {self.max_failures}")
