"""The plan as the text ``hpsray plan`` prints."""

from __future__ import annotations

from hpsray.plan.plan import Plan

__all__ = ["human_bytes", "render"]


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"


def render(plan: Plan) -> str:
    """Human-readable plan: input, keys, per-node needs, predicted rate, problems with their fixes."""
    k, size = plan.keys, plan.input
    mem, tr, ssd = plan.per_node["mem_ps"], plan.per_node["trainer"], plan.per_node["ssd_ps"]
    exact = "" if size.exact else "~"
    where = f", {size.files} files, {human_bytes(size.bytes)}" if size.files else ""
    capped = " capped by the key space" if k.key_space and k.total_distinct >= k.key_space else ""
    lines = [
        f"plan for {plan.job} ({plan.nodes} node{'s' if plan.nodes > 1 else ''}, batch_size {plan.batch_size:,}, "
        f"row width {plan.row_width} floats)",
        f"input      {exact}{size.rows:,} examples{where} ({size.how}); sampled {k.sample_examples:,}",
        f"keys       {k.batch_distinct_mean:,.0f} distinct per global batch (max {k.batch_distinct_max:,}), "
        f"{k.sample_distinct:,.0f} in the sample, ~{k.total_distinct:,.0f} in all "
        f"(growth D ∝ n^{k.growth_exponent:.2f}{capped})",
        "per node",
        f"  MEM-PS   budget {mem['capacity_rows']:,} rows ({human_bytes(mem['capacity_bytes'])}); needs at least "
        f"{mem['pinned_rows_max']:,} rows ({human_bytes(mem['min_bytes'])}: two batches pinned at once); "
        f"whole shard {mem['shard_rows']:,.0f} rows ({human_bytes(mem['shard_bytes'])}); will hold "
        f"{mem['resident_rows']:,.0f}",
        f"  trainer  HBM-PS working set {tr['hbm_working_set_rows']:,} rows in tables of {tr['hbm_table_rows']:,} "
        f"({human_bytes(tr['hbm_bytes'])}) + dense model {human_bytes(tr['dense_bytes'])} on {tr['device']}",
        f"  SSD-PS   {human_bytes(ssd['live_bytes'])} live, up to {human_bytes(ssd['disk_bytes_max'])} with compaction "
        f"headroom (×{ssd['max_space_ratio']:g}); {human_bytes(ssd['free_bytes'])} free at {ssd['path']}",
        f"  key map  {ssd['rows']:,} keys ({ssd['imported_rows']:,} imported): {human_bytes(ssd['key_map_bytes'])}, "
        f"{human_bytes(ssd['key_map_peak_bytes'])} at its peak, + {human_bytes(ssd['block_table_bytes'])} of block "
        f"tables ({ssd['bytes_per_key_memory']:.1f} B/key in memory, {ssd['bytes_per_key_disk']:.1f} on disk); disk "
        f"high water ~{human_bytes(ssd['disk_bytes_expected'])}",
        f"  objects  {human_bytes(plan.per_node['object_store_bytes'])} in the object store in flight; host memory "
        f"~{human_bytes(plan.per_node['host_bytes'])} with Ray and the processes "
        f"(limit {human_bytes(plan.per_node['memory']['limit_bytes'])})",
    ]
    for name, t in (plan.per_node.get("tables") or {}).items():
        lines.append(
            f"  table    {name!r}: dim {t['dim']}, {t['row_bytes']} B a row ({t['optimizer']}); "
            f"{t['shard_rows']:,.0f} keys, {human_bytes(t['ssd_live_bytes'])} on SSD-PS; "
            f"{t['lookup_share']:.0%} of the lookups, ~{t['mem_ps_rows']:,.0f} rows in MEM-PS "
            f"({human_bytes(t['mem_ps_bytes'])})"
        )
    if plan.predicted_examples_per_s is not None and plan.stage_s_per_batch is not None:
        st = ", ".join(f"{name} {s * 1000:,.0f} ms" for name, s in plan.stage_s_per_batch.items())
        cores = plan.calibration.cores if plan.calibration else 0
        limit = "the cores the stages share" if plan.bottleneck == "cores" else f"the {plan.bottleneck} stage"
        lines.append(
            f"rate       ~{plan.predicted_examples_per_s:,.0f} examples/s predicted (per batch: {st}; {cores} cores); "
            f"bottleneck: {limit}"
        )
    for note in plan.notes:
        lines.append(f"note       {note}")
    if not plan.problems:
        lines.append("verdict    fits")
    for p in plan.problems:
        lines.append(f"{p.severity.upper():<10} {p.setting}: {p.message}\n           fix: {p.fix}")
    return "\n".join(lines)
