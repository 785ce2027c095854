"""Stage descriptions a user composes into a :class:`~hpsray.pipelines.Pipeline`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpsray.config import TrainConfig


@dataclass
class MemPSStage:
    """Host-memory tier: budget in rows or bytes (exactly one), plus cache options."""

    capacity_rows: int | None = None
    capacity_bytes: int | None = None
    options: dict = field(default_factory=dict)  # lru_fraction, aging, history

    def __post_init__(self) -> None:
        if (self.capacity_rows is None) == (self.capacity_bytes is None):
            raise ValueError("MemPSStage: give exactly one of capacity_rows and capacity_bytes")


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
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"TrainerStage.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.n_devices < 1:
            raise ValueError(f"TrainerStage.n_devices must be >= 1, got {self.n_devices}")
