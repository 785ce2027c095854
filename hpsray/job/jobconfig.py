"""``JobConfig``: the TOML job file of ``hpsray train`` (see ``examples/train.toml``), validated.

Every bad value raises :class:`~hpsray.errors.ConfigError` naming the file, the dotted key and the
reason, e.g. ``job.toml: pipeline.batch_size: must be a positive integer, got -5``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import tomllib

from hpsray.config import TrainConfig
from hpsray.data import load_dataset
from hpsray.data.formats import get_format
from hpsray.data.generate import SCHEMA_FILE
from hpsray.errors import ConfigError
from hpsray.evaluation import EvalSettings
from hpsray.first_order import needs_first_order
from hpsray.job import validate as chk
from hpsray.job.sections import (
    CheckpointSection,
    ClusterSection,
    DataSection,
    ModelSection,
    OptimizerSection,
    PipelineSection,
    ReportSection,
    TiersSection,
    parse_checkpoint,
    parse_cluster,
    parse_data,
    parse_eval,
    parse_model,
    parse_optimizer,
    parse_pipeline,
    parse_report,
    parse_tiers,
)
from hpsray.job.tables import parse_tables, resolve_tables
from hpsray.tables import Tables, TableSpec, with_first_order

__all__ = ["JobConfig"]


@dataclass(frozen=True)
class JobConfig:
    """A training job: everything ``hpsray train JOB.toml`` needs (see ``examples/train.toml``).

    Build with :meth:`load` or :meth:`from_dict`; :meth:`train_config` and :meth:`schema` say
    what it trains on; :mod:`hpsray.job.build` makes its sources, stages and pipeline.
    """

    data: DataSection
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    tiers: TiersSection = field(default_factory=TiersSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    checkpoint: CheckpointSection | None = None  # no [checkpoint]: no checkpoints
    evaluation: EvalSettings | None = None  # no [eval]: one evaluation at the end
    report: ReportSection = field(default_factory=ReportSection)
    tables: tuple[TableSpec, ...] = ()  # [[tables]], columns resolved to slots; none: one table
    where: str = "<config>"
    base_dir: str = "."

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> JobConfig:
        """Read and validate a TOML job file; relative paths in it resolve against its directory."""
        where = os.fspath(path)
        try:
            with open(where, "rb") as f:
                d = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(where, "", "no such file") from None
        except IsADirectoryError:
            raise ConfigError(where, "", "is a directory, not a TOML file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(where, "", f"not valid TOML: {e}") from None
        return cls.from_dict(d, where=where, base_dir=os.path.dirname(os.path.abspath(where)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "<config>", base_dir: str | None = None) -> JobConfig:
        """Validate a parsed job table. ``where`` names the file in errors; relative paths resolve
        against ``base_dir`` (default: ``where``'s directory when it names a file, else the cwd)."""
        if base_dir is None:
            base_dir = os.path.dirname(os.path.abspath(where)) if os.path.isfile(where) else os.getcwd()
        top = chk.Table(d, "", where)
        data_t = top.sub("data")
        if data_t is None:
            raise ConfigError(
                where, "data", "missing section: give [data] with paths = [...] or a [data.synthetic] table"
            )
        pipeline = parse_pipeline(top.sub("pipeline") or chk.Table({}, "pipeline", where))
        checkpoint_t = top.sub("checkpoint")
        eval_t = top.sub("eval")
        report_t = top.sub("report")
        tables_v = top.take("tables", None)
        job = cls(
            data=parse_data(data_t, base_dir),
            model=parse_model(top.sub("model") or chk.Table({}, "model", where)),
            optimizer=parse_optimizer(top.sub("optimizer") or chk.Table({}, "optimizer", where)),
            tiers=parse_tiers(top.sub("tiers") or chk.Table({}, "tiers", where), base_dir),
            pipeline=pipeline,
            cluster=parse_cluster(top.sub("cluster") or chk.Table({}, "cluster", where)),
            checkpoint=parse_checkpoint(checkpoint_t, base_dir) if checkpoint_t is not None else None,
            evaluation=parse_eval(eval_t) if eval_t is not None else None,
            report=parse_report(report_t, base_dir) if report_t is not None else ReportSection(),
            where=where,
            base_dir=base_dir,
        )
        top.done()
        if tables_v is not None:
            job = _with_tables(job, parse_tables(tables_v, where, job.optimizer.sparse))
        if job.pipeline.minibatch_size > job.pipeline.batch_size:
            raise ConfigError(
                where,
                "pipeline.minibatch_size",
                f"must not exceed pipeline.batch_size ({job.pipeline.batch_size}), got {job.pipeline.minibatch_size}",
            )
        syn = job.data.synthetic
        if job.evaluation is not None and not (job.data.eval_paths or (syn is not None and syn.eval_rows)):
            raise ConfigError(where, "eval", "needs held-out data: [data] eval_paths or [data.synthetic] eval_rows")
        if job.pipeline.n_devices > 1 and job.cluster.consistency != "bsp":
            raise ConfigError(
                where,
                "cluster.consistency",
                f"{job.cluster.consistency!r} needs pipeline.n_devices = 1 (the device mesh of "
                f"n_devices = {job.pipeline.n_devices} synchronises BSP only)",
            )
        try:
            job.train_config()
        except (ValueError, TypeError) as e:
            raise ConfigError(where, "optimizer", str(e)) from None
        return job

    # -- what it describes ---------------------------------------------------------------------

    def train_config(self) -> TrainConfig:
        """The :class:`TrainConfig` (model shape, optimizers, mini-batch, seed) of this job; a model
        of first-order rows (DeepFM, Wide & Deep) with their table (:mod:`hpsray.first_order`)
        when the job's slots are known."""
        config = self._config()
        if not needs_first_order(config):
            return config
        syn = self.data.synthetic
        try:
            schema = None if syn is not None else self.schema()
        except ConfigError:  # named by whatever reads the data; bound there (Pipeline, the trainers)
            return config
        return with_first_order(config, syn.slots if syn is not None else schema.n_slots)  # type: ignore[union-attr]

    def _config(self) -> TrainConfig:
        return TrainConfig(
            dim=self.model.dim,
            hidden=self.model.hidden,
            sparse_optimizer=self.optimizer.sparse,
            sparse_lr=self.optimizer.sparse_lr,
            dense_optimizer=self.optimizer.dense,
            dense_lr=self.optimizer.dense_lr,
            minibatch_size=self.pipeline.minibatch_size,
            init_scale=self.model.init_scale,
            seed=self.model.seed,
            sparse_params=dict(self.optimizer.sparse_params),
            model_kind=self.model.kind,
            model_settings=dict(self.model.settings),
            tables=self.tables,
        )

    def schema(self):
        """The data's :class:`~hpsray.data.Schema` (``None`` for generated data); see :class:`DataSection`."""
        d = self.data
        if d.synthetic is not None:
            return None
        if d.schema is not None:
            return d.schema
        directory = _data_directory(d.paths[0])
        try:
            schema, _ = load_dataset(directory)
        except FileNotFoundError:
            schema = None
        except OSError as e:
            raise ConfigError(self.where, "data.paths", f"cannot read {directory}/{SCHEMA_FILE}: {e}") from None
        except ValueError as e:
            raise ConfigError(self.where, "data.schema", f"{directory}/{SCHEMA_FILE} is invalid: {e}") from None
        if schema is not None:
            if d.format is not None and schema.format != d.format:
                raise ConfigError(
                    self.where,
                    "data.format",
                    f"{d.format!r} contradicts {directory}/{SCHEMA_FILE} (format {schema.format!r})",
                )
            return schema
        preset = get_format(d.format).preset() if d.format is not None else None
        if preset is not None:
            return preset
        raise ConfigError(
            self.where,
            "data.schema",
            f"missing: no [data.schema] table and no {SCHEMA_FILE} in {directory}; declare the columns "
            '(or set data.format = "criteo" for Criteo TSV)',
        )

    def to_dict(self) -> dict:
        """The resolved job as plain data (for the run report): defaults filled, paths absolute."""
        out: dict = {}
        for name in ("model", "optimizer", "tiers", "pipeline", "cluster"):
            out[name] = asdict(getattr(self, name))
        d = self.data
        data: dict = {"paths": list(d.paths), "eval_paths": list(d.eval_paths), "format": d.format}
        if d.synthetic is not None:
            data["synthetic"] = asdict(d.synthetic)
        if d.schema is not None:
            data["schema"] = d.schema.to_dict()
        if d.bad_input is not None:
            data["bad_input"] = asdict(d.bad_input)
        out["data"] = data
        out["model"]["hidden"] = list(self.model.hidden)
        out["checkpoint"] = asdict(self.checkpoint) if self.checkpoint is not None else None
        if self.tables:
            out["tables"] = [asdict(spec) for spec in self.tables]
        return out


def _with_tables(job: JobConfig, entries: tuple) -> JobConfig:
    """``job`` with its ``[[tables]]`` resolved (columns by its schema) and checked against its
    slots and its model kind; a :class:`ConfigError` names the entry and its key."""
    from dataclasses import replace

    from hpsray.models.kinds import mixed_dims_refusal

    syn = job.data.synthetic
    schema = None if syn is not None else job.schema()
    specs = resolve_tables(entries, job.where, job.model.dim, schema)
    job = replace(job, tables=specs)
    n_slots = syn.slots if syn is not None else schema.n_slots  # type: ignore[union-attr]  # files have one
    try:
        tables = Tables(specs, n_slots, job.train_config())
    except ConfigError as e:
        raise ConfigError(job.where, e.key, e.reason) from None
    refusal = mixed_dims_refusal(job.model.kind, tables)
    if refusal:
        raise ConfigError(job.where, "model.kind", refusal)
    return job


def _data_directory(path: str) -> str:
    """The directory holding ``path``: itself if a directory, else the part before any glob or file name."""
    m = re.search(r"[*?\[]", path)
    if m:
        return path[: m.start()].rsplit("/", 1)[0] or "."
    if chk.is_uri(path):
        import pyarrow.fs as pafs

        from hpsray.data import resolve_filesystem

        try:
            fs, p, _ = resolve_filesystem(path)
            if fs.get_file_info(p).type == pafs.FileType.Directory:
                return path
        except (OSError, ValueError):
            pass
        return path.rsplit("/", 1)[0]
    return path if os.path.isdir(path) else (os.path.dirname(path) or ".")
