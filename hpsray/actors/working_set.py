"""The trainer's working set across batches (docs/architecture.md: The trainer's working set).

An owner does not ship the rows a borrower held in the batch before (``Loan.held``): the
trainer keeps them resident. The trainer also keeps, at a batch's end, the rows the next batch
needs (``TrainInputs.next_batch``) instead of returning them: they go back to their owner when
they leave the working set, at a :meth:`~hpsray.actors.trainer.Trainer.flush` and at the pass's
end. With several nodes an owner names the rows it needs back all the same
(``TrainInputs.must_return``: another node borrows them next batch without holding them, and
reads its owner's copy); under SSP and ASP every row goes back at every batch end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpsray.kernels.distinct import in_sorted
from hpsray.tiers.lending import Loan


def loaned_rows(loans: list[Loan], key_parts: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(rows, held)`` of the owners' loans put together in owner order: ``rows`` of the keys
    shipped, ``held`` per key of all the owners' keys (``None``: none held)."""
    rows = loans[0].rows if len(loans) == 1 else np.concatenate([loan.rows for loan in loans]) if loans else None
    if rows is None:
        rows = np.empty((0, width), np.float32)
    if all(loan.held is None for loan in loans):
        return rows, None
    held = [np.zeros(k.size, bool) if ln.held is None else ln.held for ln, k in zip(loans, key_parts, strict=True)]
    return rows, np.concatenate(held)


def kept_masks(next_batch: Any, key_parts: list[np.ndarray], must_return: list[Any] = ()) -> list[np.ndarray] | None:
    """Per owner, which of this batch's keys the trainer keeps: those the next batch needs too
    (``next_batch``: its ReadBatch or a ref to it) and its owner does not need back
    (``must_return``: refs of each owner's keys, with several nodes). ``None`` (return every
    row) without a next batch, when it is empty or could not be read (its reader's error is
    the driver's to raise)."""
    if next_batch is None:
        return None
    import ray

    try:
        upcoming = ray.get(next_batch) if isinstance(next_batch, ray.ObjectRef) else next_batch
        if not upcoming.examples:
            return None
        next_keys = ray.get(list(upcoming.keys_by_owner))
        needed = ray.get(list(must_return)) if must_return else None
    except Exception:  # noqa: BLE001 - the schedule raises it; here: keep nothing
        return None
    keep = [in_sorted(k, nk) for k, nk in zip(key_parts, next_keys, strict=True)]
    if needed is not None:  # each owner's keys needed back are a subset of its sorted lease: sorted
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
