"""The run report of one ``fit()``: every stage actor's figures gathered and combined into a
:class:`~hpsray.report.RunReport`.

Only the batches that ``fit()`` trained count. With several nodes, a stage's busy seconds (per
batch and in all) are those of its busiest node, so ``pipeline_efficiency`` is the slowest
(stage, node) over wall time; ``per_node`` keeps every node's own figures. The ``load`` stage's
seconds are its SSD-PS actor's: the loads plus the writes MEM-PS handed down (dumps, deletes).
``queues`` gives every edge's capacity, deepest fill and stalls; ``overlap`` how often the
stages ran on consecutive batches at once. ``pipeline_efficiency`` counts a stage's busy time
inside the timed windows only: the fill a pass submits while its trainers are still starting
(before its clock) is in ``stage_busy_s`` and ``per_batch_s``, not in the share of the wall.
"""

from __future__ import annotations

import time

import numpy as np
import ray

from hpsray.actors.working_set import working_set_report
from hpsray.config import TrainConfig
from hpsray.pipelines.edge import BoundedEdge
from hpsray.pipelines.placement import NodeActors
from hpsray.pipelines.report import STAGES
from hpsray.pipelines.settings import SyncSettings, TrainerSettings
from hpsray.report import EdgeFill, NodeFigures, Overlap, RunReport, SsdTotals, Start, Sync, TableFigures
from hpsray.tables import table_layouts
from hpsray.tiers.ssd.paramfile import record_bytes

SSD_TOTALS = (
    "bytes_read",
    "bytes_written",
    "files",
    "disk_bytes",
    "live_bytes",
    "compactions",
    "load_seconds",
    "dump_seconds",
)  # SsdTotals' summed fields


def sum_counts(caches: list[dict]) -> dict:
    """MEM-PS counters summed over nodes, the hit rate recomputed from the sums."""
    if len(caches) == 1:
        return caches[0]
    out = {k: sum(c[k] for c in caches) for k, v in caches[0].items() if isinstance(v, (int, float))}
    looked_up = out.get("hits", 0) + out.get("misses", 0)
    out["hit_rate"] = out.get("hits", 0) / looked_up if looked_up else 0.0
    return out


def _with_loads(cache: dict, ssds: list[dict]) -> dict:
    """The MEM-PS counters with the load stage's: the rows it ``loaded`` from SSD-PS files and
    ``initialised`` (MEM-PS itself only names them missing)."""
    for key in ("loaded", "initialised"):
        cache[key] = cache.get(key, 0) + sum(int(s.get(key, 0)) for s in ssds)
    return cache


def _spans(events: list, batches: set) -> dict:
    """``{batch: (first start, last end)}`` of a stage's timed calls (wall-clock seconds)."""
    out: dict = {}
    for start, end, b in events:
        if b in batches:
            s0, e0 = out.get(b, (start, end))
            out[b] = (min(s0, start), max(e0, end))
    return out


def close_window(acc: dict, t0: float) -> None:
    """Add the pass segment timed from ``t0`` (a ``time.perf_counter``) to ``acc["wall"]`` and
    its wall-clock interval to ``acc["windows"]``."""
    now, now_t = time.perf_counter(), time.time()
    acc["wall"] += now - t0
    acc["windows"].append((now_t - (now - t0), now_t))


