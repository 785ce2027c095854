"""Bytes per table of a job of several ``[[tables]]``: each table's rows at its own width.

Per node, for table ``t`` of row width ``w_t`` floats (weights + its optimizer's state,
:class:`~hpsray.tables.Tables`) and ``k_t`` distinct keys (:class:`~hpsray.plan.estimate.KeyEstimate`
``table_distinct``, spread evenly over the nodes by hash partitioning):

* SSD-PS: ``k_t × (16 + 4·w_t)`` live bytes (:func:`~hpsray.plan.sizing.ssd_live_bytes`), plus
  its share of the block tables and key map (per key, as every key);
* MEM-PS: the cache's rows go to the tables in proportion to the distinct keys each brings per
  batch (its share of the lookups), none beyond a table's whole shard (what a table cannot use
  goes to the others); each row costs ``4·w_t + 54`` bytes (:mod:`hpsray.tiers.mem`);
* HBM-PS (tables of several row layouts): one table per row group at its width, each sized at
  an equal share of the trainer's capacity and grown to its share of the lookups
  (:class:`~hpsray.tiers.grouped_hbm.GroupedHbmPS`).
"""

from __future__ import annotations

import math
from typing import Any

from hpsray.plan.estimate import KeyEstimate
from hpsray.plan.sizing import SSD_RECORD_EXTRA, hbm_table_bytes, ssd_live_bytes
from hpsray.tables import Tables
from hpsray.tiers.mem import META_BYTES_PER_ROW
from hpsray.tiers.rowgroups import RowGroups

__all__ = ["by_table", "hbm_group_bytes", "table_sizes"]


def _fill(capacity: float, shares: list[float], caps: list[float]) -> list[float]:
    """``capacity`` split in proportion to ``shares``, none above its ``caps``; what a full one
    cannot take is split again among the others."""
    out = [0.0] * len(shares)
    open_ = {t for t in range(len(shares)) if caps[t] > 0}
    left = float(capacity)
    while open_ and left > 1e-9:
        weight = {t: shares[t] for t in open_}
        total = sum(weight.values())
        if total <= 0:
            weight, total = dict.fromkeys(open_, 1.0), float(len(open_))
        spent = 0.0
        for t in sorted(open_):
            take = min(left * weight[t] / total, caps[t] - out[t])
            out[t] += take
            spent += take
            if out[t] >= caps[t]:
                open_.discard(t)
        left -= spent
        if spent <= 0:
            break
    return out


def table_sizes(tables: Tables, keys: KeyEstimate, capacity_rows: int) -> dict[str, dict[str, Any]]:
    """Per table name, its rows and bytes on one node (see the module docstring)."""
    nodes = max(keys.nodes, 1)
    shard = [k / nodes for k in keys.table_distinct]
    lookups = list(keys.table_batch_distinct_mean)
    resident = _fill(min(float(capacity_rows), sum(shard)), lookups, shard)
    total_lookups = sum(lookups) or 1.0
    out = {}
    for t, spec in enumerate(tables.specs):
        row_bytes = tables.row_bytes[t]
        out[spec.name] = {
            "slots": list(spec.slots),
            "dim": spec.dim,
            "optimizer": spec.optimizer,
            "row_width": tables.widths[t],
            "row_bytes": row_bytes,
            "keys": keys.table_distinct[t],
            "shard_rows": shard[t],
            "batch_rows": lookups[t] / nodes,
            "lookup_share": lookups[t] / total_lookups,
            "ssd_live_bytes": ssd_live_bytes(shard[t], tables.widths[t]),
            "ssd_bytes_per_key": SSD_RECORD_EXTRA + row_bytes,
            "mem_ps_rows": resident[t],
            "mem_ps_bytes": int(round(resident[t] * (row_bytes + META_BYTES_PER_ROW))),
        }
    return out


def hbm_group_bytes(tables: Tables, keys: KeyEstimate, capacity: int) -> tuple[int, int] | None:
    """``(bytes, rows)`` of the trainer's working set of ``tables`` held one table per row
    group (``None`` for rows of one layout: :func:`~hpsray.plan.sizing.hbm_table_bytes`)."""
    groups = RowGroups.of(tables)
    if len(groups) < 2:
        return None
    lookups = [sum(keys.table_batch_distinct_mean[t] for t in ts) for ts in groups.tables]
    total = sum(lookups) or 1.0
    each = -(-capacity // len(groups))
    parts = [
        hbm_table_bytes(each, w, 1, math.ceil(keys.hbm_working_set_max * n / total))
        for w, n in zip(groups.widths, lookups, strict=True)
    ]
    return sum(b for b, _ in parts), sum(r for _, r in parts)


def by_table(sizes: dict[str, dict[str, Any]] | None, key: str) -> str:
    """``" (by table: a 1,234, b 56 ...)"``: each table's ``key`` bytes, largest first ("" without tables)."""
    if not sizes:
        return ""
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][key])
    total = sum(v[key] for _, v in ranked) or 1
    parts = ", ".join(f"{name!r} {int(v[key]):,} ({v[key] / total:.0%})" for name, v in ranked)
    return f" (by table: {parts})"
