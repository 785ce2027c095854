"""The plan of a job: what each node needs, what it will run at, and what to change if it cannot fit.

:func:`make_plan` reads a sample (:mod:`~hpsray.plan.sample`), estimates its keys
(:mod:`~hpsray.plan.estimate`), sizes every tier (:mod:`~hpsray.plan.sizing`) and, unless told not
to, times the stages (:mod:`~hpsray.plan.calibrate`). :func:`check_plan` raises the
:class:`~hpsray.errors.CapacityError` the run would hit, naming the setting and the number to set.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from hpsray.env import omp_threads_sleep
from hpsray.errors import CapacityError
from hpsray.plan.calibrate import Calibration, bottleneck, calibrate, node_cores, predict_rate
from hpsray.plan.disk import cold_share, disk_s_per_row, load_bound, load_depth
from hpsray.plan.estimate import KeyEstimate, estimate_keys
from hpsray.plan.footprint import RUNTIME_BYTES, disk_high_water, import_rows, memory_limit, ssd_memory
from hpsray.plan.pipeline_cost import StageCosts
from hpsray.plan.sample import InputSize, read_sample
from hpsray.plan.tables import by_table, hbm_group_bytes, table_sizes
from hpsray.tables import with_first_order
from hpsray.tiers.mem import rows_for_bytes
from hpsray.tiers.ssd.probe import DiskBound

if TYPE_CHECKING:
    from hpsray.job import JobConfig
from hpsray.plan.sizing import (
    batch_bytes,
    hbm_capacity,
    hbm_table_bytes,
    mem_bytes_for_rows,
    mem_capacity_rows,
    ssd_live_bytes,
)

__all__ = ["DEFAULT_SAMPLE_ROWS", "Plan", "Problem", "check_plan", "make_plan"]

DEFAULT_SAMPLE_ROWS = 100_000
NEAR = 0.95  # a pinned working set above this share of the budget is worth a warning


@dataclass(frozen=True)
class Problem:
    """A reason the job fails (``error``) or runs worse than it could (``warning``), and its fix."""

    severity: str  # "error" | "warning"
    setting: str  # the dotted job key to change, e.g. "tiers.mem_rows"
    message: str
    fix: str  # e.g. "set [tiers] mem_rows >= 13,448"


@dataclass
class Plan:
    """Everything ``hpsray plan`` prints; :meth:`to_dict` is its ``--json``."""

    job: str
    nodes: int
    batch_size: int
    row_width: int
    input: InputSize
    keys: KeyEstimate
    per_node: dict
    calibration: Calibration | None
    predicted_examples_per_s: float | None
    stage_s_per_batch: dict | None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bottleneck: str | None = None  # the stage that sets the predicted rate, or "cores"

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["keys"]["per_node_distinct"] = self.keys.per_node_distinct
        return d


def _fmt(n: float) -> str:
    return f"{int(round(n)):,}"


def _free_bytes(path: str | None) -> tuple[str, int]:
    path = path or tempfile.gettempdir()
    probe = path
    while probe and not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        probe = parent if parent != probe else ""
    probe = probe or "."
    return probe, shutil.disk_usage(probe).free


def make_plan(
    job: JobConfig,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    calibrate_stages: bool = True,
    costs: StageCosts | None = None,
    disk_bound: DiskBound | None = None,
) -> Plan:
    """Plan ``job`` (a :class:`~hpsray.job.JobConfig`) from its first ``sample_rows`` examples
    (at least three global batches). ``calibrate_stages=False`` skips timing (no rate predicted);
    ``costs``: what the stage actors add on this machine (:mod:`~hpsray.plan.pipeline_cost`;
    without them the rate is the engines' alone, an upper bound); ``disk_bound``: the random-read
    bound of the SSD-PS disk (:mod:`~hpsray.plan.disk`; default: the cached one, if any), which
    the load stage pays for the missed rows the page cache cannot hold."""
    bound = disk_bound if disk_bound is not None else load_bound(job.tiers.ssd_path)
    nodes = job.cluster.nodes or 1
    notes = [] if job.cluster.nodes else ["cluster.nodes = 0 (every node of the cluster): planned for 1 node"]
    bs, p, cfg = job.pipeline.batch_size, job.pipeline, job.train_config()
    width = cfg.row_width
    sample = read_sample(job, max(int(sample_rows), 3 * bs * nodes))
    cfg = with_first_order(cfg, sample.n_slots)  # a model of first-order rows: their table too
    syn = job.data.synthetic
    tables = cfg.tables_for(sample.n_slots) if cfg.tables else None
    key_space = syn.keys * (tables.n_slots if tables else syn.slots) if syn is not None else None
    table_space = [syn.keys * len(spec.slots) for spec in tables.specs] if tables and syn is not None else None
    keys = estimate_keys(sample, nodes, key_space, table_space)
    if keys.pairs == 0 and not sample.complete:
        notes.append("the sample holds a single global batch: the pinned working set of two is not measured")
    if not sample.size.exact:
        notes.append(f"input size estimated ({sample.size.how})")

    capacity = mem_capacity_rows(job, sample.n_slots)
    history = dict(job.tiers.mem).get("history", 4.0)
    shard = keys.per_node_distinct
    hbm_cap = hbm_capacity(job, sample.n_slots)
    space_ratio = dict(job.tiers.ssd).get("max_space_ratio", 2.0) or 2.0
    sizes = table_sizes(tables, keys, capacity) if tables is not None and len(tables) > 1 else None
    grouped = hbm_group_bytes(tables, keys, hbm_cap) if tables and sizes and p.n_devices == 1 else None
    hbm_bytes, hbm_rows = grouped or hbm_table_bytes(hbm_cap, width, p.n_devices, keys.hbm_working_set_max)
    live = sum(t["ssd_live_bytes"] for t in sizes.values()) if sizes else ssd_live_bytes(shard, width)
    imported = import_rows(job.tiers.init_from) // nodes  # an import's rows, spread over the nodes
    ssd_rows = max(int(shard), imported)
    ssd_mem = ssd_memory(ssd_rows, width, imported)
    disk = disk_high_water(ssd_rows, width, shard, float(dict(job.tiers.ssd).get("compact_trigger", 1.5)), space_ratio)
    if imported:
        live = ssd_live_bytes(ssd_rows, width)
    ssd_dir, free = _free_bytes(job.tiers.ssd_path)
    examples_per_node_batch = bs
    batch_obj = batch_bytes(examples_per_node_batch, sample.keys_per_example, sample.n_dense)
    lent = keys.batch_distinct_mean / nodes
    in_flight = (p.read_queue + 2) * (batch_obj + 8 * lent) + 4 * keys.batch_distinct_mean / max(nodes, 1) * 4 * width
    hit_share = min(1.0, capacity / shard) if shard else 1.0
    ssd_rows_per_batch = lent * (1.0 - hit_share)

    cal = rate = stages = slowest = None
    dense_bytes = 0
    io_threads = int(dict(job.tiers.ssd).get("io_threads", 4))
    limit, limit_from = memory_limit()
    ssd_held = ssd_mem["key_map_bytes"] + ssd_mem["block_table_bytes"] + ssd_mem["heat_bytes"]  # SSD-PS's memory
    # the page cache gets what the node's other memory leaves (the trainer's dense bytes aside)
    held = RUNTIME_BYTES + ssd_held
    held += mem_bytes_for_rows(capacity, width, history) + int(in_flight)
    cold = cold_share(disk["expected_bytes"], limit - held)
    disk_row_s = disk_s_per_row(bound, io_threads, cold, width) if bound is not None else 0.0
    if calibrate_stages:
        cal = calibrate(job, sample)
        if not omp_threads_sleep():
            notes.append(
                "rate: this process's OpenMP threads spin (OMP_WAIT_POLICY), the stage actors' sleep: "
                "the stages were timed slower than they run"
            )
        if cal.memps_hit_rate is not None:  # MEM-PS itself at the job's budget, over the sample
            ssd_rows_per_batch = lent * (1.0 - cal.memps_hit_rate)
        batches = -(-keys.total_examples // (bs * nodes))  # of a pass, per node
        rate, stages = predict_rate(
            cal, examples_per_node_batch, lent, ssd_rows_per_batch, batch_obj, costs, max(batches, 1), disk_row_s
        )
        slowest = bottleneck(cal, stages, costs)
        notes.append(_costs_note(costs))
        notes.append(_disk_note(bound, io_threads, cold, ssd_rows_per_batch * disk_row_s))
        rate *= nodes
        dense_state = {"adam": 2, "adagrad": 1}.get(cfg.dense_optimizer, 0)
        dense_bytes = cal.dense_params * 4 * (2 + dense_state)  # weights, gradient, optimizer state

    per_node = {
        "mem_ps": {
            "capacity_rows": capacity,
            "capacity_bytes": mem_bytes_for_rows(capacity, width, history),
            "pinned_rows_max": keys.pinned_max,
            "pinned_rows_max_per_node": keys.pinned_max_per_node,
            "min_bytes": mem_bytes_for_rows(keys.pinned_max, width, history),
            "shard_rows": shard,
            "shard_bytes": mem_bytes_for_rows(int(shard), width, history),
            "resident_rows": min(float(capacity), shard),
            "hit_share": hit_share,
        },
        "trainer": {
            "hbm_capacity_rows": hbm_cap,
            "hbm_working_set_rows": keys.hbm_working_set_max,
            "hbm_table_rows": hbm_rows,
            "hbm_bytes": hbm_bytes,
            "dense_bytes": dense_bytes,
            "device_bytes": hbm_bytes + dense_bytes,
            "device": p.device,
        },
        "ssd_ps": {
            **ssd_mem,
            "live_bytes": live,
            "disk_bytes_expected": disk["expected_bytes"],
            "disk_bytes_max": int(live * space_ratio),
            "max_space_ratio": space_ratio,
            "path": ssd_dir,
            "free_bytes": free,
            "rows_per_batch": ssd_rows_per_batch,
            "cold_share": cold,
            "disk_reads_per_s": bound.at(load_depth(bound, io_threads)) if bound is not None else None,
            "disk_s_per_batch": ssd_rows_per_batch * disk_row_s,
        },
        "object_store_bytes": int(in_flight),
    }
    if sizes:
        per_node["tables"] = sizes
    memory = {
        "runtime_bytes": RUNTIME_BYTES,
        "key_map_bytes": ssd_held,
        "mem_ps_bytes": mem_bytes_for_rows(capacity, width, history),
        "object_store_bytes": int(in_flight),
        "trainer_bytes": hbm_bytes + dense_bytes if p.device == "cpu" else 0,
    }
    total = sum(memory.values())
    per_node["memory"] = {**memory, "total_bytes": total, "limit_bytes": limit, "limit_from": limit_from}
    per_node["host_bytes"] = total
    plan = Plan(
        job.where, nodes, bs, width, sample.size, keys, per_node, cal, rate, stages, notes=notes, bottleneck=slowest
    )
    plan.problems = _problems(job, plan, history)
    return plan


def _costs_note(costs: StageCosts | None) -> str:
    if costs is None:
        return (
            "rate: the stages' engines alone (no stage costs of this machine: hpsray plan --calibrate "
            "measures them): an upper bound"
        )
    ms = "/".join(f"{costs.fixed_s.get(s, 0.0) * 1000:.0f}" for s in ("read", "pull", "load", "train"))
    busy = " (a busy machine's: hpsray plan --calibrate on an idle one)" if costs.load > node_cores() else ""
    return (
        f"rate: stage costs of this machine (reference runs {costs.measured_at}, load {costs.load:.1f}{busy}): "
        f"fixed {ms} ms per batch (read/pull/load/train), stretch x{max(costs.stretch.values(), default=1.0):.1f}, "
        f"driver and Ray {costs.other_s * 1000:.0f} ms"
    )


def _disk_note(disk: DiskBound | None, io_threads: int, cold: float, seconds: float) -> str:
    if disk is None:
        return (
            "rate: no random-read bound of the SSD-PS disk (hpsray plan --calibrate measures it): "
            "rows missed by MEM-PS and the page cache cost the engine's seconds only"
        )
    depth = load_depth(disk, io_threads)
    return (
        f"rate: SSD-PS disk {disk.at(depth):,.0f} random reads/s of {disk.read_bytes} bytes at depth {depth} "
        f"({io_threads} I/O threads hinting their reads; measured {disk.measured_at}, load "
        f"{disk.load_average:.1f}); {cold:.0%} of missed rows "
        f"beyond the page cache: +{seconds * 1000:.0f} ms per batch in the load stage"
    )


def _problems(job: JobConfig, plan: Plan, history: float) -> list[Problem]:
    out = []
    mem, keys, bs = plan.per_node["mem_ps"], plan.keys, plan.batch_size
    need, cap = keys.pinned_max, mem["capacity_rows"]
    setting = "tiers.mem_bytes" if job.tiers.mem_bytes is not None else "tiers.mem_rows"

    def budget(rows: int) -> str:
        if setting == "tiers.mem_rows":
            return f"set [tiers] mem_rows >= {rows:,}"
        return f"set [tiers] mem_bytes >= {mem_bytes_for_rows(rows, plan.row_width, history):,}"

    if need > cap:
        smaller = max(1, int(bs * cap / need * 0.9))
        out.append(
            Problem(
                "error",
                setting,
                f"MEM-PS capacity {cap:,} rows per node: two consecutive batches of {bs:,} examples pin up to "
                f"{need:,} distinct rows at once (batch t trains while t+1 is pulled), so the run would stop with "
                "CapacityError",
                f"{budget(need)} (or lower [pipeline] batch_size to about {smaller:,})",
            )
        )
    elif need > NEAR * cap:
        out.append(
            Problem(
                "warning",
                setting,
                f"MEM-PS capacity {cap:,} rows per node holds the {need:,} rows two consecutive sampled batches "
                f"pin with less than {100 - NEAR * 100:.0f} % to spare; batches outside the sample may not fit",
                f"{budget(int(need / NEAR) + 1)} for headroom",
            )
        )
    tr = plan.per_node["trainer"]
    if tr["hbm_working_set_rows"] > tr["hbm_capacity_rows"]:
        out.append(
            Problem(
                "warning",
                "pipeline.hbm_rows",
                f"the trainer's working set ({tr['hbm_working_set_rows']:,} rows) outgrows its HBM-PS tables "
                f"({tr['hbm_capacity_rows']:,} rows); they will double while training",
                f"set [pipeline] hbm_rows >= {int(tr['hbm_working_set_rows'] * 1.1):,}",
            )
        )
    ssd = plan.per_node["ssd_ps"]
    if ssd["disk_bytes_max"] > ssd["free_bytes"]:
        out.append(
            Problem(
                "error",
                "tiers.ssd_path",
                f"SSD-PS needs up to {ssd['disk_bytes_max']:,} bytes per node (live rows × {ssd['max_space_ratio']:g} "
                f"compaction headroom{by_table(plan.per_node.get('tables'), 'ssd_live_bytes')}) but {ssd['path']} "
                f"has {ssd['free_bytes']:,} free",
                f"set [tiers] ssd_path to a disk with >= {ssd['disk_bytes_max']:,} bytes free, or raise cluster.nodes",
            )
        )
    out.extend(_memory_problems(job, plan))
    return out


def _memory_problems(job: JobConfig, plan: Plan) -> list[Problem]:
    """The node's memory cannot hold what it must (:mod:`~hpsray.plan.footprint`): name the part
    to shrink — the key map (more nodes) when it does not fit even beside the smallest MEM-PS,
    else MEM-PS's budget."""
    m, ssd, width = plan.per_node["memory"], plan.per_node["ssd_ps"], plan.row_width
    need, limit = m["total_bytes"], m["limit_bytes"]
    if need <= limit:
        return []
    parts = ", ".join(
        f"{k.removesuffix('_bytes').replace('_', ' ')} {m[k]:,}"
        for k in ("runtime_bytes", "key_map_bytes", "mem_ps_bytes", "object_store_bytes", "trainer_bytes")
    )
    what = f"a node needs ~{need:,} bytes of memory ({parts}) but may use {limit:,} ({m['limit_from']})"
    what += by_table(plan.per_node.get("tables"), "mem_ps_bytes").replace("(by table", "(MEM-PS by table", 1)
    history = dict(job.tiers.mem).get("history", 4.0)
    others = need - m["key_map_bytes"] - m["mem_ps_bytes"] + mem_bytes_for_rows(plan.keys.pinned_max, width, history)
    if m["key_map_bytes"] + others > limit:
        room = limit - others
        nodes = int(plan.nodes * m["key_map_bytes"] / room) + 1 if room > 0 else 0
        fix = f"raise cluster.nodes to >= {nodes:,} (the keys spread over the nodes)" if nodes else "more memory"
        why = f"the SSD-PS key map of {ssd['rows']:,} keys per node alone takes {m['key_map_bytes']:,}"
        return [Problem("error", "cluster.nodes", f"{what}: {why}", fix)]
    budget = m["mem_ps_bytes"] - (need - limit)
    if job.tiers.mem_bytes is not None:
        return [Problem("error", "tiers.mem_bytes", what, f"set [tiers] mem_bytes <= {budget:,}")]
    rows = rows_for_bytes(budget, width, history)
    return [Problem("error", "tiers.mem_rows", what, f"set [tiers] mem_rows <= {rows:,}")]


def check_plan(plan: Plan) -> None:
    """Raise :class:`~hpsray.errors.CapacityError` naming every fix when the plan has errors."""
    errors = plan.errors
    if errors:
        raise CapacityError(
            f"{plan.job}: the job cannot fit: " + "; ".join(f"{e.setting}: {e.message}; fix: {e.fix}" for e in errors)
        )
