"""The feature-admission settings every part accepts (:class:`~hpsray.config.TrainConfig`'s
defaults, a table's own, the pipeline's owners and the reference trainer). A module of its own
below :mod:`hpsray.config` and :mod:`hpsray.tables`, so that neither imports the other for it."""

from __future__ import annotations

import numpy as np

__all__ = ["check_admission"]


def check_admission(admit_after: int, expire_after_batches: int | None) -> None:
    """Raise ``ValueError`` for feature-admission settings that neither the pipeline's
    :class:`~hpsray.tiers.admission.Admission` nor the reference trainer accepts."""
    if isinstance(admit_after, bool) or not isinstance(admit_after, (int, np.integer)) or admit_after < 0:
        raise ValueError(f"admit_after must be an integer >= 0, got {admit_after!r}")
    if expire_after_batches is not None and (
        isinstance(expire_after_batches, bool)
        or not isinstance(expire_after_batches, (int, np.integer))
        or expire_after_batches < 1
    ):
        raise ValueError(f"expire_after_batches must be an integer >= 1 or None, got {expire_after_batches!r}")
