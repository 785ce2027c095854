"""``hpsray bench serve``: the latency–throughput curve of ``POST /predict`` against its baselines.

One Ray Serve instance on loopback, one replica per system (``--systems``: hpsray tiered, all in
memory or device-driven; RocksDB; an ``EmbeddingBag`` bound), driven round-robin by an aiohttp
client; beside it each system's ``predict`` in process, the tiered model's two miss readers warm
and cold, and with ``--delta`` the cost of following one incremental export. Returns the report
(headline ``examples_per_s``, ``p50_ms``, ``p99_ms``, the ratios to the baselines, ``curves``,
``in_process``, ``ssd_read``, ``delta``). What each system and figure is, and how it is measured:
docs/serving.md, section "Figures" ("How `hpsray bench serve` measures").

Parts: :mod:`~hpsray.bench.serve_workload` (systems, model, requests), :mod:`~hpsray.bench.serve_http`
(the HTTP runs) and :mod:`~hpsray.bench.serve_in_process` (the runs without HTTP).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from hpsray.bench.serve_http import serve_runs
from hpsray.bench.serve_in_process import follow_delta, in_process, ssd_read
from hpsray.bench.serve_workload import DEFAULT_SYSTEMS, SSD_READ, SYSTEMS, make_model, request_bodies

HELP = "serving: examples/s, p50, p99 of POST /predict at 5 %% of rows in memory vs RocksDB and all in memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="embedding rows of the model (default 1M)")
    parser.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    parser.add_argument("--mem-fraction", type=float, default=0.05, help="rows in memory for 'tiered' (default 0.05)")
    parser.add_argument("--batch-sizes", default="1,32,256", help="examples per request (default 1,32,256)")
    parser.add_argument("--concurrency", default="1,16", help="concurrent clients (default 1,16)")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="measured seconds per system, point and round (default 2)"
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"subset of {','.join(SYSTEMS)} (default {DEFAULT_SYSTEMS['cpu']}; with --device cuda "
        f"{DEFAULT_SYSTEMS['cuda']})",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: 'tiered' is the CPU-driven GPU path, 'driven' the device-driven one, side by side",
    )
    parser.add_argument(
        "--device-fraction",
        type=float,
        default=0.01,
        help="of the rows in memory (--mem-fraction), the fraction of all rows held in the device tier "
        "by the GPU paths and 'driven' (default 0.01)",
    )
    parser.add_argument("--no-ssd-read", action="store_true", help="skip the in-process mmap vs block-read comparison")
    parser.add_argument("--repeat", type=int, default=3, help="round-robin rounds per point; medians (default 3)")
    parser.add_argument("--port", type=int, default=8777)
    parser.add_argument("--dir", default=None, help="directory for the model (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--delta",
        action="store_true",
        help="also time following an incremental export (5 %% of rows changed, 1 %% removed, 1 %% new): "
        "the point store merged from the base's vs laid out from load_export, the swap's load, the hit rate after "
        "it (with --systems '' only this)",
    )


def run(args: argparse.Namespace) -> dict:
    if args.systems is None:
        args.systems = DEFAULT_SYSTEMS[args.device]
    systems = [s for s in args.systems.split(",") if s]
    bad = set(systems) - set(SYSTEMS)
    if bad:
        raise SystemExit(f"--systems: unknown {sorted(bad)} (known: {', '.join(SYSTEMS)})")
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="hpsray-bench-serve-")
    model_dir = os.path.join(work, "model")
    t0 = time.perf_counter()
    gen = make_model(model_dir, args.rows, args.dim, seed=args.seed)
    from hpsray.serving.layout import build_point_store

    build_point_store(model_dir)
    build_s = time.perf_counter() - t0
    bodies = {b: request_bodies(gen, b, max(8, min(400, 20_000 // b))) for b in batch_sizes}

    local: dict = {}
    reads: dict = {}
    curves: dict[str, list[dict]] = {}
    stats: dict[str, dict] = {}
    delta = None
    try:
        if systems:
            local = in_process(
                model_dir,
                bodies[batch_sizes[-1]],
                args.mem_fraction,
                systems,
                args.repeat,
                args.device,
                args.device_fraction,
            )
            if not args.no_ssd_read and "tiered" in systems:
                reads = ssd_read(model_dir, bodies[batch_sizes[-1]], args.mem_fraction, args.repeat)
            curves, stats = serve_runs(args, model_dir, systems, bodies, batch_sizes, concurrency)
        if args.delta:
            delta = follow_delta(model_dir, gen, args.dim, args.mem_fraction, args.seed, args.repeat)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    def head(system: str) -> dict:
        pts = curves.get(system) or [{}]
        return pts[-1]

    from hpsray.serving.layout import row_stride

    report: dict = {
        "rows": int(args.rows),
        "dim": args.dim,
        "device": args.device,
        "mem_fraction": args.mem_fraction,
        "device_fraction": args.device_fraction,
        "headline_point": {"batch": batch_sizes[-1], "concurrency": max(concurrency)},
        "model_build_s": build_s,
    }
    t, r, m, bnd = head("tiered"), head("rocksdb"), head("memory"), head("bound")
    report["examples_per_s"] = t.get("examples_per_s")
    report["p50_ms"] = t.get("p50_ms")
    report["p99_ms"] = t.get("p99_ms")
    report["memory_examples_per_s"] = m.get("examples_per_s")
    report["rocksdb_examples_per_s"] = r.get("examples_per_s")
    report["rocksdb_p50_ms"] = r.get("p50_ms")
    report["cpu_ms_per_request"] = {s: head(s).get("cpu_ms_per_request") for s in systems}
    report["in_memory_bound_examples_per_s"] = bnd.get("examples_per_s")
    if t and r:
        report["vs_rocksdb"] = t["examples_per_s"] / r["examples_per_s"]
        met = report["vs_rocksdb"] >= 2 and t["p50_ms"] <= r["p50_ms"]
        report["target_2x_rocksdb_at_equal_or_lower_p50"] = bool(met)
    if t and bnd:
        report["vs_bound"] = t["examples_per_s"] / bnd["examples_per_s"]
        report["target_half_of_bound"] = bool(report["vs_bound"] >= 0.5)
    report["in_process"] = local
    if "tiered" in local and "rocksdb" in local:
        report["in_process_vs_rocksdb"] = local["tiered"]["examples_per_s"] / local["rocksdb"]["examples_per_s"]
    if "tiered" in local and "bound" in local:
        report["in_process_vs_bound"] = local["tiered"]["examples_per_s"] / local["bound"]["examples_per_s"]
    if "tiered" in local and "driven" in local:
        report["in_process_driven_vs_tiered"] = local["driven"]["examples_per_s"] / local["tiered"]["examples_per_s"]
        if args.device == "cuda":
            report["target_device_driven_1_5x_cpu_driven"] = bool(report["in_process_driven_vs_tiered"] >= 1.5)
    for system in SSD_READ:
        if system in curves and r:
            report[f"{system.replace('-', '_')}_vs_rocksdb"] = head(system)["examples_per_s"] / r["examples_per_s"]
    if "driven" in curves and "tiered" in curves:
        report["driven_vs_tiered"] = head("driven")["examples_per_s"] / t["examples_per_s"]
    if reads:
        report["ssd_read"] = reads
        report["in_process_tiered_blocks_vs_mmap"] = reads["blocks_vs_mmap"]
    sources = [reads.get("blocks", {})] + [local.get(s, {}) for s in ("tiered", "tiered-blocks", "driven")]
    measured = [x["reads_per_missed_row"] for x in sources if x.get("reads_per_missed_row")]
    report["reads_per_missed_row"] = measured[0] if measured else None
    report["row_bytes_natural"] = 4 * args.dim
    in_mem = [
        local[s]["row_bytes_in_memory"] for s in ("driven", "tiered") if "row_bytes_in_memory" in local.get(s, {})
    ]
    report["row_bytes_in_memory"] = in_mem[0] if in_mem else None
    report["row_bytes_padded"] = row_stride(args.dim)
    report["row_bytes_by_dim"] = {d: {"natural": 4 * d, "padded": row_stride(d)} for d in (8, 16, 20, 33, 64, 100)}
    report["errors"] = sum(p["errors"] for pts in curves.values() for p in pts)
    report["curves"] = {
        s: [{k: v for k, v in p.items() if k != "error_samples"} for p in pts] for s, pts in curves.items()
    }
    report["replica_stats"] = {
        s: {k: v for k, v in st.items() if k not in ("load", "pid", "directory")} for s, st in stats.items()
    }
    if delta is not None:
        report["delta"] = delta
    return report
