"""``hpsray demo``: the whole system in a minute or two on one machine.

It writes a synthetic click log (Parquet, from a planted model) into a work directory, writes a
job file for it, starts an embedded Ray, and trains with a MEM-PS budget well below the number
of distinct keys, so rows are evicted to SSD-PS and loaded back while training. It prints the
held-out AUC, throughput and the stage table; the job file it leaves behind reruns the same
training with ``hpsray train WORKDIR/job.toml``. The embedded Ray runs without its dashboard
(``ray.init`` waits ~1.5 s for it to come up, and it would close with the demo a few seconds
later); ``--dashboard`` starts it, and the demo prints its URL and, as Ray 2.60 asks for a token
there, where the token is (``hpsray.cluster.runtime.dashboard_hint``; docs/operations.md,
"Getting into the dashboard"). ``hpsray train`` always starts it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

HELP = "generate data, train it on an embedded Ray with rows travelling to SSD and back, print AUC and stages"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=300_000, metavar="N", help="training examples (default 300000)")
    parser.add_argument(
        "--workdir",
        default=None,
        metavar="DIR",
        help="where data, job file, SSD-PS files and export go (kept; default a temporary "
        "directory, removed at the end)",
    )
    parser.add_argument("--report", default=None, metavar="FILE.json", help="write the run report and its plots")
    parser.add_argument("--address", default=None, help="Ray address (default: an embedded local Ray)")
    parser.add_argument("--json", action="store_true", help="print the run report as JSON on stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help="start the embedded Ray's dashboard and print its URL (Ray's start takes ~1.5 s longer; "
        "use a large --rows to have time to look)",
    )


def run(args: argparse.Namespace) -> int:
    from hpsray.cli.start import connect_alongside
    from hpsray.cli.train import summary, train_pipeline
    from hpsray.errors import ConfigError
    from hpsray.job import JobConfig
    from hpsray.job.demo import BATCHES, demo_job
    from hpsray.report import Demo

    if args.rows < BATCHES:
        print(f"hpsray demo: error: --rows must be >= {BATCHES}, got {args.rows}", file=sys.stderr)
        return 2
    keep = args.workdir is not None
    workdir = os.path.abspath(args.workdir) if keep else tempfile.mkdtemp(prefix="hpsray-demo-")
    os.makedirs(workdir, exist_ok=True)
    job_file = os.path.join(workdir, "job.toml")

    def write_job() -> JobConfig:
        demo_job(workdir, args.rows, quiet=args.quiet)
        return JobConfig.load(job_file)

    try:
        try:  # the data is written while Ray comes up
            ray_started = connect_alongside(args.address, args.quiet, write_job, dashboard=args.dashboard)
        except ConfigError as e:  # a bug in the demo, but say where
            print(f"hpsray demo: error: {e}", file=sys.stderr)
            return 2
        job = ray_started.result
        report, _ = train_pipeline(
            job, args.address, args.quiet, export_dir=os.path.join(workdir, "export"), ray_started=ray_started
        )
        report.bad_rows = int((report.bad_input or {}).get("rows_bad", 0))
        report.config = job.to_dict()
        report.config_file = job_file
        cache = report.cache or {}
        report.demo = Demo(
            distinct_keys=report.rows or 0,  # train_pipeline exported: the rows it wrote
            mem_rows=job.tiers.mem_rows or 0,
            rows_evicted=cache.get("evicted", 0),
            rows_loaded_from_ssd=cache.get("loaded", 0),
        )
        data = report.as_dict()
        if args.report:
            from hpsray.pipelines.report import write_report

            written = write_report(data, args.report)
        if args.json:
            import json

            print(json.dumps(data, indent=2, default=str))
            return 0
        print(summary(data))
        d = data["demo"]
        print(
            f"MEM-PS budget {d['mem_rows']:,} rows for {d['distinct_keys']:,} distinct keys "
            f"({100.0 * d['mem_rows'] / max(d['distinct_keys'], 1):.0f}%): {d['rows_evicted']:,} rows evicted "
            f"to SSD-PS, {d['rows_loaded_from_ssd']:,} loaded back"
        )
        if args.report:
            print(f"report: {written[0]} (plots: {', '.join(os.path.basename(p) for p in written[1:])})")
        if keep:
            print(f"work directory {workdir}: rerun with `hpsray train {job_file}`; export in {workdir}/export")
        return 0
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
