"""``hpsray bench outofcore``: training a model far larger than its MEM-PS budget.

Two runs of the same pipeline over the same planted data, one after the other: **out-of-core**
(MEM-PS holds ``--budget-batches`` x a batch's distinct keys, the rest lives in SSD-PS) and
**in-memory** (MEM-PS holds every row). Returns both runs' examples/s and their ratio, the scale
factor (model rows / budget rows), hit rates, SSD-PS I/O per batch, compactions and, unless
``--no-check``, a lossless comparison of the two models. How the model gets its size and what
is timed: docs/benchmarks.md, section "What each bench measures" (`bench outofcore`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, Pipeline, SSDPSSettings, SyntheticSource, TrainerSettings

    # ((keys sorted, rows), dense state_dict) of one trained model
    Trained = tuple[tuple[np.ndarray, np.ndarray], dict[str, torch.Tensor]]

HELP = "training with a model >= 40x the MEM-PS budget (rows on SSD-PS) vs the same model held in memory"

TORCHREC_ANCHOR = {"source": "TorchRec embedding offloading", "model_scale": 37.0, "slowdown": 0.26}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size",
        type=float,
        default=1.0,
        help="scale data volume and vocabulary together (default 1: ~7M trained rows, a few minutes)",
    )
    parser.add_argument("--rows", type=int, default=1_200_000, help="training examples at --size 1")
    parser.add_argument("--batch", type=int, default=4096, help="examples per batch")
    parser.add_argument("--warmup-batches", type=int, default=4, help="batches trained before timing")
    parser.add_argument("--minibatch", type=int, default=4096, help="examples per gradient step")
    parser.add_argument("--slots", type=int, default=26)
    parser.add_argument("--keys", type=int, default=5_000_000, help="vocabulary per slot at --size 1")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the key ranks")
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--optimizer", default="adagrad", help="sparse optimizer (rows carry its state)")
    parser.add_argument("--hidden", default="512,256,128")
    parser.add_argument(
        "--budget-batches",
        type=float,
        default=2.5,
        help="MEM-PS budget in units of a batch's distinct keys (> 2: two batches are pinned "
        "while the next one's misses come in)",
    )
    parser.add_argument("--scale-target", type=float, default=40.0, help="model rows / budget rows to reach")
    parser.add_argument("--rows-per-file", type=int, default=None, help="SSD-PS rows per file (default: its own)")
    parser.add_argument("--trainer-threads", type=int, default=None)
    parser.add_argument("--dir", default=None, help="directory for SSD-PS (default: a temporary one)")
    parser.add_argument(
        "--report-dir", default=None, help="write outofcore.json / inmemory.json with stage tables and PNG plots here"
    )
    parser.add_argument(
        "--tables",
        type=int,
        default=1,
        help="split the slots into this many [[tables]] (the first holds half of them at --dim; the second "
        "pools by the mean at half the dim, the third trains with Adam at a quarter of it)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the lossless comparison of the two models")
    parser.add_argument("--seed", type=int, default=0)


def _log(msg: str) -> None:
    print(f"[bench outofcore] {msg}", file=sys.stderr, flush=True)


def _max_distinct(gen: PlantedCTR, batch: int, n: int) -> int:
    """Largest number of distinct keys in the first ``n`` batches of the stream."""
    return max(int(np.unique(b.keys).size) for b in gen.batches(n * batch, batch))


def table_specs(n_tables: int, n_slots: int, dim: int, sparse_lr: float) -> tuple:
    """``--tables``: ``n_tables`` tables of their own over ``n_slots`` slots, the first of half of
    them at ``dim`` (the job's optimizer), the rest split evenly: table 1 pools by the mean at half
    the dim, table 2 trains with Adam at a quarter of it (the issue's mix of widths, optimizers and
    poolings), any further table at ``dim`` and half the learning rate."""
    from hpsray.tables import TableSpec

    if n_tables <= 1:
        return ()
    if n_tables > n_slots:
        raise ValueError(f"--tables {n_tables}: more tables than slots ({n_slots})")
    first = max(1, n_slots // 2)
    rest = np.array_split(np.arange(first, n_slots), n_tables - 1)
    groups = [list(range(first))] + [g.tolist() for g in rest]
    specs = []
    for i, g in enumerate(groups):
        slots = tuple(int(x) for x in g)
        if i == 1:
            specs.append(TableSpec(f"t{i}", slots, max(1, dim // 2), pooling="mean"))
        elif i == 2:
            specs.append(TableSpec(f"t{i}", slots, max(1, dim // 4), optimizer="adam", lr=0.01))
        else:
            specs.append(TableSpec(f"t{i}", slots, dim, lr=sparse_lr / 2 if i > 2 else None))
    return tuple(specs)


def _fit(
    source_warm: SyntheticSource,
    source: SyntheticSource,
    trainer: TrainerSettings,
    mem: MemPSSettings,
    ssd: SSDPSSettings,
    batch: int,
) -> tuple[dict, dict, Pipeline]:
    """Warm up, time one pass; returns (pipeline report, SSD-PS and MEM-PS stats, the open pipeline)."""
    from hpsray.pipelines import Pipeline

    p = Pipeline(source_warm, trainer, mem, ssd, batch_size=batch)
    p.__enter__()
    try:
        p.fit(progress=False)
        p.source = source
        report = p.fit(progress=False)
        ssd_actor = p.actors()["SSDPS[node 0]"]
        mem_actor = p.actors()["MemPS[node 0]"]
        import ray

        store = ray.get(ssd_actor.stats.remote())["store"]
        cache = ray.get(mem_actor.stats.remote())["cache"]
        return report, {"store": store, "cache": cache}, p
    except BaseException:
        p.shutdown()
        raise


def _summary(report: dict, extra: dict, batches: int) -> dict:
    per = report.get("per_batch_s", {})
    load = [v for k, v in per.get("load", {}).items() if int(k) >= 0]
    hits = list(report.get("cache_hit_rate", {}).values())
    store = extra["store"]
    # MEM-PS only names a batch's missing rows; the load stage's counts come with the run report
    cache = {**extra["cache"], **{k: v for k, v in report.get("cache", {}).items() if k in ("loaded", "initialised")}}
    return {
        "examples_per_s": report["examples_per_s"],
        "wall_s": report["wall_s"],
        "batches": report["batches"],
        "pipeline_efficiency": report["pipeline_efficiency"],
        "stage_busy_s": report["stage_busy_s"],
        "stage_cpu_s": report.get("stage_cpu_s"),
        "cache_hit_rate_mean": float(np.mean(hits)) if hits else None,
        "cache_hit_rate_min": float(np.min(hits)) if hits else None,
        "cache_hit_rate_last": float(hits[-1]) if hits else None,
        "ssd_io_s_per_batch": float(np.sum(load) / max(batches, 1)),
        "ssd_io_s_per_batch_max": float(np.max(load)) if load else 0.0,
        "rows_loaded_from_ssd": int(cache.get("loaded", 0)),
        "rows_initialised": int(cache.get("initialised", 0)),
        "rows_evicted": int(cache.get("evicted", 0)),
        "rows_evicted_dirty": int(cache.get("evicted_dirty", 0)),
        "ssd": {
            k: store.get(k)
            for k in (
                "loads",
                "bytes_read",
                "files_read",
                "files_read_partially",
                "load_seconds",
                "load_cpu_seconds",
                "reads_issued",
                "reads_mapped",
                "reads_ring",
                "dumps",
                "bytes_written",
                "dump_seconds",
                "compactions",
                "files_compacted",
                "compaction_bytes_read",
                "compaction_bytes_written",
                "compaction_seconds",
                "backpressure_waits",
                "files",
                "live_rows",
                "disk_bytes",
                "space_ratio",
            )
        },
    }


def run(args: argparse.Namespace) -> dict:
    import ray

    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, SSDPSSettings, SyntheticSource, TrainerSettings
    from hpsray.pipelines.report import format_stage_table, write_report

    hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    rows = max(args.batch * (args.warmup_batches + 2), int(round(args.rows * args.size)))
    keys_per_slot = max(1000, int(round(args.keys * args.size)))
    cfg = TrainConfig(
        dim=args.dim, hidden=hidden, minibatch_size=args.minibatch, seed=args.seed, sparse_optimizer=args.optimizer
    )
    tables = table_specs(args.tables, args.slots, args.dim, cfg.sparse_lr)
    if tables:
        cfg = dataclasses.replace(cfg, tables=tables)
    gen = PlantedCTR(
        n_slots=args.slots, keys_per_slot=keys_per_slot, n_dense=args.dense, zipf_a=args.zipf, seed=args.seed
    )
    warm_rows = args.warmup_batches * args.batch
    warm = SyntheticSource(gen, rows=warm_rows)
    measured = SyntheticSource(gen, rows=rows - warm_rows, start_row=warm_rows)
    batches = -(-(rows - warm_rows) // args.batch)

    per_batch = _max_distinct(gen, args.batch, min(8, -(-rows // args.batch)))
    budget = int(math.ceil(args.budget_batches * per_batch * 1.05))  # 5 % margin over the sample
    ssd_opts = {"rows_per_file": args.rows_per_file} if args.rows_per_file else {}
    base = tempfile.mkdtemp(prefix="hpsray-bench-outofcore-", dir=args.dir)
    out: dict = {
        "config": {
            "rows": rows,
            "warmup_rows": warm_rows,
            "batch": args.batch,
            "minibatch": args.minibatch,
            "slots": args.slots,
            "keys_per_slot": keys_per_slot,
            "zipf": args.zipf,
            "dim": args.dim,
            "optimizer": args.optimizer,
            "row_width": cfg.row_width,
            "hidden": list(hidden),
            "max_distinct_keys_per_batch_sampled": per_batch,
            "budget_rows": budget,
            "budget_batches": args.budget_batches,
            "dir": base,
            "size": args.size,
            "ssd_options": ssd_opts,
            "tables": [
                {"name": t.name, "slots": len(t.slots), "dim": t.dim, "pooling": t.pooling, "optimizer": t.optimizer}
                | {"lr": t.lr}
                for t in tables
            ],
        },
        "anchor": TORCHREC_ANCHOR,
    }
    started = not ray.is_initialized()
    if started:  # a fresh embedded Ray unless RAY_ADDRESS names a cluster (not whatever else runs here)
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=False)
    try:
        trainer = TrainerSettings(cfg, threads=args.trainer_threads)
        _log(
            f"out-of-core run: MEM-PS budget {budget:,} rows ({args.budget_batches} x {per_batch:,} distinct "
            f"keys per batch), {rows:,} examples ..."
        )
        ooc_report, ooc_extra, p = _fit(
            warm,
            measured,
            trainer,
            MemPSSettings(capacity_rows=budget),
            SSDPSSettings(path=os.path.join(base, "ooc"), options=ssd_opts),
            args.batch,
        )
        try:
            ooc_rows: Trained | None = None
            if not args.no_check:
                ooc_rows = p.export_rows(), p.dense_state()
                total = int(ooc_rows[0][0].size)
            else:
                ray.get(p.actors()["MemPS[node 0]"].flush.remote())
                total = int(ray.get(p.actors()["SSDPS[node 0]"].stats.remote())["store"]["live_rows"])
        finally:
            p.shutdown()
        _log(f"model rows {total:,} = {total / budget:.1f} x the budget; in-memory run ...")
        mem_report, mem_extra, p = _fit(
            warm,
            measured,
            trainer,
            MemPSSettings(capacity_rows=total + 4096),
            SSDPSSettings(path=os.path.join(base, "mem"), options=ssd_opts),
            args.batch,
        )
        try:
            mem_rows = (p.export_rows(), p.dense_state()) if not args.no_check else None
        finally:
            p.shutdown()
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)

    ooc = _summary(ooc_report, ooc_extra, batches)
    mem = _summary(mem_report, mem_extra, batches)
    ratio = ooc["examples_per_s"] / mem["examples_per_s"]
    scale = total / budget
    out.update(
        {
            "examples_per_s": ooc["examples_per_s"],
            "in_memory_examples_per_s": mem["examples_per_s"],
            "ratio_vs_in_memory": ratio,
            "slowdown": 1.0 - ratio,
            "scale_factor": scale,
            "model_rows": total,
            "budget_rows": budget,
            "model_bytes": total * cfg.row_width * 4,
            "budget_bytes": budget * cfg.row_width * 4,
            "cache_hit_rate_mean": ooc["cache_hit_rate_mean"],
            "ssd_io_s_per_batch": ooc["ssd_io_s_per_batch"],
            "compactions": ooc["ssd"]["compactions"],
            "out_of_core": ooc,
            "in_memory": mem,
        }
    )
    if ooc_rows is not None and mem_rows is not None:
        out["lossless"] = _compare(ooc_rows, mem_rows)
    out["checks"] = {"scale_ge_40": scale >= 40.0, "throughput_ge_80pct_in_memory": ratio >= 0.8}
    if tables:
        out["tables"] = _per_table(tables, ooc_report, mem_rows or ooc_rows, budget)
        biggest = max(t["scale_factor"] for t in out["tables"].values()) if out["tables"] else 0.0
        out["checks"]["biggest_table_ge_20x"] = biggest >= 20.0
        out["checks"]["throughput_ge_85pct_in_memory"] = ratio >= 0.85
    if "lossless" in out:
        out["checks"]["lossless"] = out["lossless"]["equal"]
    if args.report_dir:
        os.makedirs(args.report_dir, exist_ok=True)
        written = []
        for name, rep in (("outofcore", ooc_report), ("inmemory", mem_report)):
            path = os.path.join(args.report_dir, f"{name}.json")
            written += write_report(rep, path)
            with open(os.path.join(args.report_dir, f"{name}.txt"), "w") as f:
                f.write(format_stage_table(rep) + "\n")
        with open(os.path.join(args.report_dir, "summary.json"), "w") as f:
            json.dump({k: v for k, v in out.items() if k not in ("out_of_core", "in_memory")}, f, indent=2, default=str)
        out["report_files"] = written
        _log("out-of-core run:\n" + format_stage_table(ooc_report))
        _log("in-memory run:\n" + format_stage_table(mem_report))
    return out


def _per_table(tables: tuple, report: dict, trained: Trained | None, budget: int) -> dict:
    """Per table: its rows (from the trained model's tagged keys; ``None`` with ``--no-check``),
    their multiple of the MEM-PS budget, and the out-of-core run's per-table figures."""
    figures = report.get("tables") or {}
    out = {}
    for t, spec in enumerate(tables):
        rows = int(np.count_nonzero((trained[0][0] >> np.uint64(56)) == t)) if trained is not None else None
        out[spec.name] = {
            "slots": len(spec.slots),
            "dim": spec.dim,
            "pooling": spec.pooling,
            "rows": rows,
            "scale_factor": rows / budget if rows is not None else 0.0,
            **{
                k: figures.get(spec.name, {}).get(k)
                for k in ("row_bytes", "hit_rate", "ssd_rows_loaded", "ssd_bytes_loaded", "ssd_live_bytes")
            },
        }
    return out


def _compare(a: Trained, b: Trained, tol: float = 1e-5) -> dict:
    """Rows and dense weights of two trained models (keys sorted) compared."""
    (ka, ra), da = a
    (kb, rb), db = b
    same_keys = ka.size == kb.size and bool(np.array_equal(ka, kb))
    row_diff = float(np.max(np.abs(ra - rb))) if same_keys and ka.size else (0.0 if same_keys else math.inf)
    dense_diff = 0.0
    for name, t in da.items():
        dense_diff = max(dense_diff, float((t.float() - db[name].float()).abs().max()) if t.numel() else 0.0)
    return {
        "rows": int(ka.size),
        "rows_other": int(kb.size),
        "same_keys": same_keys,
        "max_abs_row_diff": row_diff,
        "max_abs_dense_diff": dense_diff,
        "tolerance": tol,
        "equal": bool(same_keys and row_diff <= tol and dense_diff <= tol),
    }