def busy_within(clocks: list[dict], batches: set, windows: list[tuple[float, float]]) -> float:
    """Seconds of ``windows`` (wall-clock intervals) in which any of ``clocks`` (one stage's
    clock snapshots on one node) was busy with ``batches``: the union of their calls, so calls
    that overlap (two clocks of one actor, a call's threads) count once."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for clock in clocks for s, e, b in clock["events"] if b in batches):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return float(sum(max(0.0, min(e, we) - max(s, ws)) for s, e in merged for ws, we in windows))


def overlap(per_node: list[tuple[dict, dict, dict]], batches: set) -> Overlap:
    """How often the four-stage pipeline ran as the paper draws it, from the stage clocks'
    intervals (reader, SSD-PS, trainer stats of each node): of the batches ``t`` with a
    ``t+1`` to load and a ``t+2`` to read, the share where the load of ``t+1`` ran while ``t``
    trained (``load_during_train``), and where the read of ``t+2``, the load of ``t+1`` and the
    training of ``t`` were under way at one instant (``read_load_train``). Every node counts."""
    both = loading = total = 0
    for reader, ssd, trainer in per_node:
        read, load, train = (_spans(s["events"], batches) for s in (reader, ssd, trainer))
        for t in sorted(train):
            if t + 1 not in load or t + 2 not in read:
                continue
            total += 1
            tr, ld, rd = train[t], load[t + 1], read[t + 2]
            loading += max(tr[0], ld[0]) < min(tr[1], ld[1])
            both += max(tr[0], ld[0], rd[0]) < min(tr[1], ld[1], rd[1])
    return Overlap(
        batches=total,
        load_during_train=loading / total if total else 0.0,
        read_load_train=both / total if total else 0.0,
    )


def run_report(
    nodes: list[NodeActors],
    sync: SyncSettings,
    settings: TrainerSettings,
    wall: float,
    batches: range,
    examples: int,
    edges: list[BoundedEdge],
    started_at: float | None = None,
    *,
    startup_s: float,
    start_s: dict[str, float],
    checkpoints: dict | None = None,
    recovery: list[dict] | None = None,
    reshaped: dict | None = None,
    windows: list[tuple[float, float]] | None = None,
) -> RunReport:
    """The report of the ``batches`` one ``fit()`` trained in ``wall`` seconds, after
    ``startup_s`` seconds of starting actors; with ``started_at`` (a ``time.time()``),
    ``time_to_first_batch_s``: from then to the start of the first batch's training on node 0,
    and its breakdown ``start``, whose seconds (``ray_init_s`` and each stage's) are taken out of
    ``start_s`` (a later ``fit()`` reports its own). ``checkpoints``, ``recovery`` and
    ``reshaped``: the pipeline's checkpoint costs, recoveries and re-partition, where it has them;
    ``settings``: the trainers' (devices per node; the model's tables, each with its figures);
    ``windows``: the wall-clock intervals ``wall`` sums (:func:`close_window`), which the
    efficiency's busy seconds are counted within (without them, every busy second counts)."""
    stats = ray.get(
        [
            ref
            for node in nodes
            for ref in (
                node.reader.stats.remote(),
                node.mem.stats.remote(),
                node.ssd.stats.remote(len(settings.config.tables) > 1),
                node.trainer.stats.remote(),
                node.reader.bad_input.remote(),
            )
        ]
    )
    per_node = [stats[5 * i : 5 * i + 5] for i in range(len(nodes))]
    mine = set(batches)
    node_busy, node_per_batch, node_cpu, node_within = [], [], [], []
    for reader, mem, ssd, trainer, _ in per_node:
        clocks = {s["stage"]: [s] for s in (reader, mem, ssd, trainer)}
        clocks[ssd["stage"]].append(ssd["dump"])  # the SSD-PS's busy time: its loads and its writes
        if windows is not None:
            node_within.append({name: busy_within(c, mine, windows) for name, c in clocks.items()})
        pb = {name: _per_batch(c, mine) for name, c in clocks.items()}
        node_per_batch.append(pb)
        node_busy.append({name: float(sum(v.values())) for name, v in pb.items()})
        node_cpu.append({name: sum(_cpu_in(clock, mine) for clock in c) for name, c in clocks.items()})
    busy = {name: max(nb[name] for nb in node_busy) for name in node_busy[0]}
    # inside the windows at most all of it: the two sums round apart by a few ulps
    within = None
    if node_within:
        within = {name: min(max(nw[name] for nw in node_within), busy[name]) for name in node_within[0]}
    cpu_s = {name: max(nc[name] for nc in node_cpu) for name in node_cpu[0]}
    per_batch = {
        name: {b: max(pb[name].get(b, 0.0) for pb in node_per_batch) for b in sorted(mine)}
        for name in node_per_batch[0]
    }
    mems = [r[1] for r in per_node]
    hit_rate = {
        b: float(np.mean([mem["hit_rate"][b] for mem in mems if b in mem["hit_rate"]]))
        for b in sorted(mine)
        if any(b in mem["hit_rate"] for mem in mems)
    }
    stores = [r[2]["store"] for r in per_node]
    trainer0 = per_node[0][3]
    firsts = [start for start, _, b in trainer0["events"] if len(batches) and b == batches[0]]
    ttfb = max(min(firsts) - started_at, 0.0) if started_at is not None and firsts else None
    start = None
    if ttfb is not None:
        ray_init_s = start_s.pop("ray_init_s", 0.0)
        start = Start(
            ray_init_s=ray_init_s,
            actors_s=startup_s,
            other_s=max(ttfb - (ray_init_s + startup_s), 0.0),
            ready_s={k: start_s.pop(k) for k in list(start_s) if k in STAGES},
        )
    several = len(nodes) > 1
    return RunReport(
        mode=sync.consistency if several else "bsp",
        nodes=len(nodes),
        devices_per_node=settings.n_devices,
        batches=len(batches),
        examples=examples,
        wall_s=wall,
        stage_busy_s=busy,
        busy_in_wall=within,
        stage_cpu_s=cpu_s,
        per_batch_s={name: {str(k): v for k, v in pb.items()} for name, pb in per_batch.items()},
        cache_hit_rate={str(k): v for k, v in hit_rate.items()},
        ssd=SsdTotals(**{k: sum(st[k] for st in stores) for k in SSD_TOTALS}),
        cache=_with_loads(sum_counts([mem["cache"] for mem in mems]), [r[2] for r in per_node]),
        loss={str(k): v for k, v in sorted(trainer0["losses"].items()) if k in mine},
        queues={e.name: EdgeFill(capacity=e.capacity, max_depth=e.max_depth, stalls=e.stalls) for e in edges},
        overlap=overlap([(r[0], r[2], r[3]) for r in per_node], mine),
        working_set=working_set_report([r[3]["traffic"] for r in per_node if "traffic" in r[3]], mine),
        bad_input=per_node[0][4] if not several else {f"node {i}": r[4] for i, r in enumerate(per_node)},
        time_to_first_batch_s=ttfb,
        sync=_sync([r[3] for r in per_node], mems, sync) if several else None,
        tables=table_figures(settings.config, mems, [r[2] for r in per_node]),
        per_node=[
            NodeFigures(node=i, stage_busy_s=nb, examples=r[0]["examples"], cache=r[1]["cache"])
            for i, (nb, r) in enumerate(zip(node_busy, per_node))
        ]
        if several
        else None,
        startup_s=startup_s,
        start=start,
        checkpoints=checkpoints,
        recovery=recovery,
        reshaped=reshaped,
    )


