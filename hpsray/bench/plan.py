"""``hpsray bench plan``: the capacity planner's predictions against measured runs.

For the demo's job (``hpsray demo``: Parquet click log, MEM-PS at 2.5 batches of distinct keys, rows
spilling to SSD-PS) at ``--rows`` and at half and twice that size: ``hpsray plan``'s predicted
examples/s, MEM-PS resident rows, distinct rows and SSD-PS bytes, then one real pipeline run
(an embedded Ray) and what it measured — the run report's examples/s and ``cache.size``, the rows
exported, and the bytes in the SSD-PS directory after the flush — and each ratio predicted / measured;
beside them each stage's seconds per batch and the bottleneck, predicted and measured. The plans use
this machine's cached stage costs (``hpsray.job.probe``; ``--recalibrate`` times them again
first, as an idle rerun should).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpsray.plan.pipeline_cost import StageCosts

HELP = "capacity planner: predicted vs measured examples/s, MEM-PS rows, distinct rows and SSD bytes (3 job sizes)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rows",
        type=int,
        default=100_000,
        help="training examples of the demo job (also run at half and twice; default 100000)",
    )
    parser.add_argument("--sample-rows", type=int, default=None, help="the plan's sample (default: hpsray plan's)")
    parser.add_argument(
        "--recalibrate", action="store_true", help="time the stage actors on this machine again before planning"
    )


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _one(rows: int, sample_rows: int | None, costs: StageCosts | None) -> dict:
    from hpsray.job import build
    from hpsray.job.demo import demo_config
    from hpsray.plan import DEFAULT_SAMPLE_ROWS, make_plan
    from hpsray.plan.sizing import ssd_live_bytes

    with tempfile.TemporaryDirectory(prefix="hpsray-bench-plan-") as work:
        job = demo_config(work, rows)
        ssd_dir = os.path.join(work, "ssd")  # demo_config's SSD-PS
        t0 = time.perf_counter()
        plan = make_plan(job, sample_rows or DEFAULT_SAMPLE_ROWS, costs=costs)
        plan_s = time.perf_counter() - t0
        with build.pipeline(job) as pipe:
            report = pipe.fit(progress=False)
            keys, _ = pipe.export_rows()  # flushes MEM-PS: every row on SSD-PS once
            disk = _dir_bytes(ssd_dir)
        width = plan.row_width
        mem = plan.per_node["mem_ps"]
        predicted = {
            "examples_per_s": plan.predicted_examples_per_s,
            "mem_rows_resident": mem["resident_rows"],
            "mem_rows_min": mem["pinned_rows_max"],
            "distinct_rows": plan.keys.total_distinct,
            "ssd_live_bytes": plan.per_node["ssd_ps"]["live_bytes"],
            "ssd_disk_bytes_max": plan.per_node["ssd_ps"]["disk_bytes_max"],
        }
        measured = {
            "examples_per_s": report["examples_per_s"],
            "mem_rows_resident": report["cache"]["size"],
            "mem_rows_min": None,
            "distinct_rows": int(keys.size),
            "ssd_live_bytes": ssd_live_bytes(keys.size, width),
            "ssd_disk_bytes_max": disk,
        }
        ratio = {k: (predicted[k] / measured[k] if measured[k] else None) for k in predicted}
        return {
            "rows": job.data.synthetic.rows if job.data.synthetic else plan.input.rows,
            "batch_size": job.pipeline.batch_size,
            "mem_rows": job.tiers.mem_rows,
            "plan_s": plan_s,
            "predicted": predicted,
            "measured": measured,
            "predicted_over_measured": ratio,
            "stage_s_per_batch_predicted": plan.stage_s_per_batch,
            "stage_s_per_batch_measured": {k: v / max(report["batches"], 1) for k, v in report["stage_busy_s"].items()},
            "stage_busy_s_measured": report["stage_busy_s"],
            "bottleneck_predicted": plan.bottleneck,
            "bottleneck_measured": max(report["stage_busy_s"], key=report["stage_busy_s"].get),
            "pipeline_efficiency_measured": report["pipeline_efficiency"],
            "memps_hit_rate": {
                "predicted": plan.calibration.memps_hit_rate if plan.calibration else None,
                "measured": report["cache"].get("hit_rate"),
            },
            "calibration_s": plan.calibration.seconds if plan.calibration else None,
            "batches": report["batches"],
        }


def run(args: argparse.Namespace) -> dict:
    if args.rows < 40:
        raise ValueError(f"--rows must be >= 40, got {args.rows}")
    from hpsray.job.probe import stage_costs

    costs = stage_costs(recalibrate=args.recalibrate)
    sizes = {"half": args.rows // 2, "demo": args.rows, "double": 2 * args.rows}
    return {"jobs": {name: _one(rows, args.sample_rows, costs) for name, rows in sizes.items()}}
