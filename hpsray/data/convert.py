"""Arrow columns → a :class:`Batch` of the good rows, plus the bad rows and why they are bad.

Shared by the text (CSV/TSV/Criteo) and Parquet readers. Text columns arrive as strings and are
parsed here; Parquet columns may already be typed. All work is vectorised (pyarrow compute,
numpy, the numba kernels of :mod:`hpsray.data.categorical`); a slower path that pins down
individual bad values runs only for blocks that hold one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from hpsray.data.bad_input import EMPTY_LINE, INVALID_CATEGORICAL, INVALID_LABEL, NON_NUMERIC_DENSE
from hpsray.data.batch import Batch
from hpsray.data.categorical import assemble_csr, drop_rows, encode_column, encode_single_columns
from hpsray.data.numeric import parse_float32
from hpsray.data.schema import Schema


def to_float(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values float32, missing, unparsable)``: numeric values (0 where missing or unparsable)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    t = arr.type
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        values = arr.cast(pa.float32())
        missing = np.asarray(values.is_null(), dtype=np.bool_)
        return np.asarray(values.fill_null(0), dtype=np.float32), missing, np.zeros(n, np.bool_)
    if pa.types.is_null(t):
        return np.zeros(n, np.float32), np.ones(n, np.bool_), np.zeros(n, np.bool_)
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.string())
    return parse_float32(arr)


@dataclass
class Converted:
    """The good rows of one block as a ``Batch`` and, for the bad rows, their index and reason."""

    batch: Batch
    bad_index: np.ndarray  # int64[k], ascending row indices within the block
    bad_reason: list[str]  # per bad row
    details: list[str] = field(default_factory=list)  # per bad row, filled lazily by describe()


class Converter:
    """Turns record batches with the columns of ``names`` into batches under ``schema``."""

    def __init__(self, schema: Schema, names: list[str]) -> None:
        self.schema = schema
        label, dense, cats = schema.resolve(names)
        self.label_name = names[label]
        self.dense_names = [names[i] for i in dense]
        self.cat_names = [names[i] for i in cats]
        self.used = [self.label_name, *self.dense_names, *self.cat_names]

    def convert(self, rb: pa.RecordBatch | pa.Table) -> Converted:
        s = self.schema
        n = rb.num_rows
        col = rb.column if isinstance(rb, pa.RecordBatch) else (lambda name: rb.column(name).combine_chunks())

        label_arr = col(self.label_name)
        labels, lab_missing, lab_bad = to_float(label_arr)
        bad_label = lab_missing | lab_bad | ~np.isfinite(labels) | (labels < 0) | (labels > 1)

        dense = np.zeros((n, len(self.dense_names)), np.float32)
        bad_dense = np.zeros(n, np.bool_)
        for j, name in enumerate(self.dense_names):
            v, _missing, unparsable = to_float(col(name))
            nonfinite = ~np.isfinite(v)
            if unparsable.any() or nonfinite.any():
                b = unparsable | nonfinite
                bad_dense |= b
                v = np.where(b, 0, v).astype(np.float32)
            dense[:, j] = v
        if s.dense_transform == "log1p" and dense.size:
            np.log1p(np.maximum(dense, 0, out=dense), out=dense)

        fast = None
        if not s.multi_hot_separator:
            fast = encode_single_columns([col(name) for name in self.cat_names], s.encoding)
        cols = []
        if fast is not None:
            keys, offsets, slots, bad_cat = fast
        else:
            bad_cat = np.zeros(n, np.bool_)
            for slot, name in enumerate(self.cat_names):
                ck, counts, bad = encode_column(col(name), slot, s.encoding, s.multi_hot_separator)
                if bad is not None:
                    bad_cat |= bad
                cols.append((ck, counts))

        bad_any = bad_label | bad_dense | bad_cat
        reasons: list[str] = []
        if bad_any.any():
            bad_index = np.flatnonzero(bad_any)
            empty = np.zeros(n, np.bool_)
            if lab_missing.any():
                empty = lab_missing.copy()
                for name in self.used[1:]:
                    empty &= np.asarray(col(name).is_null(), dtype=np.bool_)
            for i in bad_index:
                if empty[i]:
                    reasons.append(EMPTY_LINE)
                elif bad_label[i]:
                    reasons.append(INVALID_LABEL)
                elif bad_dense[i]:
                    reasons.append(NON_NUMERIC_DENSE)
                else:
                    reasons.append(INVALID_CATEGORICAL)
            keep = ~bad_any
        else:
            bad_index = np.zeros(0, np.int64)
            keep = None
        if fast is None:
            keys, offsets, slots = assemble_csr(cols, n, keep)
        elif keep is not None:
            keys, offsets, slots = drop_rows(keys, offsets, slots, keep)
        if keep is not None:
            labels, dense = labels[keep], dense[keep]
        batch = Batch(labels.astype(np.float32, copy=False), dense, keys, offsets, slots, len(self.cat_names))
        return Converted(batch, bad_index.astype(np.int64), reasons)

    def describe(self, rb: pa.RecordBatch | pa.Table, row: int, reason: str) -> str:
        """A human-readable reason for one bad row of ``rb`` (error path only)."""

        def value(name: str) -> Any:
            return rb.column(name)[row].as_py()

        if reason == EMPTY_LINE:
            return "empty line (no fields)"
        if reason == INVALID_LABEL:
            v = value(self.label_name)
            return "missing label" if v is None else f"label {v!r} is not a number in [0, 1]"
        if reason == NON_NUMERIC_DENSE:
            for name in self.dense_names:
                v = value(name)
                if v is None:
                    continue
                try:
                    f = float(v)
                except (TypeError, ValueError):
                    f = None
                if f is None or not np.isfinite(f):
                    return f"dense column {name!r} value {v!r} is not a finite number"
            return "dense value is not a finite number"
        if reason == INVALID_CATEGORICAL:
            for name in self.cat_names:
                v = value(name)
                if v is None:
                    continue
                _, _, bad = encode_column(
                    rb.column(name).slice(row, 1), 0, self.schema.encoding, self.schema.multi_hot_separator
                )
                if bad is not None and bad[0]:
                    return f"categorical column {name!r} value {v!r} is not a valid {self.schema.encoding} value"
            return f"categorical value is not a valid {self.schema.encoding} value"
        return reason
