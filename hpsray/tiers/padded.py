"""MEM-PS and SSD-PS of several row widths behind the one-width API the actors, loans and the
trainer use (docs/tables.md, "Tables of their own").

Rows cross between stages at the working set's width ``W`` (the widest row group's: a row of a
narrower group is its row, then zeros). Stored, each group's rows keep their own width: these
wrappers split the rows they are given by the keys' groups (:class:`~hpsray.tiers.rowgroups.RowGroups`)
into :class:`~hpsray.tiers.grouped_mem.GroupedMemPS` / :class:`~hpsray.tiers.ssd.grouped.GroupedSSDPS`
and give rows back padded to ``W``. One verb of the wrapped API each, no logic of their own.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from hpsray.kernels.init import RowInit
from hpsray.kernels.table import as_keys, as_rows
from hpsray.tiers.grouped_mem import GroupedMemPS
from hpsray.tiers.mem import META_BYTES_PER_ROW, BackingStore, rows_for_bytes
from hpsray.tiers.rowgroups import GroupedRows, RowGroups, group_init
from hpsray.tiers.ssd.bulkload import TableImport
from hpsray.tiers.ssd.grouped import GroupedSSDPS

__all__ = ["GroupView", "PaddedMemPS", "PaddedSSDPS", "group_capacities", "pad", "split"]


def split(groups: RowGroups, keys: np.ndarray, rows: np.ndarray) -> GroupedRows:
    """``rows`` (``[n, W]``) of ``keys`` as each group's rows at its width."""
    at = groups.split(keys)
    return GroupedRows(at, [np.ascontiguousarray(rows[a, :w]) for a, w in zip(at, groups.widths, strict=True)])


def pad(grouped: GroupedRows, n: int, width: int) -> np.ndarray:
    """Each group's rows placed at their keys' positions, zeros past their width: ``[n, width]``."""
    out = np.zeros((n, width), np.float32)
    for a, r in zip(grouped.at, grouped.rows, strict=True):
        out[a, : r.shape[1]] = r
    return out


def group_capacities(
    groups: RowGroups,
    need: np.ndarray,
    share: np.ndarray,
    capacity_rows: int | None,
    capacity_bytes: int | None,
    history: Any,
) -> list[int]:
    """MEM-PS rows per group from one budget (``capacity_rows`` rows, or ``capacity_bytes`` with
    each group's rows at its own width): first each group's ``need`` (the rows its in-flight
    batches pin, a quarter more where the budget allows), then the rest split by ``share`` (its
    share of the keys); by ``share`` alone when the budget holds less than the needs."""
    share = np.asarray(share, dtype=np.float64) / max(float(np.sum(share)), 1e-12)
    need = np.asarray(need, dtype=np.float64)
    cost = np.array([4 * w + META_BYTES_PER_ROW for w in groups.widths], dtype=np.float64)
    if capacity_rows is not None:
        budget, unit = float(capacity_rows), np.ones(len(groups))
    else:
        assert capacity_bytes is not None
        budget, unit = float(capacity_bytes), cost
    base = np.zeros(len(groups))
    for margin in (1.25, 1.0):  # batches vary: a quarter more than measured when the budget allows
        if float(np.dot(margin * need, unit)) <= budget:
            base = margin * need
            break
    rest = budget - float(np.dot(base, unit))
    rows = base + rest * share / float(np.dot(share, unit))  # the rest in rows of equal share
    if capacity_rows is not None:
        return [max(1, int(r)) for r in rows.tolist()]
    return [rows_for_bytes(max(int(r * c), 1 << 12), w, history) for r, c, w in zip(rows, cost, groups.widths)]


