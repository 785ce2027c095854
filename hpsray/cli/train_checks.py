"""What ``hpsray train`` checks before Ray starts (docs/operations.md: Checkpoints, recovery and
resume): an earlier run's SSD-PS files, checkpoints or export, and the plan's capacity; and what
``--overwrite`` removes. Each check raises the error the run would hit later, with the fix."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpsray.checkpoint import Checkpoint
    from hpsray.job import JobConfig

__all__ = ["check_capacity", "check_checkpoints", "check_export_dir", "check_fresh_ssd", "overwrite"]


def check_fresh_ssd(path: str | None) -> None:
    """Refuse an SSD-PS directory that holds an earlier run's parameter files: training on top
    of them would silently start from old rows (``--overwrite`` removes them first)."""
    from hpsray.pipelines.preflight import ssd_leftovers

    leftovers = ssd_leftovers(path)
    if leftovers:
        raise ValueError(
            f"tiers.ssd_path: {path} already holds parameter files of an earlier run "
            f"({', '.join(leftovers)}); add --overwrite to replace them (or --resume to continue a stopped run), "
            "or choose another directory"
        )


def check_export_dir(directory: str | None, incremental: bool) -> None:
    """Refuse an ``--export DIR`` that holds files (an earlier export, the point file ``hpsray
    serve`` wrote there): the export would replace them. ``--incremental`` adds a delta beside
    an export; ``--overwrite`` replaces it."""
    if not directory or incremental or not os.path.isdir(directory) or not os.listdir(directory):
        return
    what = "an earlier export" if os.path.isfile(os.path.join(directory, "manifest.json")) else "files"
    raise ValueError(
        f"--export {directory}: holds {what} ({', '.join(sorted(os.listdir(directory))[:5])}); add --overwrite "
        "to replace it, --incremental to add a delta beside it, or choose another directory"
    )


def check_checkpoints(job: JobConfig, resume: bool) -> Checkpoint | None:
    """Before Ray starts: with ``resume`` the checkpoint the run will continue from (raises
    :class:`~hpsray.errors.CheckpointError` naming the directory when there is none, none that
    verifies, or another job's); without, refuse a ``[checkpoint] dir`` that already holds
    checkpoints: the run's first checkpoint would remove them. ``None`` without ``[checkpoint]``."""
    import dataclasses

    from hpsray.checkpoint.remote import is_uri, open_checkpoints
    from hpsray.errors import CheckpointError
    from hpsray.job import build
    from hpsray.pipelines.preflight import earlier_checkpoints

    stage = build.checkpoint(job, resume)  # ConfigError: --resume of a job without [checkpoint]
    if stage is None:
        return None
    directory = stage.directory
    if not is_uri(directory) and not os.path.isdir(directory):
        if resume:
            raise CheckpointError(directory, "no such directory: no checkpoint to resume from")
        return None
    # the job's fingerprint, as its Pipeline computes it (built without checkpoints: no directory is touched)
    fingerprint = build.pipeline(dataclasses.replace(job, checkpoint=None)).fingerprint
    if resume:
        latest = open_checkpoints(directory, stage.keep).latest(fingerprint)  # refuses another job's, or none verifying
        if latest is None:
            raise CheckpointError(
                directory, "no checkpoint to resume from (the run stopped before its first); run it without --resume"
            )
        return latest
    earlier_checkpoints(directory, stage.keep, fingerprint, "--resume", "--overwrite (removes them)")
    return None


def overwrite(job: JobConfig, export_dir: str | None, quiet: bool, run_dirs: bool = True) -> None:
    """``--overwrite``: remove what an earlier run of the job left (with ``run_dirs`` the SSD-PS
    ``node-*`` directories and the checkpoints; the export directory) and say so."""
    import shutil

    from hpsray.pipelines.preflight import clear_checkpoints, clear_ssd

    gone = []
    if run_dirs and job.tiers.ssd_path:
        gone += [os.path.join(job.tiers.ssd_path, n) for n in clear_ssd(job.tiers.ssd_path)]
    if run_dirs and job.checkpoint is not None:
        gone += [os.path.join(job.checkpoint.dir, n) for n in clear_checkpoints(job.checkpoint.dir)]
    if export_dir and os.path.isdir(export_dir) and os.listdir(export_dir):
        shutil.rmtree(export_dir)
        gone.append(export_dir)
    if gone and not quiet:
        print(f"hpsray train: --overwrite: removed {', '.join(gone)}", file=sys.stderr)


def check_capacity(job: JobConfig, quiet: bool) -> None:
    """``hpsray plan``'s check (its sample, no calibration): raise the
    :class:`~hpsray.errors.CapacityError` the run would hit, with the fix; print warnings."""
    from hpsray.pipelines.preflight import silent_bad_input
    from hpsray.plan import check_plan, make_plan

    with silent_bad_input():  # the readers report the sample's bad rows, once
        plan = make_plan(job, calibrate_stages=False)
    if job.cluster.nodes:  # with nodes = 0 the node count is the cluster's: the plan's 1 node is a guess
        check_plan(plan)
    if not quiet:
        for p in plan.problems:
            print(f"hpsray train: warning: {p.setting}: {p.message}; {p.fix}", file=sys.stderr)
