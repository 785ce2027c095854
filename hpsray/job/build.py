"""Building what a job describes: its sources, stages and :class:`~hpsray.pipelines.Pipeline`.

The only module of :mod:`hpsray.job` that imports :mod:`hpsray.pipelines` (and so Ray): reading
and validating a job file (:class:`~hpsray.job.JobConfig`) needs neither.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hpsray.errors import ConfigError, ExportError
from hpsray.export.read import read_manifest
from hpsray.fields import same_fields
from hpsray.job.jobconfig import JobConfig
from hpsray.pipelines.pipeline import Pipeline
from hpsray.pipelines.settings import CheckpointSettings, MemPSSettings, SSDPSSettings, SyncSettings, TrainerSettings
from hpsray.pipelines.sources import FileSource, SyntheticSource
from hpsray.tables import check_tables, import_refusal
from hpsray.tiers.ssd.bulkload import TableImport

__all__ = ["checkpoint", "cluster_kwargs", "eval_source", "init_from", "pipeline", "source", "stages"]


def source(job: JobConfig) -> SyntheticSource | FileSource:
    """The training source: :class:`~hpsray.pipelines.SyntheticSource` or :class:`~hpsray.pipelines.FileSource`."""
    syn = job.data.synthetic
    if syn is not None:
        return SyntheticSource(syn.generator(), syn.rows)
    return FileSource(list(job.data.paths), job.schema(), job.data.bad_input)


def eval_source(job: JobConfig) -> SyntheticSource | FileSource | None:
    """The held-out source, or ``None`` when the job names no evaluation data."""
    syn = job.data.synthetic
    if syn is not None:
        return SyntheticSource(syn.generator(), syn.eval_rows, start_row=syn.rows) if syn.eval_rows else None
    if not job.data.eval_paths:
        return None
    return FileSource(list(job.data.eval_paths), job.schema(), job.data.bad_input)


def stages(job: JobConfig, n_slots: int | None = None) -> tuple[TrainerSettings, MemPSSettings, SSDPSSettings]:
    """``(TrainerSettings, MemPSSettings, SSDPSSettings)`` of ``job``. ``n_slots`` sizes the default
    MEM-PS budget (read from the schema when not given)."""
    t, p = job.tiers, job.pipeline
    admission: dict[str, Any] = {
        "admit_after": t.admit_after,
        "expire_after_batches": t.expire_after_batches,
        "dumps_in_flight": t.dumps_in_flight,
    }
    trainer = TrainerSettings(
        config=job.train_config(), n_devices=p.n_devices, device=p.device, threads=p.threads, hbm_capacity=p.hbm_rows
    )
    if t.mem_bytes is not None:
        mem = MemPSSettings(capacity_bytes=t.mem_bytes, options=dict(t.mem), **admission)
    else:
        if t.mem_rows is None and n_slots is None:
            n_slots = source(job).n_slots
        rows = t.mem_rows if t.mem_rows is not None else 4 * p.batch_size * max(n_slots or 1, 1)
        mem = MemPSSettings(capacity_rows=rows, options=dict(t.mem), **admission)
    return trainer, mem, SSDPSSettings(path=t.ssd_path, options=dict(t.ssd, **init_from(job)))


def init_from(job: JobConfig) -> dict:
    """The SSD-PS option of ``[tiers] init_from``: ``{"init_from": TableImport}`` (none without it).
    One node only for now (:class:`ConfigError` naming ``tiers.init_from`` otherwise)."""
    if job.tiers.init_from is None:
        return {}
    if job.cluster.nodes != 1:
        raise ConfigError(
            job.where, "tiers.init_from", f"loads one node's SSD-PS; set cluster.nodes = 1 (got {job.cluster.nodes})"
        )
    config = job.train_config()
    refusal = import_refusal(exported_tables(job.tiers.init_from), config.tables_for(source(job).n_slots))
    if refusal:
        raise ConfigError(job.where, "tiers.init_from", f"{job.tiers.init_from} {refusal}")
    spec = TableImport(job.tiers.init_from, config.row_dim, float(config.row_init().state_value))
    return {"init_from": spec}


def exported_tables(directory: str) -> list | None:
    """The ``tables`` of the hpsray export in ``directory`` (``None``: none recorded, or no
    readable export there: the import names that problem itself)."""
    try:
        return read_manifest(directory).get("tables")
    except (ExportError, OSError):
        return None


def cluster_kwargs(job: JobConfig) -> dict:
    """Extra :class:`~hpsray.pipelines.Pipeline` arguments of ``[cluster]``; ``[[tables]]``
    that do not fit the source are refused here, before Ray starts."""
    if job.tables:
        check_tables(job.train_config(), source(job).n_slots)
    c = job.cluster
    if c.chunk_bytes < 4:
        raise ConfigError(job.where, "cluster.chunk_bytes", f"must be at least 4 bytes, got {c.chunk_bytes}")
    return {
        "nodes": c.nodes or None,
        "sync": SyncSettings(**same_fields(SyncSettings, c, dense=c.dense_sync)),
    }


def checkpoint(job: JobConfig, resume: bool = False) -> CheckpointSettings | None:
    """The :class:`~hpsray.pipelines.CheckpointSettings` of ``[checkpoint]`` (``None`` without the
    section). ``resume``: the first ``fit()`` continues from the newest checkpoint in its
    directory; a job without ``[checkpoint]`` cannot resume (:class:`ConfigError`)."""
    c = job.checkpoint
    if c is None:
        if resume:
            raise ConfigError(job.where, "checkpoint.dir", "missing: the job has no [checkpoint] dir to resume from")
        return None
    return CheckpointSettings(
        c.dir, every_batches=c.every_batches, keep=c.keep, max_failures=c.max_failures, resume=resume
    )


def pipeline(
    job: JobConfig,
    address: str | None = None,
    name: str | None = None,
    transforms: Sequence[Callable] = (),
    resume: bool = False,
    preflight: bool = False,
) -> Pipeline:
    """A :class:`~hpsray.pipelines.Pipeline` for ``job`` (``address`` overrides ``cluster.address``);
    ``resume``: its first ``fit()`` continues from the newest checkpoint of ``[checkpoint] dir``;
    ``preflight``: its first ``fit()`` runs the checks of ``hpsray train`` (which runs them
    itself, before Ray starts: off by default)."""
    kwargs = cluster_kwargs(job)
    src = source(job)
    trainer, mem, ssd = stages(job, src.n_slots)
    return Pipeline(
        src,
        trainer,
        mem,
        ssd,
        transforms=transforms,
        batch_size=job.pipeline.batch_size,
        read_queue=job.pipeline.read_queue,
        pull_queue=job.pipeline.pull_queue,
        load_queue=job.pipeline.load_queue,
        write_back_queue=job.pipeline.write_back_queue,
        address=address or job.cluster.address,
        name=name,
        checkpoint=checkpoint(job, resume),
        progress_seconds=job.pipeline.progress_seconds,
        preflight=preflight,
        passes=job.pipeline.passes,
        evaluation=job.evaluation,
        eval_source=eval_source(job) if job.evaluation is not None else None,
        tensorboard=job.report.tensorboard,
        **kwargs,
    )
