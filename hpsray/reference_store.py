"""The reference trainer's row store (:mod:`hpsray.reference`): every row in host memory, stated
plainly; nothing of the tiers."""

from __future__ import annotations

import numpy as np

from hpsray.kernels.init import RowInit, initial_rows

__all__ = ["SortedRowStore"]


class SortedRowStore:
    """Every row in memory: keys kept sorted beside their row positions; rows appended."""

    def __init__(self, width: int, init: RowInit) -> None:
        self.width = width
        self.init = init
        self._keys = np.empty(0, dtype=np.uint64)  # sorted
        self._pos = np.empty(0, dtype=np.int64)  # row of each sorted key
        self._rows = np.empty((1024, width), dtype=np.float32)
        self._n = 0  # rows appended (dropped ones included until the next compaction)

    def __len__(self) -> int:
        return int(self._keys.size)

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.searchsorted(self._keys, keys)
        found = idx < self._keys.size
        found[found] = self._keys[idx[found]] == keys[found]
        return idx, found

    def positions(self, unique_keys: np.ndarray) -> np.ndarray:
        """Row positions of sorted distinct keys, creating initial rows for new ones."""
        idx, found = self._locate(unique_keys)
        new = unique_keys[~found]
        if new.size:
            need = self._n + new.size
            if need > self._rows.shape[0]:
                grown = np.empty((max(need, 2 * self._rows.shape[0]), self.width), dtype=np.float32)
                grown[: self._n] = self._rows[: self._n]
                self._rows = grown
            self._rows[self._n : need] = initial_rows(new, self.width, self.init)
            new_pos = np.arange(self._n, need, dtype=np.int64)
            self._keys = np.insert(self._keys, idx[~found], new)
            self._pos = np.insert(self._pos, idx[~found], new_pos)
            self._n = need
            idx, found = self._locate(unique_keys)
        return self._pos[idx]

    def peek(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` without inserting; absent keys get their initial rows."""
        keys = np.asarray(keys, dtype=np.uint64)
        idx, found = self._locate(keys)
        out = initial_rows(keys, self.width, self.init)
        out[found] = self._rows[self._pos[idx[found]]]
        return out

    def preload(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Start from ``rows`` of distinct ``keys`` (e.g. an imported table) instead of their
        initial rows; the store must be empty. Keys absent from them start as usual."""
        if self._n:
            raise ValueError("preload: the store already holds rows")
        keys = np.asarray(keys, dtype=np.uint64)
        order = np.argsort(keys, kind="stable")
        self._keys = keys[order]
        self._pos = np.arange(keys.size, dtype=np.int64)
        self._rows = np.array(np.asarray(rows, dtype=np.float32)[order], copy=True)
        self._n = int(keys.size)

    def rows_at(self, pos: np.ndarray) -> np.ndarray:
        return self._rows[pos]

    def write(self, pos: np.ndarray, rows: np.ndarray) -> None:
        self._rows[pos] = rows

    def drop(self, keys: np.ndarray) -> int:
        """Forget the rows of ``keys`` (absent ones are skipped); returns how many were held."""
        keys = np.asarray(keys, dtype=np.uint64)
        if keys.size == 0 or self._keys.size == 0:
            return 0
        idx, found = self._locate(keys)
        gone = np.unique(idx[found])
        if gone.size == 0:
            return 0
        self._keys = np.delete(self._keys, gone)
        self._pos = np.delete(self._pos, gone)
        if self._n - self._keys.size > max(1024, self._keys.size):  # reclaim the dropped rows
            m = self._keys.size
            self._rows[:m] = self._rows[self._pos]
            self._pos = np.arange(m, dtype=np.int64)
            self._n = m
        return int(gone.size)

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """All ``(keys, rows)`` sorted by key."""
        return self._keys.copy(), self._rows[self._pos].copy()
