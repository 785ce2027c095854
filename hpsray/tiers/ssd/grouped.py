"""SSD-PS for rows of several widths: one :class:`~hpsray.tiers.ssd.store.SSDPS` per row group
(:class:`~hpsray.tiers.rowgroups.RowGroups`), each in its own subdirectory, its parameter files
holding rows at the group's width (no padding to the widest table).

Contract: as :class:`SSDPS`'s, per group; a key's rows live in its group's store (its tag says
which). :meth:`GroupedSSDPS.dump` returns once every group's rows are durable; one that fails
(:class:`~hpsray.errors.SSDFullError`) leaves the groups dumped before it holding the newer rows
(a retry of the whole dump is idempotent: the last duplicate wins) and nothing of the failing
group's recorded. Snapshots hold one subdirectory per group.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
from numpy.typing import ArrayLike

from hpsray.kernels.table import as_keys
from hpsray.tables import export_columns
from hpsray.tiers.rowgroups import GroupedRows, RowGroups, sum_stats
from hpsray.tiers.ssd.bulkload import TableImport
from hpsray.tiers.ssd.compaction import space_ratio
from hpsray.tiers.ssd.store import SSDPS

__all__ = ["GroupedSSDPS", "group_directory"]


def group_directory(directory: str | os.PathLike, g: int, width: int) -> str:
    """Where group ``g``'s store (rows of ``width`` floats) lives under ``directory``."""
    return os.path.join(os.fspath(directory), f"group-{g}-width-{width}")


class GroupedSSDPS:
    """A directory of one :class:`SSDPS` per row group of ``groups``; ``options`` go to each."""

    def __init__(self, directory: str | os.PathLike, groups: RowGroups, **options: object) -> None:
        self.directory = os.fspath(directory)
        self.groups = groups
        os.makedirs(self.directory, exist_ok=True)
        self.stores: list[SSDPS] = []
        try:
            for g, width in enumerate(groups.widths):
                self.stores.append(SSDPS(group_directory(self.directory, g, width), width, **options))  # type: ignore[arg-type]
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return sum(len(s) for s in self.stores)

    def contains(self, keys: ArrayLike) -> np.ndarray:
        """Whether each key has a stored row (in its group's store)."""
        keys = as_keys(keys)
        out = np.zeros(keys.size, dtype=bool)
        for store, at in zip(self.stores, self.groups.split(keys), strict=True):
            if at.size:
                out[at] = store.contains(keys[at])
        return out

    def load(self, keys: ArrayLike) -> tuple[GroupedRows, np.ndarray]:
        """Rows of ``keys`` per group and a mask of which keys were found (rows of absent keys
        are zero), as :meth:`SSDPS.load` per group; each group's rows at its width."""
        keys = as_keys(keys)
        found = np.zeros(keys.size, dtype=bool)
        split = self.groups.split(keys)
        rows = []
        for g, (store, at) in enumerate(zip(self.stores, split, strict=True)):
            if at.size:
                r, f = store.load(keys[at])
                rows.append(np.array(r, copy=True))  # the store reuses its output buffer
                found[at] = f
            else:
                rows.append(np.zeros((0, self.groups.widths[g]), np.float32))
        return GroupedRows(split, rows), found

    def dump(self, keys: ArrayLike, rows: GroupedRows) -> None:
        """Durably store each group's ``rows`` for its keys of ``keys`` (module docstring)."""
        keys = as_keys(keys)
        rows.check(self.groups, keys.size, "GroupedSSDPS.dump")
        for store, at, r in zip(self.stores, rows.at, rows.rows, strict=True):
            if at.size:
                store.dump(keys[at], r)

    def delete(self, keys: ArrayLike) -> int:
        """Durably delete the rows of ``keys``; returns the rows deleted."""
        keys = as_keys(keys)
        return sum(
            store.delete(keys[at]) for store, at in zip(self.stores, self.groups.split(keys), strict=True) if at.size
        )

    def bulk_load(self, spec: TableImport, shard: tuple[int, int] | None = None) -> dict:
        """Load an export of these tables (each row its weights, then zeros to the widest
        table's dim; its state likewise, docs/export.md "Tables") into the empty stores: each
        group's keys and rows at its width (:func:`~hpsray.tiers.ssd.bulkload.bulk_load`). A
        failure leaves the groups before the failing one loaded: the store must be removed before
        another import (the error of a second one says so)."""
        g = self.groups
        columns = export_columns(g.dims, g.widths)
        done = [
            store.bulk_load(replace(spec, dim=g.dims[i], columns=columns, tags=g.tables[i]), shard)
            for i, store in enumerate(self.stores)
        ]
        out = {k: sum(d[k] for d in done) for k in ("rows", "files", "bytes", "seconds")}
        out["source_files"] = max(d["source_files"] for d in done)
        return out

    def needs_compaction(self) -> bool:
        return any(s.needs_compaction() for s in self.stores)

    def compact(self, full: bool = False) -> int:
        """Compact every group's store (:meth:`SSDPS.compact`); returns files rewritten."""
        return sum(s.compact(full) for s in self.stores)

    def relayout(self) -> int:
        """Relay out every group's store (:meth:`SSDPS.relayout`); returns files rewritten."""
        return sum(s.relayout() for s in self.stores)

    def wait_compaction(self, timeout: float | None = None) -> bool:
        return all(s.wait_compaction(timeout) for s in self.stores)

    @property
    def stats(self) -> dict:
        """The groups' numbers summed (space ratio over the sums), and ``groups``: each
        group's own :attr:`SSDPS.stats` with its ``width``."""
        out = sum_stats([dict(s.stats, width=s.width) for s in self.stores])
        out["space_ratio"] = space_ratio(out["disk_bytes"], out["live_bytes"])
        return out

    def live_rows_by_tag(self) -> np.ndarray:
        """``int64[256]``: live rows per key's top byte, over every group."""
        return np.sum([s.live_rows_by_tag() for s in self.stores], axis=0)

    def live_bytes_by_tag(self) -> np.ndarray:
        """``int64[256]``: bytes of the live rows per key's top byte, each row at its group's
        record (key, version, its width's floats)."""
        return np.sum([s.live_rows_by_tag() * s.record for s in self.stores], axis=0)

    def scan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, rows)`` of the live rows, group by group, file by file; rows at their
        group's width."""
        for s in self.stores:
            yield from s.scan()

    def verify(self) -> int:
        return sum(s.verify() for s in self.stores)

    def snapshot(self, dest: str | os.PathLike, *, link: bool = True) -> dict:
        """Each group's :meth:`SSDPS.snapshot` into its subdirectory of ``dest``; the counts summed."""
        out: dict = {}
        for g, s in enumerate(self.stores):
            for k, v in s.snapshot(group_directory(dest, g, s.width), link=link).items():
                out[k] = out.get(k, 0) + v
        return out

    @staticmethod
    def restore(
        snapshot_dir: str | os.PathLike, directory: str | os.PathLike, groups: RowGroups, **options: bool
    ) -> dict:
        """Build a grouped store directory from a :meth:`snapshot` (each group's
        :meth:`SSDPS.restore`); the counts summed."""
        out: dict = {}
        for g, width in enumerate(groups.widths):
            src, dst = group_directory(snapshot_dir, g, width), group_directory(directory, g, width)
            for k, v in SSDPS.restore(src, dst, **options).items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        """Close every group's store. Idempotent."""
        for s in self.stores:
            s.close()

    def __enter__(self) -> GroupedSSDPS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GroupedSSDPS({self.directory!r}, widths={self.groups.widths}, rows={len(self)})"
