"""What ``hpsray train`` checks before any actor starts, for the Python API too.

:func:`preflight` runs on a :class:`~hpsray.pipelines.Pipeline`'s first ``fit()`` (before Ray
starts its actors): the files and columns of a :class:`~hpsray.pipelines.FileSource`
(:mod:`hpsray.job.inputs`), an SSD-PS directory holding an earlier run's parameter files, a
checkpoint directory holding an earlier run's checkpoints (without ``resume``), and
``hpsray plan``'s capacity check: a job that cannot fit raises
:class:`~hpsray.errors.CapacityError` with the CLI's message and the Python setting to change.
The same functions serve the CLI (:mod:`hpsray.cli.train`), whose hints name its options.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from hpsray.errors import CapacityError, CheckpointError, ConfigError
from hpsray.pipelines.views import Preflighted

if TYPE_CHECKING:
    from hpsray.job import JobConfig

__all__ = [
    "clear_checkpoints",
    "clear_ssd",
    "earlier_checkpoints",
    "job_of",
    "preflight",
    "silent_bad_input",
    "ssd_leftovers",
]

WHERE = "Pipeline"
_CHECKPOINT_ENTRY = re.compile(r"\.?ckpt-\d{6,}(\.(tmp|old)-[0-9a-f]+)?$")
# the CLI's job-file settings in a plan's fix, and what a Python caller sets instead
_PYTHON_SETTING = (
    (re.compile(r"set \[tiers\] mem_rows (>=|<=) ([\d,]+)"), r"set MemPSSettings(capacity_rows=...) \1 \2"),
    (re.compile(r"set \[tiers\] mem_bytes (>=|<=) ([\d,]+)"), r"set MemPSSettings(capacity_bytes=...) \1 \2"),
    (re.compile(r"lower \[pipeline\] batch_size"), "lower Pipeline(batch_size=...)"),
    (re.compile(r"set \[pipeline\] hbm_rows (>=) ([\d,]+)"), r"set TrainerSettings(hbm_capacity=...) \1 \2"),
    (re.compile(r"set \[tiers\] ssd_path"), "set SSDPSSettings(path=...)"),
    (re.compile(r"raise cluster\.nodes"), "raise Pipeline(nodes=...)"),
    (re.compile(r"\btiers\.mem_rows: "), "MemPSSettings.capacity_rows: "),
    (re.compile(r"\btiers\.mem_bytes: "), "MemPSSettings.capacity_bytes: "),
    (re.compile(r"\btiers\.ssd_path: "), "SSDPSSettings.path: "),
    (re.compile(r"\bcluster\.nodes: "), "Pipeline.nodes: "),
)


@contextmanager
def silent_bad_input() -> Iterator[None]:
    """Within: the bad rows a check's sample meets are not logged (``hpsray.data``); the
    readers of the run report each once. A strict job's first bad row still raises."""
    log = logging.getLogger("hpsray.data")
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


def ssd_leftovers(path: str | None) -> list[str]:
    """The ``node-*`` directories of an earlier run holding parameter files in ``path``."""
    if not path or not os.path.isdir(path):
        return []
    return sorted(e for e in os.listdir(path) if e.startswith("node-") and os.listdir(os.path.join(path, e)))


def clear_ssd(path: str | None) -> list[str]:
    """Remove an earlier run's ``node-*`` directories from ``path`` (nothing else); their names."""
    gone = ssd_leftovers(path)
    for name in gone:
        shutil.rmtree(os.path.join(str(path), name))
    return gone


def clear_checkpoints(directory: str) -> list[str]:
    """Remove the checkpoints (``ckpt-N``, staging leftovers) from ``directory`` (nothing else;
    under a URI: every checkpoint's manifest and object, checkpoint/remote.py)."""
    from hpsray.checkpoint.remote import RemoteCheckpoints, is_uri

    if is_uri(directory):
        return RemoteCheckpoints(directory).clear()
    if not os.path.isdir(directory):
        return []
    gone = sorted(e for e in os.listdir(directory) if _CHECKPOINT_ENTRY.match(e))
    for name in gone:
        shutil.rmtree(os.path.join(directory, name))
    return gone


def earlier_checkpoints(directory: str, keep: int, fingerprint: str, resume_hint: str, fresh_hint: str) -> None:
    """Raise :class:`CheckpointError` naming ``directory`` when it holds committed checkpoints:
    a fresh run's first checkpoint would remove them. This job's (same ``fingerprint``): the
    message says ``resume_hint`` or ``fresh_hint``; another job's: choose another directory."""
    from hpsray.checkpoint.remote import is_uri, open_checkpoints

    if not is_uri(directory) and not os.path.isdir(directory):
        return
    checkpoints = open_checkpoints(directory, keep)
    committed = checkpoints.committed()
    if not committed:
        return
    theirs = checkpoints.fingerprint_of(committed[0])
    if theirs == fingerprint:
        what = "this job's earlier run", f"continue it with {resume_hint}, or start over with {fresh_hint}"
    else:
        what = "another job (or of this job file before a change)", f"choose another directory, or {fresh_hint}"
    raise CheckpointError(directory, f"holds checkpoints of {what[0]} (newest: {committed[0].name}); {what[1]}")


