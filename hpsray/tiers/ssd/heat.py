"""SSD-PS load heat: how many loads wanted each key, for compaction's layout.

The store counts the keys each load found (:meth:`LoadHeat.count`) in a count-min sketch with
conservative update (:class:`~hpsray.tiers.cache_policy.FrequencySketch`: depth 4, ``uint16``
counters; an estimate never undercounts, collisions only overcount). Compaction reads the
estimates (:meth:`LoadHeat.estimate`) and writes the rows of a pass hottest first, so the rows
that loads keep asking for — the warm rows MEM-PS evicts and wants again — fill pages of their
own instead of each sharing a page with cold rows (docs/tiers.md, SSD-PS "Compaction").
Placement only: what a load returns does not depend on it. The counts age as TinyLFU's do: once
``AGE_EVERY`` × counters keys were counted, every counter halves, so keys hot long ago cool.
"""

from __future__ import annotations

import threading

import numpy as np

from hpsray.tiers.cache_policy import FrequencySketch

__all__ = ["AGE_EVERY", "DEFAULT_HEAT_COUNTERS", "LoadHeat"]

DEFAULT_HEAT_COUNTERS = 1 << 20  # counters per sketch row: 8 MiB in all (4 rows of uint16)
AGE_EVERY = 10  # counters' worth of keys counted between two halvings


class LoadHeat:
    """Per-key load counts, approximate (see the module docstring); thread-safe."""

    def __init__(self, counters: int = DEFAULT_HEAT_COUNTERS) -> None:
        if counters < 1:
            raise ValueError(f"heat counters must be >= 1, got {counters}")
        self._sketch = FrequencySketch(counters)
        self._lock = threading.Lock()
        self._age_at = AGE_EVERY * self._sketch.table.shape[1]
        self._counted = 0  # keys counted since the last halving

    def count(self, keys: np.ndarray) -> None:
        """One more load wanted each of ``keys`` (``uint64``; a key given twice counts once)."""
        if keys.size == 0:
            return
        with self._lock:
            self._sketch.remember(keys, self._sketch.estimate(keys) + 1)
            self._counted += int(keys.size)
            if self._counted >= self._age_at:
                self._sketch.halve()
                self._counted = 0

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """``int64``: the loads that wanted each of ``keys``, at least (saturating at 65,535)."""
        with self._lock:
            return self._sketch.estimate(np.ascontiguousarray(keys, dtype=np.uint64))

    @property
    def nbytes(self) -> int:
        return self._sketch.nbytes