def table_figures(config: TrainConfig, mems: list[dict], ssds: list[dict]) -> dict[str, TableFigures] | None:
    """Per table of a model of several tables (``None`` otherwise), the MEM-PS and load-stage
    counts of its keys' tag (:mod:`hpsray.tiers.tagcount`) and the rows its SSD-PS files hold
    now, summed over nodes."""
    if len(config.tables) < 2:
        return None
    n = len(config.tables)
    lookups, misses, loaded, created = (
        np.sum([np.asarray(part["by_tag"][key][:n]) for part in parts], axis=0)
        for parts, key in ((mems, "lookups"), (mems, "misses"), (ssds, "loaded"), (ssds, "initialised"))
    )
    live = np.sum([np.asarray(part["by_tag"].get("live", [0] * 256)[:n]) for part in ssds], axis=0)
    widths = [w for _, w, _ in table_layouts(config)]  # each table's rows, stored at its width
    out = {}
    for t, spec in enumerate(config.tables):
        record, row_bytes = record_bytes(widths[t]), 4 * widths[t]
        hits = int(lookups[t] - misses[t])
        out[spec.name] = TableFigures(
            row_bytes=row_bytes,
            lookups=int(lookups[t]),
            hits=hits,
            hit_rate=hits / int(lookups[t]) if lookups[t] else 0.0,
            ssd_rows_loaded=int(loaded[t]),
            ssd_bytes_loaded=int(loaded[t]) * row_bytes,
            rows_created=int(created[t]),
            bytes_created=int(created[t]) * row_bytes,
            ssd_live_rows=int(live[t]),
            ssd_live_bytes=int(live[t]) * record,
        )
    return out


def _per_batch(clocks: list[dict], batches: set) -> dict[int, float]:
    """Busy seconds per batch of ``batches`` of one stage on one node, its ``clocks`` added up."""
    out: dict[int, float] = {}
    for clock in clocks:
        for b, v in clock["per_batch"].items():
            if b in batches:
                out[b] = out.get(b, 0.0) + v
    return out


def _cpu_in(clock: dict, batches: set) -> float:
    """The CPU seconds a stage's process used while busy with ``batches`` (its clock's snapshot)."""
    return float(sum(v for b, v in clock.get("cpu_per_batch", {}).items() if b in batches))


def _sync(trainers: list[dict], mems: list[dict], sync: SyncSettings) -> Sync:
    """How the nodes kept consistent: the settings and the staleness every trainer and owner saw."""
    return Sync(
        consistency=sync.consistency,
        staleness_bound=sync.slack,
        propagation=sync.propagation if sync.consistency != "bsp" else None,
        max_staleness_observed=max(tr.get("max_staleness", 0) for tr in trainers),
        max_staleness_across_batches=max(tr.get("max_staleness_across_batches", 0) for tr in trainers),
        max_owner_staleness=max(mem.get("owner_staleness", 0) for mem in mems),
        dense=sync.dense,
        exchanged_bytes_per_minibatch=float(np.mean([tr["exchanged_bytes_per_step"] for tr in trainers])),
    )
