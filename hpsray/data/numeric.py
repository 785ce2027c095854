"""Decimal text → ``float32`` for dense features and labels, with the bad values pinned down."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# What arrow's string→float cast accepts, conservatively; used only to locate bad values.
_NUMBER = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"


def _python_float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def parse_float32(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values float32, missing bool, unparsable bool)`` of a string array (0 where not a number).

    pyarrow's cast parses the whole column (correctly rounded); only when it fails does a
    regular expression, and at worst Python's ``float``, find the values that are not numbers.
    """
    try:
        values = pc.cast(arr, pa.float32())
        unparsable = np.zeros(len(arr), np.bool_)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        ok = pc.fill_null(pc.match_substring_regex(arr, _NUMBER), True)
        cleaned = pc.if_else(ok, arr, pa.scalar(None, arr.type))
        try:
            values = pc.cast(cleaned, pa.float32())
        except pa.ArrowInvalid:  # the regex let through something the cast rejects
            raw = cleaned.to_pylist()
            py = [None if r is None else _python_float(r) for r in raw]
            ok = np.asarray(ok, dtype=np.bool_) & np.array([r is None or p is not None for r, p in zip(raw, py)])
            values = pa.array(py, pa.float32())
        unparsable = ~np.asarray(ok, dtype=np.bool_)
    missing = np.asarray(values.is_null(), dtype=np.bool_) & ~unparsable
    return np.asarray(values.fill_null(0), dtype=np.float32), missing, unparsable
