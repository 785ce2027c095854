"""The trainer actor's side of the working set (:mod:`hpsray.training.working_set`): the next
batch's keys and the keys owners need back, fetched from the object store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from hpsray.training.working_set import Traffic, keep_masks, working_set_report

if TYPE_CHECKING:
    from ray import ObjectRef

    from hpsray.actors.messages import ReadBatch

__all__ = ["Traffic", "fetch_upcoming", "keep_masks", "working_set_report"]


def fetch_upcoming(
    next_batch: ObjectRef[ReadBatch] | None, must_return: Sequence[ObjectRef[np.ndarray]] = ()
) -> tuple[list[np.ndarray], list[np.ndarray] | None] | None:
    """The next batch's keys per owner and the keys each owner needs back (``None``: none named),
    given a ref to the next batch's ``ReadBatch`` and refs of the owners' keys; ``None`` without
    a next batch, when it is empty or could not be read (its reader's error is the driver's to
    raise)."""
    if next_batch is None:
        return None
    import ray

    try:
        upcoming = ray.get(next_batch)
        if not upcoming.examples:
            return None
        next_keys = ray.get(list(upcoming.keys_by_owner))
        needed = ray.get(list(must_return)) if must_return else None
    except Exception:  # noqa: BLE001 - the schedule raises it; here: keep nothing
        return None
    return next_keys, needed
