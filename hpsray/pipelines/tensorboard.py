"""Scalars for TensorBoard (``[report] tensorboard = "DIR"``), written with torch's
``SummaryWriter`` (the ``tensorboard`` package: ``pip install "hpsray[tensorboard]"``).

Each scalar is logged against the batches trained so far, so curves of a resumed run continue
where the checkpoint left them. The names are fixed (:data:`SCALARS`); ``tensorboard --logdir DIR``
reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hpsray.errors import ConfigError

SCALARS = (
    "train/loss",
    "eval/auc",
    "eval/logloss",
    "throughput/examples_per_s",
    "stages/read_busy_share",
    "stages/pull_busy_share",
    "stages/load_busy_share",
    "stages/train_busy_share",
    "mem_ps/hit_rate",
    "ssd_ps/bytes_read",
    "ssd_ps/bytes_written",
)
"""Every scalar a run may write; a scalar without a value at a step (``None`` or NaN) is skipped."""


class TensorBoardLog:
    """Appends scalars to event files under ``logdir`` (made if missing).

    Raises :class:`~hpsray.errors.ConfigError` naming ``report.tensorboard`` when the
    ``tensorboard`` package is not installed.
    """

    def __init__(self, logdir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError naming tensorboard when it is absent
            raise ConfigError(
                "job", "report.tensorboard", f'needs the tensorboard package: pip install "hpsray[tensorboard]" ({e})'
            ) from None
        self.logdir = logdir
        self._writer: Any = SummaryWriter(log_dir=logdir)

    def add(self, step: int, scalars: Mapping[str, float | None]) -> int:
        """Write each named scalar at ``step`` (batches trained); returns how many were written.
        A name outside :data:`SCALARS` is a ``ValueError`` (a typo would make a lone curve)."""
        written = 0
        for name, value in scalars.items():
            if name not in SCALARS:
                raise ValueError(f"TensorBoardLog: unknown scalar {name!r}; one of {', '.join(SCALARS)}")
            if value is None or math.isnan(value):
                continue
            self._writer.add_scalar(name, float(value), global_step=step)
            written += 1
        return written

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
