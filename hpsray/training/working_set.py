"""The trainer's working set across batches (docs/architecture.md: The trainer's working set).

An owner does not ship the rows a borrower held in the batch before (``Loan.held``): the
trainer keeps them resident. The trainer also keeps, at a batch's end, the rows the next batch
needs instead of returning them (:func:`keep_masks`): they go back to their owner when they
leave the working set, at a flush and at the pass's end. With several nodes an owner names the
rows it needs back all the same (another node borrows them next batch without holding them, and
reads its owner's copy); under SSP and ASP every row goes back at every batch end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from hpsray.kernels.distinct import in_sorted
from hpsray.tiers.loans import Loan

__all__ = ["Traffic", "keep_masks", "working_set_report"]


def keep_masks(
    key_parts: list[npt.NDArray[np.uint64]],
    next_keys: list[npt.NDArray[np.uint64]],
    needed: list[npt.NDArray[np.uint64]] | None = None,
) -> list[npt.NDArray[np.bool_]]:
    """Per owner, which of this batch's keys (``key_parts[o]``, sorted) the trainer keeps: those
    the next batch needs too (``next_keys[o]``, sorted) and their owner does not need back
    (``needed[o]``: a subset of the owner's sorted lease, so sorted)."""
    keep = [in_sorted(k, nk) for k, nk in zip(key_parts, next_keys, strict=True)]
    if needed is not None:
        keep = [m & ~in_sorted(k, back) for m, k, back in zip(keep, key_parts, needed, strict=True)]
    return keep


@dataclass
class Traffic:
    """Rows between the owners and this node's trainer, per batch: shipped to it, held already
    (not shipped), and returned (at the batch's end, or by a flush)."""

    row_bytes: int
    per_batch: dict[Any, list[int]] = field(default_factory=dict)  # batch -> [shipped, held, returned]
    flushed: int = 0

    def received(self, batch_id: Any, loans: list[Loan]) -> None:
        self.per_batch[batch_id] = [sum(loan.shipped for loan in loans), sum(loan.kept for loan in loans), 0]

    def returned(self, batch_id: Any, rows: int) -> None:
        self.per_batch.setdefault(batch_id, [0, 0, 0])[2] += rows

    def snapshot(self) -> dict:
        per_batch = {b: list(v) for b, v in self.per_batch.items()}
        return {"per_batch": per_batch, "flushed": self.flushed, "row_bytes": self.row_bytes}


def working_set_report(snapshots: list[dict], batches: set) -> dict:
    """The run report's ``working_set``: rows and bytes moved per batch in each direction over
    every node (``to_trainer``: shipped by the owners; ``to_owner``: returned by the trainers)
    and the trainers' hit rate (keys of a batch they held already)."""
    per_batch: dict[Any, list[int]] = {}
    row_bytes = snapshots[0]["row_bytes"] if snapshots else 0
    for snap in snapshots:
        for b, counts in snap["per_batch"].items():
            if b in batches:
                total = per_batch.setdefault(b, [0, 0, 0])
                for i, c in enumerate(counts):
                    total[i] += c
    shipped, held, returned = (sum(v[i] for v in per_batch.values()) for i in range(3))
    n = max(len(batches), 1)
    return {
        "per_batch": {
            str(b): dict(zip(("to_trainer", "held", "to_owner"), v, strict=True)) for b, v in sorted(per_batch.items())
        },
        "rows_to_trainer_per_batch": shipped / n,
        "rows_to_owner_per_batch": returned / n,
        "bytes_to_trainer_per_batch": shipped * row_bytes / n,
        "bytes_to_owner_per_batch": returned * row_bytes / n,
        "trainer_hit_rate": held / (held + shipped) if held + shipped else 0.0,
        "rows_flushed": sum(s["flushed"] for s in snapshots),
    }
