"""MEM-PS for rows of several widths: one :class:`~hpsray.tiers.mem.MemPS` per row group
(:class:`~hpsray.tiers.rowgroups.RowGroups`), each over its group's SSD-PS store, with its own
share of the memory budget; rows are held at their group's width (no padding).

Contract: as :class:`MemPS`'s, per group: a key's row is cached, pinned, evicted and written
back by its group's cache (its tag says which). Calls take the keys of every group and answer
:class:`~hpsray.tiers.rowgroups.GroupedRows`; positions (``missing``) index the keys given.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from hpsray.kernels.init import RowInit
from hpsray.kernels.table import as_keys
from hpsray.tiers.mem import BackingStore, MemPS
from hpsray.tiers.rowgroups import GroupedRows, RowGroups, sum_stats

__all__ = ["GroupedMemPS"]


class GroupedMemPS:
    """One :class:`MemPS` per group of ``groups``: ``capacity_rows[g]`` rows of group ``g`` over
    ``stores[g]`` (of its width), new keys initialised by ``inits[g]``; ``options`` go to each."""

    def __init__(
        self,
        groups: RowGroups,
        capacity_rows: Sequence[int],
        stores: Sequence[BackingStore],
        inits: Sequence[RowInit | None],
        **options: float | None,
    ) -> None:
        if not len(capacity_rows) == len(stores) == len(inits) == len(groups):
            raise ValueError(
                f"one capacity, store and initializer per group ({len(groups)}), "
                f"got {len(capacity_rows)}, {len(stores)}, {len(inits)}"
            )
        self.groups = groups
        self.caches = [
            MemPS(int(c), groups.widths[g], stores[g], inits[g], **options)  # type: ignore[arg-type]
            for g, c in enumerate(capacity_rows)
        ]

    def pull(
        self, batch_id: Hashable, keys: ArrayLike, held: np.ndarray | None = None
    ) -> tuple[GroupedRows, np.ndarray]:
        """:meth:`MemPS.pull` per group: ``(rows, missing)``, ``missing`` the positions in
        ``keys`` (sorted, distinct) whose rows the load stage must give. A group that cannot
        hold its part raises :class:`~hpsray.errors.CapacityError`; the groups pulled before it
        keep their pins for ``batch_id`` (:meth:`unpin` releases them)."""
        keys = as_keys(keys)
        split = self.groups.split(keys)
        rows, missing = [], []
        for cache, at in zip(self.caches, split, strict=True):
            r, m = cache.pull(batch_id, keys[at], None if held is None else held[at])
            rows.append(r)
            missing.append(at[m])
        return GroupedRows(split, rows), np.sort(np.concatenate(missing))

    def write_back(self, batch_id: Hashable, keys: ArrayLike, rows: GroupedRows) -> None:
        """:meth:`MemPS.write_back` of each group's rows."""
        keys = as_keys(keys)
        rows.check(self.groups, keys.size, "GroupedMemPS.write_back")
        for cache, at, r in zip(self.caches, rows.at, rows.rows, strict=True):
            if at.size:
                cache.write_back(batch_id, keys[at], r)

    def unpin(self, batch_id: Hashable) -> None:
        """Release ``batch_id``'s pins in every group that holds some."""
        held = [cache for cache in self.caches if batch_id in cache.in_flight]
        if not held:
            raise KeyError(f"unpin: batch {batch_id!r} has no pinned rows")
        for cache in held:
            cache.unpin(batch_id)

    def peek(self, keys: ArrayLike) -> GroupedRows:
        """:meth:`MemPS.peek` per group."""
        keys = as_keys(keys)
        split = self.groups.split(keys)
        return GroupedRows(split, [cache.peek(keys[at]) for cache, at in zip(self.caches, split, strict=True)])

    def store_kept(self, keys: ArrayLike, rows: GroupedRows) -> np.ndarray:
        """:meth:`MemPS.store_kept` of each group's rows; which keys were resident."""
        keys = as_keys(keys)
        rows.check(self.groups, keys.size, "GroupedMemPS.store_kept")
        placed = np.zeros(keys.size, bool)
        for cache, at, r in zip(self.caches, rows.at, rows.rows, strict=True):
            placed[at] = cache.store_kept(keys[at], r)
        return placed

    def drop(self, keys: ArrayLike) -> int:
        """:meth:`MemPS.drop` per group; the rows dropped."""
        keys = as_keys(keys)
        return sum(cache.drop(keys[at]) for cache, at in zip(self.caches, self.groups.split(keys), strict=True))

    def _mask(self, verb: str, keys: ArrayLike) -> np.ndarray:
        """Each key's answer to its group's ``MemPS.<verb>(keys)`` (a bool per key)."""
        keys = as_keys(keys)
        out = np.zeros(keys.size, dtype=bool)
        for cache, at in zip(self.caches, self.groups.split(keys), strict=True):
            out[at] = getattr(cache, verb)(keys[at])
        return out

    def contains(self, keys: ArrayLike) -> np.ndarray:
        return self._mask("contains", keys)

    def has_rows(self, keys: ArrayLike) -> np.ndarray:
        return self._mask("has_rows", keys)

    def pinned(self, keys: ArrayLike) -> np.ndarray:
        return self._mask("pinned", keys)

    @property
    def in_flight(self) -> list:
        """Batch ids holding pins in some group."""
        return sorted({b for cache in self.caches for b in cache.in_flight}, key=repr)

    def flush(self) -> int:
        """Write every group's dirty rows to its store; returns the rows written."""
        return sum(cache.flush() for cache in self.caches)

    @property
    def size(self) -> int:
        return sum(cache.size for cache in self.caches)

    def __len__(self) -> int:
        return self.size

    def batch_stats(self, batch_id: Hashable) -> dict:
        """The groups' :meth:`MemPS.batch_stats` summed (groups the batch did not touch aside)."""
        per = []
        for cache in self.caches:
            try:
                per.append(cache.batch_stats(batch_id))
            except KeyError:  # no key of this group in the batch
                continue
        out = {k: sum(p[k] for p in per) for k in ("hits", "misses", "loaded", "initialised")}
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 0.0
        return out

    @property
    def stats(self) -> dict:
        """The groups' numbers summed, the hit rate over the sums, the rows' ``bytes``, and
        ``groups``: each group's :attr:`MemPS.stats` with its ``width``."""
        out = sum_stats([dict(cache.stats, width=cache.width) for cache in self.caches])
        total = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / total if total else 0.0
        out["bytes"] = sum(4 * p["size"] * p["width"] for p in out["groups"])
        return out

    def close(self, flush: bool = True) -> None:
        for cache in self.caches:
            cache.close(flush)

    def __repr__(self) -> str:
        return f"GroupedMemPS(widths={self.groups.widths}, capacity={[c.capacity for c in self.caches]})"
