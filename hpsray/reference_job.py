"""The reference trainer run on a job file, as ``hpsray train --reference`` runs it: the same
source, batches and order as the pipeline, its shares for N nodes of D devices, the same start
from ``[tiers] init_from``, and a run report with the pipeline's keys. The oracle itself
(:mod:`hpsray.reference`) knows nothing of jobs, tiers or pipelines; this module joins them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hpsray.evaluation import EvalPoint, EvalTrack
from hpsray.report import Evaluation, RunReport

if TYPE_CHECKING:
    from hpsray.job import JobConfig
    from hpsray.reference import ReferenceTrainer

__all__ = ["evaluate_into", "train_reference"]


def preload(trainer: ReferenceTrainer, spec: Any) -> None:
    """Start ``trainer``'s tables from the rows of ``[tiers] init_from`` (``spec``, a
    ``TableImport`` the job's tables were checked against): each table's rows are the keys of
    its tag; tables of several widths read from the export's columns as wide as the widest
    table's parts (each row its own weights, then its own state)."""
    from hpsray.tables import export_columns
    from hpsray.tiers.ssd.bulkload import narrow, read_table

    tables = trainer.tables
    if tables is None:
        trainer.store.preload(*read_table(spec.path, spec.dim, trainer.config.row_width, spec.state_value))
        return
    dim, state = export_columns(tables.dims, tables.widths)
    keys, rows = read_table(spec.path, dim, dim + state, spec.state_value)
    tag = tables.table_of(keys)
    for t, store in enumerate(trainer.stores):
        store.preload(keys[tag == t], narrow(rows[tag == t], dim, tables.dims[t], tables.widths[t]))


