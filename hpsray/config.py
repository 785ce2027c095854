"""Typed configuration: :class:`TrainConfig` (shared by the reference trainer and the distributed
system) and :class:`JobConfig`, the TOML job file of ``hpsray train`` (see ``examples/train.toml``).

Every bad value in a job file raises :class:`ConfigError` naming the file, the dotted key and the
reason, e.g. ``job.toml: pipeline.batch_size: must be a positive integer, got -5``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpsray.errors import ConfigError
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SparseOptimizer, make_optimizer


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: model shape, optimizers, mini-batch size, seed.

    Attributes:
        dim: embedding width per key.
        hidden: MLP widths of the :class:`~hpsray.models.DNN`.
        sparse_optimizer: ``sgd``, ``adagrad``, ``adagrad_row`` or ``adam`` (rows, in the tables).
        sparse_lr: learning rate of the sparse optimizer.
        dense_optimizer: ``adam``, ``adagrad`` or ``sgd`` (replicated MLP weights, PyTorch).
        dense_lr: learning rate of the dense optimizer.
        minibatch_size: examples per gradient step.
        init_scale: new rows' weights are uniform in ``[-init_scale, init_scale)``.
        seed: seeds row initialisation and model weights.
    """

    dim: int = 16
    hidden: tuple[int, ...] = (512, 256, 128)
    sparse_optimizer: str = "adagrad"
    sparse_lr: float = 0.05
    dense_optimizer: str = "adam"
    dense_lr: float = 1e-3
    minibatch_size: int = 1024
    init_scale: float = 0.01
    seed: int = 0
    sparse_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"TrainConfig.dim must be >= 1, got {self.dim}")
        if self.minibatch_size < 1:
            raise ValueError(f"TrainConfig.minibatch_size must be >= 1, got {self.minibatch_size}")
        if self.init_scale < 0:
            raise ValueError(f"TrainConfig.init_scale must be >= 0, got {self.init_scale}")
        object.__setattr__(self, "hidden", tuple(self.hidden))
        self.optimizer()  # validates name and parameters

    def optimizer(self) -> SparseOptimizer:
        """The sparse optimizer this config names."""
        return make_optimizer(self.sparse_optimizer, lr=self.sparse_lr, **self.sparse_params)

    @property
    def row_width(self) -> int:
        """Floats per stored row: weights plus optimizer state."""
        return self.dim + self.optimizer().state_width(self.dim)

    def row_init(self) -> RowInit:
        """How new rows are initialised."""
        return RowInit.for_optimizer(self.dim, self.optimizer(), scale=self.init_scale, seed=self.seed)


# ---------------------------------------------------------------------------------------------
# The job file of ``hpsray train``: typed sections, TOML load, validation naming file and key.
# ---------------------------------------------------------------------------------------------

SPARSE_OPTIMIZERS = ("sgd", "adagrad", "adagrad_row", "adam")
DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
DATA_FORMATS = ("criteo", "csv", "parquet")
DEVICES = ("cpu", "cuda")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class _Table:
    """One TOML table being read: each key is taken once; leftovers are unknown keys."""

    def __init__(self, d: Any, prefix: str, where: str) -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(d, Mapping):
            self.fail("", f"must be a table, got {_type(d)}")
        self.d = dict(d)
        self.known: list[str] = []

    def key(self, k: str) -> str:
        return f"{self.prefix}.{k}" if self.prefix else k

    def fail(self, k: str, reason: str):
        raise ConfigError(self.where, self.key(k) if k else self.prefix, reason)

    def take(self, k: str, check: Callable[[Any], Any] | None, default: Any = None, required: bool = False) -> Any:
        self.known.append(k)
        if k not in self.d:
            if required:
                self.fail(k, "missing (required)")
            return default
        v = self.d.pop(k)
        if check is None:
            return v
        try:
            return check(v)
        except _Bad as e:
            self.fail(k, str(e))

    def sub(self, k: str) -> _Table | None:
        self.known.append(k)
        if k not in self.d:
            return None
        return _Table(self.d.pop(k), self.key(k), self.where)

    def done(self) -> None:
        for k in self.d:
            self.fail(k, f"unknown key (known: {', '.join(self.known)})")


