"""``hpsray plan JOB.toml``: what a job needs per node, how fast it will run, and what to change.

Reads a sample of the job's data with the job's own readers, estimates distinct keys per batch
and in all, and prints per node the MEM-PS rows and bytes needed, the trainer's memory, SSD-PS
bytes with compaction headroom, object-store bytes in flight and a predicted examples/s from a
short calibration of each stage on this machine, plus what the stage actors add on this machine
(:mod:`hpsray.job.probe`: measured with a local Ray only with ``--calibrate``, then cached
unless the machine was busy; without it the cached costs, or the engines' rate alone: the
command starts no Ray). Exit status 1 when the job cannot fit (each problem
names the setting and the number), 2 for a bad job file.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = (
    "size a TOML job before training: MEM-PS rows, trainer and SSD bytes, predicted examples/s, "
    "the fix if it cannot fit"
)

EXIT_CONFIG = 2
EXIT_WONT_FIT = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hpsray.plan import DEFAULT_SAMPLE_ROWS

    parser.add_argument("config", metavar="JOB.toml", help="the job file (see examples/train.toml)")
    parser.add_argument(
        "--sample-rows",
        type=int,
        default=DEFAULT_SAMPLE_ROWS,
        metavar="N",
        help=f"examples to sample (at least three global batches; default {DEFAULT_SAMPLE_ROWS:,})",
    )
    parser.add_argument("--no-calibrate", action="store_true", help="skip timing the stages (no predicted rate)")
    parser.add_argument(
        "--calibrate",
        "--recalibrate",
        action="store_true",
        help="time the stage actors on this machine with a local Ray (~15 s idle) and cache their costs "
        "(not when the machine is busy); without it the plan starts no Ray and uses the cached costs, if any",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from hpsray.errors import ConfigError, DataError
    from hpsray.job import JobConfig
    from hpsray.job.inputs import check_inputs
    from hpsray.plan import make_plan, render

    if args.sample_rows < 1:
        print(f"hpsray plan: error: --sample-rows must be >= 1, got {args.sample_rows}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        job = JobConfig.load(args.config)
        check_inputs(job)  # a missing path or column: the job's mistake, in every bad-input mode
        costs = disk = None
        if args.calibrate and args.no_calibrate:
            print("hpsray plan: error: --calibrate and --no-calibrate contradict each other", file=sys.stderr)
            return EXIT_CONFIG
        if not args.no_calibrate:
            from hpsray.job.probe import cached_costs, stage_costs

            costs = stage_costs(recalibrate=True) if args.calibrate else cached_costs()
            if args.calibrate:  # the SSD-PS disk's random-read bound (hpsray.plan.disk)
                from hpsray.plan.disk import measure_bound

                threads = int(dict(job.tiers.ssd).get("io_threads", 4))
                disk, why = measure_bound(job.tiers.ssd_path, job.train_config().row_width, threads)
                print(f"hpsray plan: disk bound {'NOT cached: ' + why if why else 'cached'}", file=sys.stderr)
        plan = make_plan(job, args.sample_rows, calibrate_stages=not args.no_calibrate, costs=costs, disk_bound=disk)
    except (ConfigError, DataError) as e:
        print(f"hpsray plan: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except ValueError as e:
        print(f"hpsray plan: error: {args.config}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(json.dumps(plan.to_dict(), indent=2, default=str) if args.json else render(plan))
    return EXIT_WONT_FIT if plan.errors else 0