def train_reference(job: JobConfig, quiet: bool) -> tuple[RunReport, tuple]:
    """Fit ``job`` with the in-memory :class:`~hpsray.reference.ReferenceTrainer`, same batches, same order."""
    from hpsray.job import build
    from hpsray.pipelines.progress import Progress, known_examples, progress_seconds
    from hpsray.reference import ReferenceTrainer, global_batches

    source = build.source(job)
    bs = job.pipeline.batch_size
    n_nodes = job.cluster.nodes
    if n_nodes == 0:
        raise ValueError("cluster.nodes: --reference needs the node count (0 means 'whatever the cluster has')")
    one_share = n_nodes == 1 and job.pipeline.n_devices == 1
    trainer = ReferenceTrainer(
        source.n_slots,
        source.n_dense,
        job.train_config(),
        admit_after=job.tiers.admit_after,
        expire_after_batches=job.tiers.expire_after_batches,
        threads=job.pipeline.threads,  # the trainer's: a dense gradient's sums depend on them
    )
    if job.tiers.init_from:  # the same start as the pipeline's: the imported rows
        preload(trainer, build.init_from(job)["init_from"])
    held_out = build.eval_source(job) if job.evaluation is not None else None
    track = EvalTrack(job.evaluation) if job.evaluation is not None and held_out is not None else None
    best_model: tuple | None = None

    def evaluate(eval_source: Any) -> dict:
        r = trainer.evaluate(eval_source.open(bs))
        return {"auc": r.auc, "logloss": r.logloss, "examples": r.examples}

    def score(batches: int, pass_index: int) -> bool:
        """Evaluate after ``batches`` batches, as the pipeline does; returns whether to stop."""
        nonlocal best_model
        assert track is not None and held_out is not None
        if track.points and track.points[-1].batches == batches:
            return track.stop
        t0 = time.perf_counter()
        got = evaluate(held_out)
        point = EvalPoint(batches, pass_index, got["auc"], got["logloss"], got["examples"], time.perf_counter() - t0)
        if track.record(point) and track.settings.patience is not None:
            best_model = export(trainer)
        return track.stop

    per_read, per_train, losses = {}, {}, {}
    t0 = time.perf_counter()
    t = 0
    data_reader = None
    stopped = False
    for pass_index in range(job.pipeline.passes):
        data_reader = source.reader(bs) if hasattr(source, "reader") and one_share else None
        if data_reader is not None:
            it = iter(data_reader)
        elif one_share:
            it = source.open(bs)
        else:  # what N nodes of D devices train: per batch, the global mini-batches of every share
            it = global_batches(source, bs, n_nodes, job.train_config().minibatch_size, job.pipeline.n_devices)
        desc = "reference" if job.pipeline.passes == 1 else f"reference pass {pass_index + 1}/{job.pipeline.passes}"
        bar = Progress(known_examples(source), not quiet, progress_seconds(job.pipeline.progress_seconds), desc=desc)
        in_pass, before = 0, trainer.examples
        while True:
            r0 = time.perf_counter()
            batch = next(it, None)
            per_read[str(t)] = time.perf_counter() - r0
            if batch is None:
                break
            s0 = time.perf_counter()
            if isinstance(batch, list):
                trainer.model.train()
                losses[str(t)] = trainer.train_minibatches(batch)  # one batch, as admission counts it
            else:
                losses[str(t)] = trainer.train_batch(batch)
            per_train[str(t)] = time.perf_counter() - s0
            bar.update(trainer.examples - before - bar.n)
            t += 1
            in_pass += 1
            if track is not None and track.due(in_pass) and score(t, pass_index):
                stopped = True
                break
        bar.pass_end()
        bar.close()
        if stopped or (track is not None and score(t, pass_index)):
            break
    wall = time.perf_counter() - t0
    if t == 0:
        raise ValueError("the source produced no examples")
    report = RunReport(
        trainer="reference",
        mode="reference",
        nodes=n_nodes,
        batches=t,
        examples=trainer.examples,
        wall_s=wall,
        stage_busy_s={"read": sum(per_read.values()), "train": sum(per_train.values())},
        per_batch_s={"read": per_read, "train": per_train},
        cache_hit_rate={},
        loss=losses,
        bad_input=data_reader.report.to_dict() if data_reader is not None else {},
    )
    if track is not None:
        report.evaluations = track.as_dict()

    if best_model is not None and track is not None and track.best is not None:  # early stopping: the best
        best = track.best
        report.evaluation = Evaluation(auc=best.auc, logloss=best.logloss, eval_examples=best.examples)
    else:
        evaluate_into(report, job, evaluate)
    model = best_model if best_model is not None else export(trainer)
    report.rows = int(model[0].size)
    return report, model


def export(trainer: Any) -> tuple:
    """What ``trainer`` learnt: ``(keys, rows, dense state)``; with tables, every table's tagged
    keys together as the pipeline exports them, each row at ``config.row_width`` (a table
    narrower than the widest: its row, then zeros; :mod:`hpsray.export.layout` lays them out)."""
    if trainer.tables is None:
        return trainer.export()
    parts = trainer.export_tables()
    keys = np.concatenate([k for k, _ in parts.values()])
    rows = np.zeros((keys.size, trainer.config.row_width), np.float32)
    at = 0
    for _, r in parts.values():
        rows[at : at + r.shape[0], : r.shape[1]] = r
        at += r.shape[0]
    order = np.argsort(keys, kind="stable")
    return keys[order], rows[order], trainer.dense_state()


def evaluate_into(report: RunReport, job: JobConfig, evaluate: Callable[[Any], dict]) -> None:
    """Evaluate on ``job``'s held-out data with ``evaluate`` (a source to auc, logloss and
    examples) into ``report.evaluation`` (``None`` and 0 examples without held-out data)."""
    from hpsray.job import build

    eval_source = build.eval_source(job)
    if eval_source is None:
        report.evaluation = Evaluation(auc=None, logloss=None, eval_examples=0)
        return
    result = evaluate(eval_source)
    report.evaluation = Evaluation(auc=result["auc"], logloss=result["logloss"], eval_examples=result["examples"])
