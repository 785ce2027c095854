"""Row groups: the tables of one row layout, stored together in every tier (docs/architecture.md,
"Tables of their own").

A model's tables (:class:`~hpsray.tables.Tables`) are grouped by row layout: ``dim``, sparse
optimizer and its settings. Every row of a group has the group's width (weights, then the
optimizer's state), so a tier holds one single-width store per group and no row is padded to
another table's width. A key's group follows from its tag (:meth:`~hpsray.tables.Tables.tag`):
:meth:`RowGroups.group_of`. One group (one table, or several tables of one layout) is the store
of before tables, whatever the keys' top bytes.

:class:`GroupedRows` carries rows of several groups in one message: per group the rows of its
keys, in the order of the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpsray.errors import ConfigError
from hpsray.kernels.init import RowInit
from hpsray.tables import TAG_SHIFT, Tables, layout_of

__all__ = ["GroupedRows", "RowGroups", "group_init", "sum_stats"]


@dataclass(frozen=True)
class RowGroups:
    """Groups of tables of one row layout. ``widths[g]`` and ``dims[g]``: group ``g``'s floats
    per stored row and embedding width; ``tables[g]``: its tables' indexes (ascending);
    ``table_group[t]``: table ``t``'s group; ``names[g]``: its tables' names, for messages."""

    widths: tuple[int, ...]
    dims: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]
    table_group: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.widths or len(self.widths) != len(self.dims) or len(self.widths) != len(self.tables):
            raise ConfigError("RowGroups", "widths", f"one width, dim and table list per group, got {self}")
        if any(w < 1 for w in self.widths):
            raise ConfigError("RowGroups", "widths", f"must be >= 1, got {self.widths}")

    @classmethod
    def of(cls, tables: Tables) -> RowGroups:
        """``tables`` grouped by layout (dim, optimizer, settings), in order of first table."""
        layouts: dict[tuple, int] = {}
        members: list[list[int]] = []
        for t, spec in enumerate(tables.specs):
            g = layouts.setdefault(layout_of(spec), len(members))
            if g == len(members):
                members.append([])
            members[g].append(t)
        table_group = [0] * len(tables)
        for g, ts in enumerate(members):
            for t in ts:
                table_group[t] = g
        return cls(
            widths=tuple(tables.widths[ts[0]] for ts in members),
            dims=tuple(tables.dims[ts[0]] for ts in members),
            tables=tuple(tuple(ts) for ts in members),
            table_group=tuple(table_group),
            names=tuple(", ".join(repr(tables.specs[t].name) for t in ts) for ts in members),
        )

    @classmethod
    def of_config(cls, config: Any, n_slots: int) -> RowGroups | None:
        """The groups of a :class:`~hpsray.config.TrainConfig`'s tables for ``n_slots`` slots;
        ``None`` for rows of one layout (the single-width stores)."""
        if not config.tables:
            return None
        groups = cls.of(config.tables_for(n_slots))
        return groups if len(groups) > 1 else None

    def slot_groups(self, slot_table: np.ndarray) -> np.ndarray:
        """``int64``: each slot's group, from each slot's table (``slot_table``)."""
        return np.asarray(self.table_group, dtype=np.int64)[np.asarray(slot_table, dtype=np.int64)]

    def __len__(self) -> int:
        return len(self.widths)

    @property
    def tag_group(self) -> np.ndarray:
        """``int64[256]``: the group of a key's top byte (its table's tag); -1 for no table."""
        out = np.full(256, -1, dtype=np.int64)
        out[: len(self.table_group)] = self.table_group
        return out

    def group_of(self, keys: np.ndarray) -> np.ndarray:
        """``int64``: each key's group, read from its tag (zeros with one group: its keys may be
        untagged, their top byte the hash's)."""
        keys = np.asarray(keys, dtype=np.uint64)
        if len(self) == 1:
            return np.zeros(keys.shape, dtype=np.int64)
        group = self.tag_group[(keys >> TAG_SHIFT).astype(np.int64)]
        if group.size and int(group.min()) < 0:
            bad = int(keys[int(np.argmin(group))])
            raise ValueError(f"key {bad:#x}: its tag {bad >> 56} names no table (of {len(self.table_group)})")
        return group

    def split(self, keys: np.ndarray) -> list[np.ndarray]:
        """Per group, the positions of its keys in ``keys`` (ascending)."""
        group = self.group_of(keys)
        if len(self) == 1:
            return [np.arange(group.size, dtype=np.int64)]
        order = np.argsort(group, kind="stable")
        cuts = np.searchsorted(group[order], np.arange(len(self) + 1))
        return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def describe(self, g: int) -> str:
        """Group ``g`` for messages: its tables and width."""
        return f"group {g} (tables {self.names[g]}, {self.widths[g]} floats a row)"


@dataclass
class GroupedRows:
    """Rows of keys of several groups: ``rows[g]`` (``float32[n_g, widths[g]]``) are the rows of
    the keys at positions ``at[g]`` of the keys they go with, in that order."""

    at: list[np.ndarray]
    rows: list[np.ndarray]

    @property
    def n(self) -> int:
        return sum(int(a.size) for a in self.at)

    def check(self, groups: RowGroups, n_keys: int, what: str) -> None:
        """Raise ``ValueError`` (naming ``what`` and the group) unless these are rows of
        ``groups``' widths for ``n_keys`` keys."""
        if len(self.rows) != len(groups) or len(self.at) != len(groups):
            raise ValueError(f"{what}: rows of {len(self.rows)} groups, the store has {len(groups)}")
        for g, (a, r) in enumerate(zip(self.at, self.rows, strict=True)):
            if r.ndim != 2 or r.shape != (a.size, groups.widths[g]):
                raise ValueError(
                    f"{what}: {groups.describe(g)} needs rows of shape ({a.size}, {groups.widths[g]}), "
                    f"got {tuple(r.shape)}"
                )
        if self.n != n_keys:
            raise ValueError(f"{what}: rows for {self.n} keys, {n_keys} keys given")


def group_init(init: RowInit, groups: RowGroups, g: int) -> RowInit:
    """Group ``g``'s initialiser: its first table's entry of ``init.tables`` (the tables of one
    group share a layout, so an initial row)."""
    dim, _, state = init.tables[groups.tables[g][0]]
    return RowInit(dim=dim, scale=init.scale, seed=init.seed, state_value=state)


def sum_stats(per: list[dict]) -> dict:
    """Per-group stats dicts summed: every number the first gives (booleans and ratios aside:
    ``hit_rate``, ``space_ratio`` and ``width`` are the caller's to derive); ``groups`` lists
    the dicts themselves."""
    keep = ("hit_rate", "space_ratio", "width")
    numbers = [k for k, v in per[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out: dict = {k: sum(p[k] for p in per) for k in numbers if k not in keep}
    out["groups"] = per
    return out