def job_of(pipeline: Preflighted) -> JobConfig | None:
    """The job a pipeline trains, as ``hpsray plan`` reads one (``None`` for a source
    that is neither a :class:`SyntheticSource` of :class:`~hpsray.data.PlantedCTR` nor a
    :class:`FileSource`: its input cannot be sampled the way the plan does)."""
    from hpsray.data import PlantedCTR
    from hpsray.job import JobConfig
    from hpsray.job.sections import (
        ClusterSection,
        DataSection,
        ModelSection,
        OptimizerSection,
        PipelineSection,
        SyntheticSection,
        TiersSection,
    )
    from hpsray.pipelines.sources import FileSource, SyntheticSource

    source = pipeline.source
    if isinstance(source, SyntheticSource) and isinstance(source.generator, PlantedCTR):
        g = source.generator
        nnz = g.nnz_per_slot
        total = int(nnz) * g.n_slots if isinstance(nnz, int) else int(sum(nnz))
        syn = SyntheticSection(
            rows=source.rows,
            slots=g.n_slots,
            keys=g.keys_per_slot,
            nnz=total,
            dense=g.n_dense,
            zipf=g.zipf_a,
            seed=g.seed,
        )
        data = DataSection(synthetic=syn)
    elif isinstance(source, FileSource):
        paths = (source.paths,) if isinstance(source.paths, str) else tuple(source.paths)
        data = DataSection(paths=paths, schema=source.schema, bad_input=source.policy, format=source.schema.format)
    else:
        return None
    cfg, mem, ssd, trainer = pipeline.config, pipeline.mem_settings, pipeline.ssd_settings, pipeline.trainer_settings
    return JobConfig(
        data=data,
        model=ModelSection(dim=cfg.dim, hidden=tuple(cfg.hidden), init_scale=cfg.init_scale, seed=cfg.seed),
        optimizer=OptimizerSection(
            sparse=cfg.sparse_optimizer,
            sparse_lr=cfg.sparse_lr,
            sparse_params=dict(cfg.sparse_params),
            dense=cfg.dense_optimizer,
            dense_lr=cfg.dense_lr,
        ),
        tiers=TiersSection(
            mem_rows=mem.capacity_rows if mem.capacity_bytes is None else None,
            mem_bytes=mem.capacity_bytes,
            ssd_path=ssd.path,
            mem=dict(mem.options),
            ssd={k: v for k, v in ssd.options.items() if k != "init_from"},
            admit_after=mem.admit_after,
        ),
        pipeline=PipelineSection(
            batch_size=pipeline.batch_size,
            minibatch_size=cfg.minibatch_size,
            read_queue=pipeline.read_queue,
            n_devices=trainer.n_devices,
            device=trainer.device,
            hbm_rows=trainer.hbm_capacity,
        ),
        cluster=ClusterSection(nodes=pipeline.n_nodes or 0),
        where=WHERE,
    )


def python_fix(message: str) -> str:
    """A plan's message with the job file's settings named as the Python API's."""
    for pattern, replacement in _PYTHON_SETTING:
        message = pattern.sub(replacement, message)
    return message


def preflight(pipeline: Preflighted) -> None:
    """The CLI's checks for a Python-built pipeline (see the module docstring); raises
    :class:`ConfigError`, :class:`CheckpointError` or :class:`CapacityError` naming the fix."""
    from hpsray.job.inputs import check_sources
    from hpsray.pipelines.sources import FileSource

    source = pipeline.source
    if isinstance(source, FileSource):
        paths = [source.paths] if isinstance(source.paths, str) else list(source.paths)
        check_sources(paths, source.schema, WHERE, "FileSource.paths")
    stage = pipeline.checkpoint_settings
    resume = stage is not None and stage.resume
    leftovers = [] if resume else ssd_leftovers(pipeline.ssd_settings.path)
    if leftovers:
        raise ConfigError(
            WHERE,
            "SSDPSSettings.path",
            f"{pipeline.ssd_settings.path} already holds parameter files of an earlier run ({', '.join(leftovers)}); "
            "training on them would start from old rows: remove them (hpsray.pipelines.preflight.clear_ssd) "
            "or choose another directory",
        )
    if stage is not None and not resume:
        earlier_checkpoints(
            stage.directory,
            stage.keep,
            pipeline.fingerprint,
            "CheckpointSettings(..., resume=True)",
            "hpsray.pipelines.preflight.clear_checkpoints(dir)",
        )
    job = job_of(pipeline)
    if job is None:
        return
    from hpsray.plan import check_plan, make_plan

    with silent_bad_input():
        plan = make_plan(job, calibrate_stages=False)
    if pipeline.n_nodes:  # with nodes=None the node count is the cluster's: the plan's 1 node is a guess
        try:
            check_plan(plan)
        except CapacityError as e:
            raise CapacityError(python_fix(str(e))) from None