_UNSET = object()  # a key the table leaves out (None may be a real value)


class _Bad(Exception):
    """A value's reason for rejection; :class:`_Table` adds file and key."""


def _type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
            dict: "table"}.get(type(v), type(v).__name__)


def _int(lo: int) -> Callable[[Any], int]:
    what = "a positive integer" if lo == 1 else "a non-negative integer" if lo == 0 else f"an integer >= {lo}"

    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise _Bad(f"must be {what}, got {v!r}")
        return v
    return check


def _float(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
           optional: bool = False) -> Callable[[Any], float | None]:
    def check(v: Any) -> float | None:
        if optional and v is False:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise _Bad(f"must be a number{' or false' if optional else ''}, got {v!r}")
        bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if bad_lo or bad_hi:
            lb = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
            ub = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
            rng = f"in {lb}, {ub}" if lo is not None and hi is not None else (
                f"{'>' if lo_open else '>='} {lo:g}" if lo is not None else f"{'<' if hi_open else '<='} {hi:g}")
            raise _Bad(f"must be {rng}, got {v!r}")
        return float(v)
    return check


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in options:
            raise _Bad(f"must be one of {', '.join(options)}, got {v!r}")
        return v.lower()
    return check


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise _Bad(f"must be a string, got {_type(v)} {v!r}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"must be true or false, got {v!r}")
    return v


def _size(v: Any) -> int:
    """Bytes: an integer or a string such as ``"512 MiB"``."""
    if isinstance(v, str):
        m = _SIZE.match(v)
        if not m:
            raise _Bad(f"must be a byte count such as 1073741824 or \"1 GiB\", got {v!r}")
        v = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _Bad(f"must be a positive byte count, got {v!r}")
    return v


def _paths(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or not all(isinstance(p, str) and p for p in v):
        raise _Bad(f"must be a path or a non-empty array of paths, got {v!r}")
    return tuple(v)


def _hidden(v: Any) -> tuple[int, ...]:
    if isinstance(v, bool) or not isinstance(v, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in v):
        raise _Bad(f"must be an array of positive integers (MLP widths), got {v!r}")
    return tuple(v)


def _is_uri(p: str) -> bool:
    return "://" in p


def _resolve(p: str, base: str) -> str:
    """A path from the job file, relative to the file's directory (URIs are left alone)."""
    if _is_uri(p):
        return p
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(base, p))


@dataclass(frozen=True)
class SyntheticSection:
    """``[data.synthetic]``: a planted synthetic stream generated on the fly (no files).

    ``nnz`` is keys per example, spread over the slots (default: one per slot); evaluation uses
    the ``eval_rows`` rows that follow the training rows in the same stream.
    """

    rows: int
    eval_rows: int = 0
    slots: int = 26
    keys: int = 10_000
    nnz: int | None = None
    dense: int = 13
    zipf: float = 1.05
    seed: int = 0

    def generator(self):
        """The :class:`~hpsray.data.PlantedCTR` this table describes."""
        from hpsray.data import PlantedCTR

        nnz = self.slots if self.nnz is None else self.nnz
        return PlantedCTR(n_slots=self.slots, keys_per_slot=self.keys, nnz_per_slot=PlantedCTR.spread_nnz(self.slots, nnz),
                          n_dense=self.dense, zipf_a=self.zipf, seed=self.seed)


@dataclass(frozen=True)
class DataSection:
    """``[data]``: training (and evaluation) examples, from files or generated.

    - ``paths``: files, directories or globs (local or any ``pyarrow.fs``/fsspec URI); relative
      paths resolve against the job file's directory. ``eval_paths``: held-out files.
    - ``format``: ``criteo``, ``csv`` or ``parquet``; ``schema``: the ``[data.schema]`` table
      (:class:`~hpsray.data.Schema`). Without a schema table, ``_schema.toml`` beside the data
      (written by ``hpsray gen-data``) is used, or the Criteo preset when ``format = "criteo"``.
    - ``bad_input``: the ``[data.bad_input]`` policy (lenient by default).
    - ``synthetic``: ``[data.synthetic]`` instead of ``paths``.
    """

    paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    format: str | None = None
    schema: Any = None  # hpsray.data.Schema
    bad_input: Any = None  # hpsray.data.BadInputPolicy
    synthetic: SyntheticSection | None = None


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: embedding width, MLP widths, row initialisation scale and seed."""

    dim: int = 16
    hidden: tuple[int, ...] = (512, 256, 128)
    init_scale: float = 0.01
    seed: int = 0


@dataclass(frozen=True)
class OptimizerSection:
    """``[optimizer]``: the sparse (row) optimizer with ``[optimizer.sparse_params]``, and the dense one."""

    sparse: str = "adagrad"
    sparse_lr: float = 0.05
    sparse_params: dict = field(default_factory=dict)
    dense: str = "adam"
    dense_lr: float = 1e-3


@dataclass(frozen=True)
class TiersSection:
    """``[tiers]``: the MEM-PS budget (``mem_rows`` or ``mem_bytes``), the SSD-PS directory, and
    engine options in ``[tiers.mem]`` (``lru_fraction``, ``aging``, ``history``) and ``[tiers.ssd]``
    (``rows_per_file``, ``stale_threshold``, ``compact_trigger``, ``max_space_ratio``,
    ``background``, ``io_threads``, ``compact_pass_bytes``).

    With neither budget given, MEM-PS holds ``4 × batch_size × slots`` rows. With no
    ``ssd_path`` the SSD-PS files go to a temporary directory removed at the end.
    """

    mem_rows: int | None = None
    mem_bytes: int | None = None
    ssd_path: str | None = None
    mem: dict = field(default_factory=dict)
    ssd: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineSection:
    """``[pipeline]``: batch and mini-batch sizes, read-ahead queue, devices per node."""

    batch_size: int = 65536
    minibatch_size: int = 1024
    read_queue: int = 2
    n_devices: int = 1
    device: str = "cpu"
    threads: int | None = None
    hbm_rows: int | None = None


@dataclass(frozen=True)
class ClusterSection:
    """``[cluster]``: Ray address (empty: ``RAY_ADDRESS`` or an embedded local Ray), node count
    (0: every node of the cluster), consistency across nodes and dense aggregation."""

    address: str | None = None
    nodes: int = 1
    consistency: str = "bsp"
    staleness: int = 2
    dense_sync: str = "allreduce"
    chunk_bytes: int = 32768


def _parse_sub(t: "_Table", parse, sub: "_Table", where: str):
    """``parse(sub.d, where=where)``, its ``ValueError`` re-raised as a ``ConfigError`` of ``t``."""
    try:
        return parse(sub.d, where=where)
    except ValueError as e:
        raise ConfigError(t.where, "", str(e)) from None


@dataclass(frozen=True)
class JobConfig:
    """A training job: everything ``hpsray train JOB.toml`` needs (see ``examples/train.toml``).

    Build with :meth:`load` or :meth:`from_dict`; then :meth:`train_config`, :meth:`source`,
    :meth:`eval_source`, :meth:`stages` and :meth:`pipeline` make the pieces.
    """

    data: DataSection
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    tiers: TiersSection = field(default_factory=TiersSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    where: str = "<config>"
    base_dir: str = "."

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> JobConfig:
        """Read and validate a TOML job file; relative paths in it resolve against its directory."""
        import tomllib

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
        top = _Table(d, "", where)
        data_t = top.sub("data")
        if data_t is None:
            raise ConfigError(where, "data", "missing section: give [data] with paths = [...] or a [data.synthetic] table")
        pipeline = cls._pipeline(top.sub("pipeline") or _Table({}, "pipeline", where))
        job = cls(
            data=cls._data(data_t, base_dir),
            model=cls._model(top.sub("model") or _Table({}, "model", where)),
            optimizer=cls._optimizer(top.sub("optimizer") or _Table({}, "optimizer", where)),
            tiers=cls._tiers(top.sub("tiers") or _Table({}, "tiers", where), base_dir),
            pipeline=pipeline,
            cluster=cls._cluster(top.sub("cluster") or _Table({}, "cluster", where)),
            where=where,
            base_dir=base_dir,
        )
        top.done()
        if job.pipeline.minibatch_size > job.pipeline.batch_size:
            raise ConfigError(where, "pipeline.minibatch_size",
                              f"must not exceed pipeline.batch_size ({job.pipeline.batch_size}), got {job.pipeline.minibatch_size}")
        try:
            job.train_config()
        except (ValueError, TypeError) as e:
            raise ConfigError(where, "optimizer", str(e)) from None
        return job

    @staticmethod
    def _data(t: _Table, base: str) -> DataSection:
        from hpsray.data import LENIENT, BadInputPolicy, Schema

        paths = t.take("paths", _paths, ())
        eval_paths = t.take("eval_paths", _paths, ())
        fmt = t.take("format", _choice(DATA_FORMATS))
        schema = None
        schema_t = t.sub("schema")
        if schema_t is not None:
            schema = _parse_sub(t, Schema.from_dict, schema_t, "data.schema")
            if fmt is not None and schema.format != fmt:
                t.fail("format", f"{fmt!r} contradicts data.schema.format {schema.format!r}")
        policy = LENIENT
        bad_t = t.sub("bad_input")
        if bad_t is not None:
            policy = _parse_sub(t, BadInputPolicy.from_dict, bad_t, "data.bad_input")
        synthetic = None
        syn_t = t.sub("synthetic")
        if syn_t is not None:
            synthetic = SyntheticSection(
                rows=syn_t.take("rows", _int(1), required=True),
                eval_rows=syn_t.take("eval_rows", _int(0), 0),
                slots=syn_t.take("slots", _int(1), 26),
                keys=syn_t.take("keys", _int(1), 10_000),
                nnz=syn_t.take("nnz", _int(1)),
                dense=syn_t.take("dense", _int(0), 13),
                zipf=syn_t.take("zipf", _float(0.0, lo_open=True), 1.05),
                seed=syn_t.take("seed", _int(0), 0),
            )
            syn_t.done()
            if synthetic.nnz is not None and synthetic.nnz < synthetic.slots:
                syn_t.fail("nnz", f"keys per example must be >= slots ({synthetic.slots}), got {synthetic.nnz}")
        t.done()
        if synthetic is not None and paths:
            t.fail("paths", "give either data.paths or a [data.synthetic] table, not both")
        if synthetic is None and not paths:
            t.fail("paths", "missing: give data.paths = [...] (files, directories or globs) or a [data.synthetic] table")
        if synthetic is not None and (eval_paths or schema is not None or fmt is not None):
            t.fail("synthetic", "generated data takes no eval_paths, format or schema")
        return DataSection(
            paths=tuple(_resolve(p, base) for p in paths),
            eval_paths=tuple(_resolve(p, base) for p in eval_paths),
            format=fmt, schema=schema, bad_input=policy, synthetic=synthetic,
        )

    @staticmethod
    def _model(t: _Table) -> ModelSection:
        m = ModelSection(
            dim=t.take("dim", _int(1), 16),
            hidden=t.take("hidden", _hidden, (512, 256, 128)),
            init_scale=t.take("init_scale", _float(0.0), 0.01),
            seed=t.take("seed", _int(0), 0),
        )
        t.done()
        return m

    @staticmethod
    def _optimizer(t: _Table) -> OptimizerSection:
        sparse = t.take("sparse", _choice(SPARSE_OPTIMIZERS), "adagrad")
        sparse_lr = t.take("sparse_lr", _float(0.0, lo_open=True), 0.05)
        dense = t.take("dense", _choice(DENSE_OPTIMIZERS), "adam")
        dense_lr = t.take("dense_lr", _float(0.0, lo_open=True), 1e-3)
        params_t = t.sub("sparse_params")
        params: dict = {}
        if params_t is not None:
            allowed = _optimizer_params(sparse)
            for k, v in params_t.d.items():
                if k not in allowed:
                    params_t.fail(k, f"not a parameter of the {sparse} optimizer (known: {', '.join(allowed) or 'none'})")
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    params_t.fail(k, f"must be a number, got {v!r}")
                params[k] = float(v)
            try:
                make_optimizer(sparse, lr=sparse_lr, **params)
            except ValueError as e:
                params_t.fail("", str(e))
        t.done()
        return OptimizerSection(sparse, sparse_lr, params, dense, dense_lr)

    @staticmethod
    def _tiers(t: _Table, base: str) -> TiersSection:
        mem_rows = t.take("mem_rows", _int(1))
        mem_bytes = t.take("mem_bytes", _size)
        ssd_path = t.take("ssd_path", _str)
        mem: dict = {}
        mem_t = t.sub("mem")
        if mem_t is not None:
            for k, check in (("lru_fraction", _float(0.0, 1.0)),
                             ("aging", _float(0.0, lo_open=True, optional=True)),
                             ("history", _float(0.0, lo_open=True, optional=True))):
                v = mem_t.take(k, check, _UNSET)
                if v is not _UNSET:
                    mem[k] = v
            mem_t.done()
        ssd: dict = {}
        ssd_t = t.sub("ssd")
        if ssd_t is not None:
            for k, check in (("rows_per_file", _int(1)),
                             ("stale_threshold", _float(0.0, 1.0, lo_open=True, hi_open=True)),
                             ("compact_trigger", _float(1.0)),
                             ("max_space_ratio", _float(1.0, optional=True)),
                             ("background", _bool),
                             ("io_threads", _int(1)),
                             ("compact_pass_bytes", _size)):
                v = ssd_t.take(k, check, _UNSET)
                if v is not _UNSET:
                    ssd[k] = v
            ssd_t.done()
        t.done()
        if mem_rows is not None and mem_bytes is not None:
            t.fail("mem_bytes", "give either tiers.mem_rows or tiers.mem_bytes, not both")
        if ssd_path is not None and not ssd_path:
            t.fail("ssd_path", "must not be empty (leave it out for a temporary directory)")
        if ssd_path is not None and _is_uri(ssd_path):
            t.fail("ssd_path", f"must be a local directory (SSD-PS files live on the node's disk), got {ssd_path!r}")
        return TiersSection(mem_rows, mem_bytes, _resolve(ssd_path, base) if ssd_path else None, mem, ssd)

    @staticmethod
    def _pipeline(t: _Table) -> PipelineSection:
        p = PipelineSection(
            batch_size=t.take("batch_size", _int(1), 65536),
            minibatch_size=t.take("minibatch_size", _int(1), 1024),
            read_queue=t.take("read_queue", _int(1), 2),
            n_devices=t.take("n_devices", _int(1), 1),
            device=t.take("device", _choice(DEVICES), "cpu"),
            threads=t.take("threads", _int(1)),
            hbm_rows=t.take("hbm_rows", _int(1)),
        )
        t.done()
        return p

    @staticmethod
    def _cluster(t: _Table) -> ClusterSection:
        c = ClusterSection(address=t.take("address", _str) or None, nodes=t.take("nodes", _int(0), 1),
                           consistency=t.take("consistency", _choice(("bsp", "ssp", "asp")), "bsp"),
                           staleness=t.take("staleness", _int(0), 2),
                           dense_sync=t.take("dense_sync", _choice(("allreduce", "chunked")), "allreduce"),
                           chunk_bytes=t.take("chunk_bytes", _size, 32768))
        t.done()
        return c

    # -- building the pieces ------------------------------------------------------------------

    def train_config(self) -> TrainConfig:
        """The :class:`TrainConfig` (model shape, optimizers, mini-batch, seed) of this job."""
        return TrainConfig(
            dim=self.model.dim, hidden=self.model.hidden, sparse_optimizer=self.optimizer.sparse,
            sparse_lr=self.optimizer.sparse_lr, dense_optimizer=self.optimizer.dense,
            dense_lr=self.optimizer.dense_lr, minibatch_size=self.pipeline.minibatch_size,
            init_scale=self.model.init_scale, seed=self.model.seed, sparse_params=dict(self.optimizer.sparse_params),
        )

    def schema(self):
        """The data's :class:`~hpsray.data.Schema` (``None`` for generated data); see :class:`DataSection`."""
        from hpsray.data import Schema, load_dataset
        from hpsray.data.generate import SCHEMA_FILE

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
                raise ConfigError(self.where, "data.format",
                                  f"{d.format!r} contradicts {directory}/{SCHEMA_FILE} (format {schema.format!r})")
            return schema
        if d.format == "criteo":
            return Schema.criteo()
        raise ConfigError(self.where, "data.schema",
                          f"missing: no [data.schema] table and no {SCHEMA_FILE} in {directory}; declare the columns "
                          "(or set data.format = \"criteo\" for Criteo TSV)")

    def source(self):
        """The training source: :class:`~hpsray.pipelines.SyntheticSource` or :class:`~hpsray.pipelines.FileSource`."""
        from hpsray.pipelines.sources import FileSource, SyntheticSource

        syn = self.data.synthetic
        if syn is not None:
            return SyntheticSource(syn.generator(), syn.rows)
        return FileSource(list(self.data.paths), self.schema(), self.data.bad_input)

    def eval_source(self):
        """The held-out source, or ``None`` when the job names no evaluation data."""
        from hpsray.pipelines.sources import FileSource, SyntheticSource

        syn = self.data.synthetic
        if syn is not None:
            return SyntheticSource(syn.generator(), syn.eval_rows, start_row=syn.rows) if syn.eval_rows else None
        if not self.data.eval_paths:
            return None
        return FileSource(list(self.data.eval_paths), self.schema(), self.data.bad_input)

    def stages(self, n_slots: int | None = None):
        """``(TrainerStage, MemPSStage, SSDPSStage)`` of this job. ``n_slots`` sizes the default
        MEM-PS budget (read from the schema when not given)."""
        from hpsray.pipelines.stages import MemPSStage, SSDPSStage, TrainerStage

        t, p = self.tiers, self.pipeline
        trainer = TrainerStage(config=self.train_config(), n_devices=p.n_devices, device=p.device,
                               threads=p.threads, hbm_capacity=p.hbm_rows)
        if t.mem_bytes is not None:
            mem = MemPSStage(capacity_bytes=t.mem_bytes, options=dict(t.mem))
        else:
            if t.mem_rows is None and n_slots is None:
                n_slots = self.source().n_slots
            rows = t.mem_rows if t.mem_rows is not None else 4 * p.batch_size * max(n_slots or 1, 1)
            mem = MemPSStage(capacity_rows=rows, options=dict(t.mem))
        return trainer, mem, SSDPSStage(path=t.ssd_path, options=dict(t.ssd))

    def build_pipeline(self, address: str | None = None, name: str | None = None, transforms=()):
        """A :class:`~hpsray.pipelines.Pipeline` for this job (``address`` overrides ``cluster.address``)."""
        from hpsray.pipelines.pipeline import Pipeline

        kwargs = self.cluster_kwargs()
        source = self.source()
        trainer, mem, ssd = self.stages(source.n_slots)
        return Pipeline(source, trainer, mem, ssd, transforms=transforms, batch_size=self.pipeline.batch_size,
                        read_queue=self.pipeline.read_queue, address=address or self.cluster.address, name=name,
                        **kwargs)

    def cluster_kwargs(self) -> dict:
        """Extra :class:`~hpsray.pipelines.Pipeline` arguments of ``[cluster]``."""
        from hpsray.pipelines.stages import SyncStage

        c = self.cluster
        if c.chunk_bytes < 4:
            raise ConfigError(self.where, "cluster.chunk_bytes", f"must be at least 4 bytes, got {c.chunk_bytes}")
        return {"nodes": c.nodes or None,
                "sync": SyncStage(consistency=c.consistency, staleness=c.staleness, dense=c.dense_sync,
                                  chunk_bytes=c.chunk_bytes)}

    def to_dict(self) -> dict:
        """The resolved job as plain data (for the run report): defaults filled, paths absolute."""
        from dataclasses import asdict

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
        return out


def _optimizer_params(name: str) -> tuple[str, ...]:
    """Extra parameters (besides ``lr``) the named sparse optimizer takes."""
    from dataclasses import fields as dc_fields

    opt = make_optimizer(name)
    return tuple(f.name for f in dc_fields(opt) if f.init and f.name not in ("lr", "kind", "per_row"))


def _data_directory(path: str) -> str:
    """The directory holding ``path``: itself if a directory, else the part before any glob or file name."""
    m = re.search(r"[*?\[]", path)
    if m:
        return path[: m.start()].rsplit("/", 1)[0] or "."
    if _is_uri(path):
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
