"""Comparing two exports row by row and bit by bit (``hpsray train --compare``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def compare_exports(a: tuple[np.ndarray, np.ndarray, Mapping], b: tuple[np.ndarray, np.ndarray, Mapping]) -> dict:
    """How far two trained models are apart, order-insensitively.

    Returns ``rows_a``, ``rows_b``, ``keys_only_in_a``, ``keys_only_in_b``, ``max_abs_row_diff``
    (over the common keys, weights and state) and ``max_abs_dense_diff`` (``inf`` when the dense
    parameters differ in names or shapes); and where they differ: ``rows_differing`` (common
    keys whose rows are not bit-equal), ``max_rel_diff`` (the largest ``|a - b| / max(|a|, |b|)``,
    rows and dense) and ``max_ulps`` (the largest distance in float32 units in the last place),
    so a difference of rounding's size (a few ulps) tells itself from a real one.
    """
    ka, ra, da = a
    kb, rb, db = b
    oa, ob = np.argsort(ka), np.argsort(kb)
    ka, ra, kb, rb = ka[oa], ra[oa], kb[ob], rb[ob]
    common, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    if ra.shape[1:] != rb.shape[1:]:
        row_diff, rows_differing = float("inf"), int(common.size)
    else:
        pairs.append((ra[ia], rb[ib]))
        row_diff = float(np.max(np.abs(ra[ia] - rb[ib]))) if common.size else 0.0
        rows_differing = int(np.count_nonzero(np.any(ra[ia] != rb[ib], axis=1))) if common.size else 0
    if set(da) != set(db) or any(tuple(da[n].shape) != tuple(db[n].shape) for n in da):
        dense_diff = float("inf")
    else:
        dense_diff = max((float((da[n].float() - db[n].float()).abs().max()) for n in da if da[n].numel()), default=0.0)
        pairs += [(da[n].float().numpy().ravel(), db[n].float().numpy().ravel()) for n in da if da[n].numel()]
    rel, ulps = 0.0, 0
    for x, y in pairs:
        x, y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
        if x.size:
            scale = np.maximum(np.abs(x), np.abs(y))
            with np.errstate(invalid="ignore", divide="ignore"):
                r = np.where(scale > 0, np.abs(x - y) / scale, 0.0)
            rel = max(rel, float(np.nanmax(r)))
            ulps = max(ulps, int(np.max(np.abs(_ordered_bits(x) - _ordered_bits(y)))))
    if not pairs and (row_diff == float("inf") or dense_diff == float("inf")):
        rel, ulps = float("inf"), -1
    return {
        "rows_a": int(ka.size),
        "rows_b": int(kb.size),
        "keys_only_in_a": int(ka.size - common.size),
        "keys_only_in_b": int(kb.size - common.size),
        "max_abs_row_diff": row_diff,
        "max_abs_dense_diff": dense_diff,
        "rows_differing": rows_differing,
        "max_rel_diff": rel,
        "max_ulps": ulps,
    }


def _ordered_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as int64 integers in the floats' order, one apart for neighbouring floats
    (``-0.0`` and ``0.0`` both 0): distances are in units in the last place."""
    bits = x.view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
