"""HBM-PS of several row groups (docs/tables.md, "Tables of their own"): one
:class:`~hpsray.tiers.hbm.HbmPS` per group at the group's width, so the trainer's working set
holds each row at its table's width.

Rows reach and leave the trainer at the loans' width ``W`` (the widest group's,
:mod:`hpsray.tiers.padded`): :meth:`GroupedHbmPS.borrow` splits them by the keys' groups and
:meth:`GroupedHbmPS.get` pads them again. A key's *slot* in the working set is global: its
group's base plus its slot in the group's table (:attr:`GroupedHbmPS.bases`: the tables'
capacities summed in group order), so one index of a batch addresses every group's rows
(:class:`~hpsray.training.grouped_step.GroupedArenaStep`). A group's table grows when its share
of a batch outgrows it (each starts at an equal share of ``capacity``), which moves the bases:
they hold from one :meth:`borrow` to the next.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from hpsray.kernels.arrays import to_host
from hpsray.kernels.init import RowInit
from hpsray.kernels.table import HashTable, as_keys
from hpsray.tiers.hbm import HbmPS
from hpsray.tiers.rowgroups import RowGroups, group_init

__all__ = ["GroupedHbmPS"]


class GroupedHbmPS:
    """The working set of ``groups``' rows, each group's in its own table (module docstring).
    ``width``: the padded width rows are given and taken at; ``capacity``: rows in all."""

    def __init__(
        self, groups: RowGroups, capacity: int, init: RowInit, width: int, n_nodes: int = 1, device: str = "cpu"
    ) -> None:
        if width < max(groups.widths):
            raise ValueError(f"rows of {width} floats hold no row of {groups.describe(int(np.argmax(groups.widths)))}")
        self.groups, self.width, self.device = groups, width, device
        share = max(1, -(-capacity // len(groups)))
        self.parts = [
            HbmPS(share, w, group_init(init, groups, g), 1, n_nodes, device) for g, w in enumerate(groups.widths)
        ]

    @property
    def tables(self) -> list[HashTable]:
        """Each group's table, in group order."""
        return [p.tables[0] for p in self.parts]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def grown(self) -> int:
        return sum(p.grown for p in self.parts)

    @property
    def bases(self) -> list[int]:
        """Group ``g``'s slots are ``[bases[g], bases[g + 1])``: the tables' capacities summed."""
        return np.concatenate([[0], np.cumsum([t.capacity for t in self.tables])]).tolist()

    def _by_group(self, keys: npt.NDArray[np.uint64]) -> list[npt.NDArray[np.uint64]]:
        """``keys`` of each group, in group order."""
        return [keys[at] for at in self.groups.split(keys)]

    def borrow(
        self,
        keys: npt.ArrayLike,
        rows: npt.NDArray[np.float32],
        refreshed: Iterable[tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]] = (),
        held: npt.NDArray[np.bool_] | None = None,
        stale: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        """:meth:`HbmPS.borrow <hpsray.tiers.hbm.HbmPS.borrow>` of each group's keys and the
        first ``widths[g]`` floats of their rows (``rows``: those of the keys not ``held``)."""
        keys = as_keys(keys)
        fresh = [(as_keys(k), np.asarray(r)) for k, r in refreshed]
        fresh_at = [self.groups.split(k) for k, _ in fresh]  # per refresh, each group's positions
        gone = None if stale is None else self._by_group(as_keys(stale))
        shipped = None if held is None else np.cumsum(~held) - 1  # each key's row among rows
        hits = 0
        for g, (part, at) in enumerate(zip(self.parts, self.groups.split(keys), strict=True)):
            w = self.groups.widths[g]
            h = None if held is None else held[at]
            take = at if shipped is None or h is None else shipped[at[~h]]
            mine = [(k[a[g]], r[a[g], :w]) for (k, r), a in zip(fresh, fresh_at, strict=True)]
            stale_g = None if gone is None else gone[g]
            hits += part.borrow(keys[at], np.ascontiguousarray(rows[take, :w]), mine, h, stale_g)
        return hits

    def retain(self, keys: npt.ArrayLike) -> int:
        """Erase every resident key not in ``keys``; returns how many were erased."""
        return sum(p.retain(k) for p, k in zip(self.parts, self._by_group(as_keys(keys)), strict=True))

    def get(self, keys: npt.ArrayLike, columns: int | None = None) -> np.ndarray:
        """Rows of resident ``keys`` at the padded width (or their first ``columns``), on the host."""
        keys = as_keys(to_host(keys))
        out = np.zeros((keys.size, self.width), np.float32)
        for part, at, w in zip(self.parts, self.groups.split(keys), self.groups.widths, strict=True):
            if at.size:
                out[at, :w] = to_host(part.get(keys[at]))
        return out if columns is None else np.ascontiguousarray(out[:, :columns])

    def find(self, keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Each key's global slot (``-1``: not resident), on the host."""
        keys = as_keys(to_host(keys))
        out = np.full(keys.size, -1, np.int64)
        for table, at, base in zip(self.tables, self.groups.split(keys), self.bases, strict=False):
            if at.size:
                slots = np.asarray(to_host(table.find(keys[at])), dtype=np.int64)
                out[at] = np.where(slots >= 0, slots + base, -1)
        return out
