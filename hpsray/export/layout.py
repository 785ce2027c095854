"""The export's row layout for tables of several row layouts (docs/export.md, "Tables").

Trained rows of such tables share the working set's width (a table's weights, its optimizer's
state, zeros to the widest table's width). An export stores them as every export does, a
``weights`` and a ``state`` column, each as wide as the widest table's part: a row's weights,
zeros past its table's dim; its state, zeros past its table's. So serving reads any key's
weights from one column and pools each slot at its table's dim. One layout: the rows as trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpsray.config import TrainConfig
from hpsray.tables import TAG_SHIFT, export_columns, mixed_layouts, table_layouts
from hpsray.tiers.ssd.bulkload import narrow

__all__ = ["ExportLayout"]


@dataclass(frozen=True)
class ExportLayout:
    """Per table (by its index, the keys' tag) its ``dims`` and row ``widths``; ``dim`` and
    ``state_width``: the export's columns (the widest table's weights and state)."""

    dims: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def of(cls, config: TrainConfig) -> ExportLayout | None:
        """The layout of ``config``'s tables, ``None`` for rows of one layout (exported as trained)."""
        if not mixed_layouts(config):
            return None
        layouts = table_layouts(config)
        return cls(tuple(d for d, _, _ in layouts), tuple(w for _, w, _ in layouts))

    @property
    def dim(self) -> int:
        return export_columns(self.dims, self.widths)[0]

    @property
    def state_width(self) -> int:
        return export_columns(self.dims, self.widths)[1]

    def _tables(self, keys: np.ndarray) -> list[np.ndarray]:
        tag = (np.asarray(keys, dtype=np.uint64) >> TAG_SHIFT).astype(np.int64)
        if tag.size and int(tag.max()) >= len(self.dims):
            raise ValueError(f"export: key {int(keys[int(np.argmax(tag))]):#x} names no table (of {len(self.dims)})")
        return [np.flatnonzero(tag == t) for t in range(len(self.dims))]

    def to_export(self, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Trained ``rows`` of ``keys`` as the export stores them (``[n, dim + state_width]``)."""
        out = np.zeros((keys.size, self.dim + self.state_width), np.float32)
        for at, d, w in zip(self._tables(keys), self.dims, self.widths, strict=True):
            out[at, :d] = rows[at, :d]
            out[at, self.dim : self.dim + w - d] = rows[at, d:w]
        return out

    def to_rows(self, keys: np.ndarray, stored: np.ndarray, width: int) -> np.ndarray:
        """Exported rows of ``keys`` back as trained rows of ``width`` floats."""
        out = np.zeros((keys.size, width), np.float32)
        for at, d, w in zip(self._tables(keys), self.dims, self.widths, strict=True):
            out[at, :w] = narrow(stored[at], self.dim, d, w)
        return out
