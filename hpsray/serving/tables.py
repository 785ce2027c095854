"""What serving needs of an export's tables (its manifest's ``tables``, :meth:`Tables.manifest
<hpsray.tables.Tables.manifest>`): a request's copied slots appended, its keys tagged and its
slots pooled as training did."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hpsray.data.batch import Batch
from hpsray.first_order import expand
from hpsray.tables import POOLINGS, tag_keys

__all__ = ["SlotTables"]


@dataclass(frozen=True)
class SlotTables:
    """Per model slot its table (``slot_table``) and whether it pools by the mean
    (``mean_slots``); ``copy_of``: the data slot each copied slot copies (model slots
    ``n_data_slots ..``; :mod:`hpsray.first_order`)."""

    slot_table: np.ndarray
    mean_slots: np.ndarray
    dims: tuple[int, ...] = ()
    """Each table's dim, when the manifest gives them (an export before tables of their own
    width has none: every table at the export's ``dim``)."""
    copy_of: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    @classmethod
    def from_manifest(cls, entries: Any, n_slots: int, where: str) -> SlotTables | None:
        """The tables of a manifest's ``tables`` entry for ``n_slots`` data slots (``None``
        without one, or for one summed table: keys and pooling as before tables); a malformed
        entry raises ``ValueError`` naming ``where``."""
        if not entries:
            return None
        owner = np.full(n_slots, -1, dtype=np.int64)
        mean = np.zeros(n_slots, dtype=bool)
        dims: list[int] = []
        copies: list[tuple[int, int, bool]] = []  # (data slot, table, mean) per copied slot
        try:
            for t, entry in enumerate(entries):
                if "dim" in entry:
                    dims.append(int(entry["dim"]))
                slots = np.asarray(entry["slots"], dtype=np.int64)
                copy = bool(entry.get("copy", False))
                if (
                    slots.size == 0
                    or slots.min() < 0
                    or slots.max() >= n_slots
                    or (not copy and np.any(owner[slots] >= 0))
                ):
                    raise ValueError(f"table {entry['name']!r}: slots {slots.tolist()} overlap or are out of range")
                if entry["pooling"] not in POOLINGS:
                    raise ValueError(f"table {entry['name']!r}: pooling {entry['pooling']!r} is not one of {POOLINGS}")
                if copy:
                    copies += [(int(s), t, entry["pooling"] == "mean") for s in slots]
                else:
                    owner[slots], mean[slots] = t, entry["pooling"] == "mean"
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: tables: {e}") from None
        if np.any(owner < 0):
            raise ValueError(f"{where}: tables: slots {np.flatnonzero(owner < 0).tolist()} are in no table")
        if len(entries) == 1 and not mean.any():
            return None
        return cls(
            np.concatenate([owner, np.array([t for _, t, _ in copies], dtype=np.int64)]),
            np.concatenate([mean, np.array([m for _, _, m in copies], dtype=bool)]),
            tuple(dims) if len(dims) == len(entries) else (),
            np.array([s for s, _, _ in copies], dtype=np.int64),
        )

    @property
    def n_slots(self) -> int:
        """The model's slots: the data's, then the copied ones."""
        return int(self.slot_table.size)

    @property
    def slot_dims(self) -> tuple[int, ...] | None:
        """Each model slot's dim when the tables' dims differ (the model then takes ``[B, sum of
        them]``), else ``None``."""
        if len(set(self.dims)) < 2:
            return None
        return tuple(self.dims[t] for t in self.slot_table.tolist())

    @property
    def tagged(self) -> bool:
        return int(self.slot_table.max()) > 0

    def tag(self, batch: Batch) -> Batch:
        """``batch`` (of the data's slots) with its copied slots appended and its keys tagged as
        training did."""
        batch = expand(batch, self.copy_of)
        return replace(batch, keys=tag_keys(batch.keys, batch.slots, self.slot_table)) if self.tagged else batch
