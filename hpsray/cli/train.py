"""``hpsray train JOB.toml``: train a job file on the hierarchical parameter server (or the reference).

Contract: prints held-out AUC, throughput and the stage table; ``--report`` writes the run
report, ``--export`` the trained model (docs/export.md), ``--reference --compare DIR`` checks
losslessness against an export (docs/architecture.md: invariant 1), ``--resume`` continues from
the newest checkpoint (exit code 130 after Ctrl-C). The job file's schema:
:class:`hpsray.job.JobConfig`; checkpoints, recovery and resume: docs/operations.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from hpsray.cli.train_checks import check_capacity, check_checkpoints, check_export_dir, check_fresh_ssd, overwrite

if TYPE_CHECKING:
    from hpsray.cli.start import RayStarted
    from hpsray.job import JobConfig
    from hpsray.report import RunReport

HELP = (
    "train a TOML job file (data, model, optimizer, tiers, pipeline, cluster, checkpoint); "
    "--resume continues from its newest checkpoint, --reference trains the oracle"
)

EXIT_CONFIG = 2  # bad job file or arguments
EXIT_FAILED = 1  # training failed, or --compare found a difference
ROUNDING_ULPS = 8  # --compare: a difference of at most this many float32 ulps is called rounding-sized
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="JOB.toml", help="the job file (see examples/train.toml)")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (overrides [cluster] address; default RAY_ADDRESS or an embedded Ray)",
    )
    parser.add_argument(
        "--report",
        metavar="FILE.json",
        default=None,
        help="write the run report as JSON, with FILE.stage_times.png, FILE.cache_hit_rate.png "
        "and FILE.ssd_io.png beside it",
    )
    parser.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="write the trained rows (Parquet) and dense weights to DIR (docs/export.md)",
    )
    parser.add_argument(
        "--init-from",
        metavar="DIR",
        default=None,
        help="start from the rows of a Parquet table (an --export DIR, or key/row[/state] files): "
        "overrides [tiers] init_from (docs/tiers.md)",
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="with --export DIR holding an earlier export: write only the rows changed since then, "
        "as DIR/delta-NNNNNN beside it (load_export and hpsray serve apply the deltas)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the job from the newest checkpoint in its [checkpoint] dir (after its driver "
        "died or was stopped with Ctrl-C)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over: remove what an earlier run of the job left (its SSD-PS files, its checkpoints, "
        "the --export DIR) instead of refusing",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="train with the in-memory reference trainer instead (the losslessness oracle)",
    )
    parser.add_argument(
        "--compare",
        metavar="DIR",
        default=None,
        help="after training, compare the model with an earlier --export DIR; exit 1 if they differ",
    )
    parser.add_argument(
        "--tolerance", type=float, default=1e-5, help="largest absolute difference --compare accepts (default 1e-5)"
    )
    parser.add_argument("--json", action="store_true", help="print the run report as JSON on stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress output on stderr")
    parser.add_argument(
        "--no-plan",
        action="store_true",
        help="skip the capacity check (hpsray plan) that refuses a job which cannot fit",
    )


def with_init_from(job: JobConfig, directory: str) -> JobConfig:
    """``job`` with ``[tiers] init_from`` set to ``directory`` (``--init-from``)."""
    import dataclasses

    if not os.path.isdir(directory):
        raise ValueError(f"--init-from {directory}: no such directory")
    tiers = dataclasses.replace(job.tiers, init_from=os.path.abspath(directory))
    return dataclasses.replace(job, tiers=tiers)


def error(msg: str, code: int = EXIT_CONFIG) -> int:
    print(f"hpsray train: error: {msg}", file=sys.stderr)
    return code


def process_age_s() -> float:
    """Seconds since this process started, on the boot clock both ends share (the kernel's start
    time of the process in ``/proc/self/stat`` against ``CLOCK_BOOTTIME``), so a step of the wall
    clock (NTP at boot) cannot shift it; elsewhere the seconds since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks after boot
        now = time.clock_gettime(time.CLOCK_BOOTTIME)  # type: ignore[attr-defined,unused-ignore]
        return max(now - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


def process_start() -> float:
    """When this process started, on the ``time.time()`` scale: now minus its age
    (:func:`process_age_s`). The origin of the report's ``time_to_first_batch_s``, so the
    command's imports count."""
    return time.time() - process_age_s()


_IMPORTED = time.monotonic()


def _cause(e: BaseException) -> BaseException:
    """The user-facing exception inside a Ray task error."""
    seen = 0
    while seen < 8 and (inner := getattr(e, "cause", None)) is not None and inner is not e:
        e = inner
        seen += 1
    return e


def train_pipeline(
    job: JobConfig,
    address: str | None,
    quiet: bool,
    export_dir: str | None = None,
    *,
    resume: bool = False,
    incremental: bool = False,
    ray_started: RayStarted | None = None,
) -> tuple[RunReport, Any]:
    """Fit ``job`` with the :class:`~hpsray.pipelines.Pipeline`, evaluate, optionally export.

    Returns ``(report, model)`` where ``model`` is ``(keys, rows, dense_state)`` when exported
    (else ``None``). Ray is started (and stopped) here unless the process is already connected.
    ``resume``: continue from the newest checkpoint of ``[checkpoint] dir``; ``incremental``:
    export a delta beside an earlier export in ``export_dir``. ``ray_started``: Ray as the
    caller's :func:`~hpsray.cli.start.connect_alongside` left it (else it is joined here, the
    pipeline's imports meanwhile).
    """
    import ray

    from hpsray.cli.start import connect_alongside
    from hpsray.cluster.runtime import dashboard_hint
    from hpsray.reference_job import evaluate_into
    from hpsray.report import Evaluation

    if ray_started is None:
        ray_started = connect_alongside(address or job.cluster.address, quiet, lambda: None)
    started, ray_init_s = ray_started.started, ray_started.ray_init_s
    from hpsray.export import export, schema_of_source
    from hpsray.job import build

    hint = dashboard_hint() if started and not quiet else None
    if hint:  # the local Ray's dashboard, and where its auth token is (docs/operations.md)
        print(f"hpsray: {hint}", file=sys.stderr)
    model = None
    try:
        with build.pipeline(job, address=address, resume=resume) as pipe:
            pipe.started_at = process_start()  # time_to_first_batch_s counts from the command
            pipe.start_s["ray_init_s"] = ray_init_s
            pipe.fit(progress=not quiet)
            report = pipe.report
            assert report is not None
            report.trainer = "hpsray"
            evals = pipe.evaluations
            best = evals.track.best if evals is not None and evals.best_model is not None else None
            if best is not None:  # early stopping: the best model is the one reported and exported
                report.evaluation = Evaluation(auc=best.auc, logloss=best.logloss, eval_examples=best.examples)
            else:
                evaluate_into(report, job, pipe.evaluate)
            if export_dir:
                model = evals.best_model if best is not None and evals is not None else None
                if model is None:
                    keys, rows = pipe.export_rows()
                    model = (keys, rows, pipe.dense_state())
                keys = model[0]
                source = pipe.source
                report.export = export(
                    model,
                    export_dir,
                    job.train_config(),
                    n_slots=source.n_slots,
                    n_dense=source.n_dense,
                    extra={"trainer": "hpsray"},
                    schema=schema_of_source(source),
                    incremental=incremental,
                )
                report.rows = int(keys.size)
    finally:
        if started:
            ray.shutdown()
    return report, model


def export_line(manifest: dict, directory: str) -> str:
    """What ``--export`` wrote: a full export, or (``--incremental``) a delta beside one."""
    if "sequence" in manifest:
        return (
            f"export: delta-{manifest['sequence']:06d} in {directory}: {manifest['changed']:,} of "
            f"{manifest['rows']:,} rows changed, {manifest['removed']:,} removed"
        )
    return f"export: {manifest['rows']:,} rows to {directory}"


def summary(report: dict) -> str:
    """The human-readable result: AUC, throughput and the stage table."""
    from hpsray.pipelines.report import format_stage_table

    who = "reference trainer" if report.get("trainer") == "reference" else "hpsray pipeline"
    lines = [
        (
            f"{who}: {report['examples']:,} examples in {report['batches']} batches, "
            f"{report['wall_s']:.1f} s, {report['examples_per_s']:,.0f} examples/s"
        )
    ]
    if report.get("auc") is not None:
        lines.append(
            f"held-out AUC {report['auc']:.4f}, log-loss {report['logloss']:.4f} ({report['eval_examples']:,} examples)"
        )
    else:
        lines.append("no evaluation data in the job (data.eval_paths or data.synthetic.eval_rows)")
    resumed = report.get("resumed_from")
    if resumed:
        lines.append(f"resumed from {resumed['checkpoint']} (after {_batches(resumed['batch'])} trained)")
    reshaped = report.get("reshaped")
    if reshaped:
        shape = f"{reshaped['from_nodes']} to {reshaped['to_nodes']} nodes"
        lines.append(f"re-partitioned from {shape} in {reshaped['seconds']:.1f} s")
    ckpt = report.get("checkpoints")
    if ckpt is not None:
        lines.append(
            f"checkpoints: {ckpt['count']} written in {ckpt['seconds']:.1f} s, "
            f"{100 * ckpt['share_of_wall']:.1f} % of wall, {_megabytes(ckpt['bytes'])} referenced"
        )
    for r in report.get("recovery") or []:
        dead = ", ".join(r.get("dead") or []) or "an actor"
        lines.append(
            f"recovery: {dead} lost after {_batches(r['failed_at_batch'])} trained ({r['error']}); resumed from "
            f"the checkpoint after {_batches(r['resumed_from_batch'])}, {_batches(r['replayed_batches'])} replayed, "
            f"restarted in {r['restart_s']:.1f} s"
        )
        for lost in r.get("lost_nodes") or []:
            lines.append(f"node {lost['node']} lost at {lost['at']} ({lost['why']}); continued on {r['nodes']} nodes")
    lines.append(format_stage_table(report))
    return "\n".join(lines)


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def _megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def resume_command(args: argparse.Namespace, how: str = "--resume") -> str:
    """The command line that continues this run from its checkpoint (``how="--overwrite"``:
    that starts it over)."""
    import shlex

    words = ["hpsray", "train", args.config, how]
    for flag, value in (("--address", args.address), ("--report", args.report), ("--export", args.export)):
        if value:
            words += [flag, value]
    if args.incremental and how == "--resume":
        words.append("--incremental")
    return shlex.join(words)


def with_command(message: str, args: argparse.Namespace) -> str:
    """A refusal that names ``--overwrite``, with the exact command that starts the run over."""
    if "--overwrite" not in message or args.overwrite:
        return message
    return f"{message}; to start over: {resume_command(args, '--overwrite')}"


def interrupted(job: JobConfig, args: argparse.Namespace, e: KeyboardInterrupt) -> int:
    """Ctrl-C: say what was kept and how to go on; exit code 130."""
    why = f"interrupted: {e}" if str(e) else "interrupted"
    if job.checkpoint is None:
        return error(f"{why}; the job has no [checkpoint] dir, so a new run starts over", EXIT_INTERRUPTED)
    from hpsray.checkpoint.remote import is_uri, open_checkpoints

    directory = job.checkpoint.dir
    committed = open_checkpoints(directory).committed() if is_uri(directory) or os.path.isdir(directory) else []
    if not committed:
        return error(f"{why}; no checkpoint in {directory} yet, so a new run starts over", EXIT_INTERRUPTED)
    print(f"hpsray train: {why}", file=sys.stderr)
    print(f"hpsray train: the newest checkpoint is {committed[0]}", file=sys.stderr)
    print(f"hpsray train: continue with: {resume_command(args)}", file=sys.stderr)
    return EXIT_INTERRUPTED


def run(args: argparse.Namespace) -> int:
    import json

    from hpsray.errors import CapacityError, CheckpointError, ConfigError, DataError, TrainingStopped
    from hpsray.job import JobConfig
    from hpsray.job.inputs import check_inputs

    try:  # the job file first, before Ray and the pipeline's modules are imported: its mistakes in a second
        job = JobConfig.load(args.config)
        check_inputs(job)  # a missing path or column: the job's mistake, in every bad-input mode
    except ConfigError as e:
        return error(str(e))
    from ray.exceptions import RayError

    from hpsray.job import build
    from hpsray.pipelines.progress import progress_seconds
    from hpsray.reference_job import train_reference
    from hpsray.report import ResumedFrom

    if args.compare and not os.path.isfile(os.path.join(args.compare, "manifest.json")):
        return error(f"--compare {args.compare}: no manifest.json there (not an hpsray export)")
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        return error(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    if args.incremental and not args.export:
        return error("--incremental needs --export DIR (the earlier export to add the changed rows to)")
    if args.resume and args.reference:
        return error("--resume continues a pipeline run from its checkpoint; the reference trainer has none")
    if args.resume and args.overwrite:
        return error("--resume continues the earlier run, --overwrite removes it: choose one")
    resumed = None
    try:
        if args.init_from:
            job = with_init_from(job, args.init_from)
        build.source(job)  # resolves the schema: configuration errors surface before Ray starts
        progress_seconds(job.pipeline.progress_seconds)  # ValueError: a bad $HPSRAY_PROGRESS_SECONDS
        build.eval_source(job)
        build.init_from(job)  # [tiers] init_from: one node, the export's tables the job's
        if args.overwrite:
            overwrite(job, args.export, args.quiet, run_dirs=not args.reference)
        check_export_dir(args.export, args.incremental)
        if not args.reference:
            build.cluster_kwargs(job)
            if not args.resume:  # a resume replaces the SSD-PS directories by the checkpoint's snapshot
                check_fresh_ssd(job.tiers.ssd_path)
            try:
                resumed = check_checkpoints(job, args.resume)
            except CheckpointError as e:
                return error(
                    f"--resume: {e}" if args.resume else with_command(f"{args.config}: checkpoint.dir: {e}", args)
                )
            if not args.no_plan:  # before any actor starts: refuse a job that cannot fit, naming the fix
                check_capacity(job, args.quiet)
    except (ConfigError, DataError, CapacityError) as e:
        return error(str(e))
    except (ValueError, OSError) as e:
        return error(with_command(f"{args.config}: {e}", args))
    if resumed is not None and not args.quiet:
        print(f"hpsray train: resuming from {resumed.path} ({resumed.batch} batches trained)", file=sys.stderr)

    try:
        if args.reference:
            report, model = train_reference(job, args.quiet)
            if args.export:
                from hpsray.export import export, schema_of_source

                report.export = export(
                    model,
                    args.export,
                    job.train_config(),
                    n_slots=build.source(job).n_slots,
                    n_dense=build.source(job).n_dense,
                    extra={"trainer": "reference"},
                    schema=schema_of_source(build.source(job)),
                    incremental=args.incremental,
                )
        else:
            export_dir = args.export
            if args.compare and not export_dir:
                import tempfile

                export_dir = tempfile.mkdtemp(prefix="hpsray-export-")
            if not args.quiet:  # the start takes seconds (Ray, the actors' processes): say what is happening
                print("hpsray train: starting Ray and the stage actors ...", file=sys.stderr, flush=True)
            report, model = train_pipeline(
                job, args.address, args.quiet, export_dir, resume=args.resume, incremental=args.incremental
            )
            if export_dir and not args.export:
                import shutil

                shutil.rmtree(export_dir, ignore_errors=True)
                report.export = None
    except KeyboardInterrupt as e:
        return interrupted(job, args, e)
    except TrainingStopped as e:
        return error(f"training failed: {e}", EXIT_FAILED)
    except (DataError, ValueError, OSError, RayError, CheckpointError) as e:  # actor errors: wrapped in RayTaskError
        cause = _cause(e)
        return error(f"training failed: {type(cause).__name__}: {cause}", EXIT_FAILED)

    report.bad_rows = int((report.bad_input or {}).get("rows_bad", 0))
    report.config = job.to_dict()
    report.config_file = os.path.abspath(args.config)
    if resumed is not None:
        report.resumed_from = ResumedFrom(checkpoint=str(resumed.path), batch=resumed.batch)
    code = 0
    if args.compare:
        from hpsray.export import compare_exports, load_export
        from hpsray.export.layout import ExportLayout

        layout = ExportLayout.of(job.train_config())  # tables of several layouts: rows as exported
        if layout is not None:
            model = (model[0], layout.to_export(model[0], model[1]), *model[2:])
        diff = compare_exports(model, load_export(args.compare))
        worst = max(diff["max_abs_row_diff"], diff["max_abs_dense_diff"])
        same_keys = diff["keys_only_in_a"] == 0 and diff["keys_only_in_b"] == 0
        diff.update(
            against=os.path.abspath(args.compare),
            tolerance=args.tolerance,
            equal=bool(same_keys and worst <= args.tolerance),
        )
        report.compare = diff
        code = 0 if diff["equal"] else EXIT_FAILED
    data = report.as_dict()
    if args.report:
        from hpsray.pipelines.report import write_report

        written = write_report(data, args.report)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(summary(data))
        if args.report:
            print(f"report: {written[0]} (plots: {', '.join(os.path.basename(p) for p in written[1:])})")
        if args.export:
            print(export_line(data["export"], args.export))
        if args.compare:
            d = data["compare"]
            verdict = "EQUAL" if d["equal"] else "DIFFERENT"
            print(
                f"compare with {args.compare}: {d['rows_a']:,} vs {d['rows_b']:,} rows "
                f"({d['keys_only_in_a']} / {d['keys_only_in_b']} keys only on one side), max |diff| rows "
                f"{d['max_abs_row_diff']:.3g}, dense {d['max_abs_dense_diff']:.3g}: {verdict} "
                f"within {args.tolerance:g}"
            )
            if d["rows_differing"] or d["max_ulps"]:
                size = "rounding-sized" if 0 <= d["max_ulps"] <= ROUNDING_ULPS else "beyond rounding"
                print(
                    f"  {d['rows_differing']:,} rows differ; largest relative difference "
                    f"{d['max_rel_diff']:.3g}, at most {d['max_ulps']:,} ulps: {size} "
                    f"(rounding: <= {ROUNDING_ULPS} ulps)"
                )
    return code