class GroupView:
    """Group ``g``'s rows (``width`` floats) of a backing store of padded rows (``store``, at
    ``store.width``): what one group's MEM-PS writes to and reads from."""

    def __init__(self, store: Any, width: int) -> None:
        self.store, self.width = store, int(width)

    def load(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows, found = self.store.load(keys)
        return np.ascontiguousarray(rows[:, : self.width]), found

    def dump(self, keys: np.ndarray, rows: np.ndarray) -> None:
        out = np.zeros((rows.shape[0], self.store.width), np.float32)
        out[:, : self.width] = rows
        self.store.dump(keys, out)

    def delete(self, keys: np.ndarray) -> int:
        return int(self.store.delete(keys))

    def in_flight(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows, found, deleted = self.store.in_flight(keys)
        return np.ascontiguousarray(rows[:, : self.width]), found, deleted


class PaddedMemPS:
    """:class:`~hpsray.tiers.mem.MemPS`'s API at ``width`` over one MEM-PS per group of
    ``groups`` (``capacities[g]`` rows each, initialised by ``init``'s table entries), each over
    its :class:`GroupView` of ``ssd`` (a store of padded rows: the SSD-PS actor's)."""

    def __init__(
        self, groups: RowGroups, capacities: list[int], width: int, ssd: BackingStore, init: RowInit, **options: Any
    ) -> None:
        inits = [group_init(init, groups, g) for g in range(len(groups))]
        views = [GroupView(ssd, w) for w in groups.widths]
        self.groups, self.width, self.ssd = groups, int(width), ssd
        self.grouped = GroupedMemPS(groups, capacities, views, inits, **options)

    @property
    def capacity(self) -> int:
        return sum(c.capacity for c in self.grouped.caches)

    @property
    def size(self) -> int:
        return self.grouped.size

    def __len__(self) -> int:
        return self.size

    def pull(
        self, batch_id: Hashable, keys: ArrayLike, held: np.ndarray | None = None, compact: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        keys = as_keys(keys)
        rows, missing = self.grouped.pull(batch_id, keys, held)
        padded = pad(rows, keys.size, self.width)
        return (padded[~held] if compact and held is not None else padded), missing

    def write_back(self, batch_id: Hashable, keys: ArrayLike, rows: ArrayLike) -> None:
        keys = as_keys(keys)
        self.grouped.write_back(batch_id, keys, split(self.groups, keys, as_rows(rows, keys.size, self.width, "rows")))

    def store_kept(self, keys: ArrayLike, rows: ArrayLike) -> np.ndarray:
        keys = as_keys(keys)
        return self.grouped.store_kept(keys, split(self.groups, keys, as_rows(rows, keys.size, self.width, "rows")))

    def unpin(self, batch_id: Hashable) -> None:
        self.grouped.unpin(batch_id)

    def drop(self, keys: ArrayLike) -> int:
        return self.grouped.drop(keys)

    def flush(self) -> int:
        return self.grouped.flush()

    def peek(self, keys: ArrayLike) -> np.ndarray:
        keys = as_keys(keys)
        return pad(self.grouped.peek(keys), keys.size, self.width)

    def contains(self, keys: ArrayLike) -> np.ndarray:
        return self.grouped.contains(keys)

    def has_rows(self, keys: ArrayLike) -> np.ndarray:
        return self.grouped.has_rows(keys)

    def pinned(self, keys: ArrayLike) -> np.ndarray:
        return self.grouped.pinned(keys)

    @property
    def in_flight(self) -> list:
        return self.grouped.in_flight

    def batch_stats(self, batch_id: Hashable) -> dict:
        return self.grouped.batch_stats(batch_id)

    @property
    def stats(self) -> dict:
        return self.grouped.stats

    def close(self, flush: bool = True) -> None:
        self.grouped.close(flush)


class PaddedSSDPS:
    """:class:`~hpsray.tiers.ssd.SSDPS`'s API at ``width`` over a :class:`GroupedSSDPS`."""

    def __init__(self, directory: str | os.PathLike, groups: RowGroups, width: int, **options: Any) -> None:
        self.groups, self.width = groups, int(width)
        self.grouped = GroupedSSDPS(directory, groups, **options)

    def load(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        keys = as_keys(keys)
        rows, found = self.grouped.load(keys)
        return pad(rows, keys.size, self.width), found

    def dump(self, keys: ArrayLike, rows: ArrayLike) -> None:
        keys = as_keys(keys)
        self.grouped.dump(keys, split(self.groups, keys, as_rows(rows, keys.size, self.width, "dump rows")))

    def delete(self, keys: ArrayLike) -> int:
        return self.grouped.delete(keys)

    def contains(self, keys: ArrayLike) -> np.ndarray:
        return self.grouped.contains(keys)

    def bulk_load(self, spec: TableImport, shard: tuple[int, int] | None = None) -> dict:
        return self.grouped.bulk_load(spec, shard)

    def snapshot(self, dest: str | os.PathLike, *, link: bool = True) -> dict:
        return self.grouped.snapshot(dest, link=link)

    def scan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Live rows, group by group, padded to ``width``."""
        for keys, rows in self.grouped.scan():
            out = np.zeros((keys.size, self.width), np.float32)
            out[:, : rows.shape[1]] = rows
            yield keys, out

    @property
    def stats(self) -> dict:
        return self.grouped.stats

    def live_rows_by_tag(self) -> np.ndarray:
        return self.grouped.live_rows_by_tag()

    def live_bytes_by_tag(self) -> np.ndarray:
        return self.grouped.live_bytes_by_tag()

    def compact(self, full: bool = False) -> int:
        return self.grouped.compact(full)

    def wait_compaction(self, timeout: float | None = None) -> bool:
        return self.grouped.wait_compaction(timeout)

    def close(self) -> None:
        self.grouped.close()

    def __len__(self) -> int:
        return len(self.grouped)
