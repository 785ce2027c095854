"""The sections of a job file (``[data]``, ``[model]``, ``[optimizer]``, ``[tiers]``, ``[pipeline]``,
``[cluster]``, ``[checkpoint]``): one frozen dataclass each, and the function that reads and validates its table.

Every rejection raises :class:`~hpsray.errors.ConfigError` naming the file, the dotted key and the
reason. The choices offered (optimizers, devices, consistency modes) are those of
:mod:`hpsray.config`; data formats those of :mod:`hpsray.data.schema`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from dataclasses import fields as dc_fields
from typing import Any

from hpsray.config import (
    CONSISTENCY_MODES,
    DENSE_OPTIMIZERS,
    DENSE_SYNC,
    DEVICES,
    PROPAGATIONS,
    SPARSE_OPTIMIZERS,
)
from hpsray.data import LENIENT, BadInputPolicy, PlantedCTR, Schema
from hpsray.data.formats import format_names
from hpsray.errors import ConfigError
from hpsray.evaluation import METRICS, EvalSettings
from hpsray.job import validate as chk
from hpsray.kernels.optim import make_optimizer

__all__ = [
    "CheckpointSection",
    "ClusterSection",
    "DataSection",
    "ModelSection",
    "OptimizerSection",
    "PipelineSection",
    "SyntheticSection",
    "TiersSection",
    "optimizer_params",
    "parse_checkpoint",
    "parse_cluster",
    "parse_data",
    "parse_model",
    "parse_optimizer",
    "parse_pipeline",
    "parse_tiers",
]


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
        nnz = self.slots if self.nnz is None else self.nnz
        return PlantedCTR(
            n_slots=self.slots,
            keys_per_slot=self.keys,
            nnz_per_slot=PlantedCTR.spread_nnz(self.slots, nnz),
            n_dense=self.dense,
            zipf_a=self.zipf,
            seed=self.seed,
        )


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
    """``[model]``: embedding width, the dense model's ``kind`` (:data:`~hpsray.models.kinds.MODEL_KINDS`)
    and that kind's settings (``hidden`` for ``mlp``; docs/models.md), row initialisation scale and seed."""

    dim: int = 16
    hidden: tuple[int, ...] = (512, 256, 128)
    init_scale: float = 0.01
    seed: int = 0
    kind: str = "mlp"
    settings: dict = field(default_factory=dict)  # the kind's settings other than mlp's hidden


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
    ``background``, ``io_threads``, ``compact_pass_bytes``, ``merge_small_files``); feature
    admission and expiry
    (``admit_after``: a key gets a row from the ``admit_after``-th batch it is seen in;
    ``expire_after_batches``: rows not seen for that many batches are dropped; both off by default);
    ``dumps_in_flight``: evictions written to SSD-PS behind MEM-PS's back at most at once;
    ``init_from``: a directory of Parquet rows (an export, docs/tiers.md "Starting from a table")
    that a fresh SSD-PS loads before training.

    With neither budget given, MEM-PS holds ``4 × batch_size × slots`` rows. With no
    ``ssd_path`` the SSD-PS files go to a temporary directory removed at the end.
    """

    mem_rows: int | None = None
    mem_bytes: int | None = None
    ssd_path: str | None = None
    mem: dict = field(default_factory=dict)
    ssd: dict = field(default_factory=dict)
    admit_after: int = 0
    expire_after_batches: int | None = None
    dumps_in_flight: int = 4
    init_from: str | None = None


@dataclass(frozen=True)
class PipelineSection:
    """``[pipeline]``: batch and mini-batch sizes, the four edges' capacities (``read_queue``,
    ``pull_queue``, ``load_queue``, ``write_back_queue``), devices per node, and the seconds
    between progress lines (``progress_seconds``; unset: ``$HPSRAY_PROGRESS_SECONDS``, else 30),
    and the passes over the data (``passes``)."""

    batch_size: int = 65536
    minibatch_size: int = 1024
    read_queue: int = 2
    pull_queue: int = 2
    load_queue: int = 2
    write_back_queue: int = 2
    n_devices: int = 1
    device: str = "cpu"
    threads: int | None = None
    hbm_rows: int | None = None
    progress_seconds: float | None = None
    passes: int = 1


@dataclass(frozen=True)
class ReportSection:
    """``[report]``: ``tensorboard``, a directory for TensorBoard scalars (``None``: none)."""

    tensorboard: str | None = None


@dataclass(frozen=True)
class ClusterSection:
    """``[cluster]``: Ray address (empty: ``RAY_ADDRESS`` or an embedded local Ray), node count
    (0: every node of the cluster), consistency across nodes and dense aggregation;
    ``fault_timeout_s``: how long any wait on another process may last (docs/operations.md:
    Network faults)."""

    address: str | None = None
    nodes: int = 1
    consistency: str = "bsp"
    staleness: int = 2
    dense_staleness: int | None = None
    work_per_clock: int = 4
    propagation: str = "push"
    dense_sync: str = "allreduce"
    chunk_bytes: int = 32768
    fault_timeout_s: float = 90.0  # hpsray.cluster.faults.DEFAULT_FAULT_TIMEOUT_S (this layer imports no Ray code)


@dataclass(frozen=True)
class CheckpointSection:
    """``[checkpoint]``: where and how often the pipeline checkpoints (docs/operations.md:
    Checkpoints, recovery and resume).

    - ``dir``: the checkpoint directory (required; relative paths resolve against the job file's
      directory). On several hosts it must be a shared file system mounted at the same path on
      every node; on the file system of ``tiers.ssd_path`` the SSD-PS snapshots are hard links,
      elsewhere copies.
    - ``every_batches``: a checkpoint every that many batches (and at the start of each pass).
    - ``keep``: how many of the newest checkpoints stay.
    - ``max_failures``: dead actors (or nodes) one ``fit()`` recovers from before it gives up.

    Without the section there are no checkpoints, a dead actor stops training and
    ``hpsray train --resume`` has nothing to continue from.
    """

    dir: str
    every_batches: int = 50
    keep: int = 2
    max_failures: int = 3


# -- reading each section's table ---------------------------------------------------------


def parse_data(t: chk.Table, base: str) -> DataSection:

    paths = t.take("paths", chk.paths, ())
    eval_paths = t.take("eval_paths", chk.paths, ())
    fmt = t.take("format", chk.choice(format_names()))
    schema = None
    schema_t = t.sub("schema")
    if schema_t is not None:
        schema = chk.parse_sub(t, Schema.from_dict, schema_t, "data.schema")
        if fmt is not None and schema.format != fmt:
            t.fail("format", f"{fmt!r} contradicts data.schema.format {schema.format!r}")
    policy = LENIENT
    bad_t = t.sub("bad_input")
    if bad_t is not None:
        policy = chk.parse_sub(t, BadInputPolicy.from_dict, bad_t, "data.bad_input")
    synthetic = None
    syn_t = t.sub("synthetic")
    if syn_t is not None:
        synthetic = SyntheticSection(
            rows=syn_t.take("rows", chk.integer(1), required=True),
            eval_rows=syn_t.take("eval_rows", chk.integer(0), 0),
            slots=syn_t.take("slots", chk.integer(1), 26),
            keys=syn_t.take("keys", chk.integer(1), 10_000),
            nnz=syn_t.take("nnz", chk.integer(1)),
            dense=syn_t.take("dense", chk.integer(0), 13),
            zipf=syn_t.take("zipf", chk.number(0.0, lo_open=True), 1.05),
            seed=syn_t.take("seed", chk.integer(0), 0),
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
        paths=tuple(chk.resolve_path(p, base) for p in paths),
        eval_paths=tuple(chk.resolve_path(p, base) for p in eval_paths),
        format=fmt,
        schema=schema,
        bad_input=policy,
        synthetic=synthetic,
    )


def parse_model(t: chk.Table) -> ModelSection:
    from hpsray.models.kinds import KINDS, MODEL_KINDS, ModelSpec

    kind = t.take("kind", chk.choice(MODEL_KINDS), "mlp")
    hidden = t.take("hidden", chk.hidden, None)
    settings = {k: t.take(k, None) for k in KINDS[kind].checks if k != "hidden"}
    settings = {k: v for k, v in settings.items() if v is not None}
    if hidden is not None and kind != "mlp":
        settings["hidden"] = hidden
    m = ModelSection(
        dim=t.take("dim", chk.integer(1), 16),
        hidden=hidden if hidden is not None and kind == "mlp" else (512, 256, 128),
        init_scale=t.take("init_scale", chk.number(0.0), 0.01),
        seed=t.take("seed", chk.integer(0), 0),
        kind=kind,
        settings=settings,
    )
    t.done()
    try:
        ModelSpec(kind, settings)
    except ConfigError as e:  # the spec names model.<key>; the job names its file
        t.fail(e.key.removeprefix("model."), e.reason)
    return m


def parse_optimizer(t: chk.Table) -> OptimizerSection:
    sparse = t.take("sparse", chk.choice(SPARSE_OPTIMIZERS), "adagrad")
    sparse_lr = t.take("sparse_lr", chk.number(0.0, lo_open=True), 0.05)
    dense = t.take("dense", chk.choice(DENSE_OPTIMIZERS), "adam")
    dense_lr = t.take("dense_lr", chk.number(0.0, lo_open=True), 1e-3)
    params_t = t.sub("sparse_params")
    params: dict = {}
    if params_t is not None:
        allowed = optimizer_params(sparse)
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


def parse_tiers(t: chk.Table, base: str) -> TiersSection:
    mem_rows = t.take("mem_rows", chk.integer(1))
    mem_bytes = t.take("mem_bytes", chk.size)
    ssd_path = t.take("ssd_path", chk.string)
    mem: dict = {}
    mem_t = t.sub("mem")
    if mem_t is not None:
        for k, check in (
            ("lru_fraction", chk.number(0.0, 1.0)),
            ("aging", chk.number(0.0, lo_open=True, optional=True)),
            ("history", chk.number(0.0, lo_open=True, optional=True)),
        ):
            v = mem_t.take(k, check, chk.UNSET)
            if v is not chk.UNSET:
                mem[k] = v
        mem_t.done()
    ssd: dict = {}
    ssd_t = t.sub("ssd")
    if ssd_t is not None:
        for k, check in (
            ("rows_per_file", chk.integer(1)),
            ("stale_threshold", chk.number(0.0, 1.0, lo_open=True, hi_open=True)),
            ("compact_trigger", chk.number(1.0)),
            ("max_space_ratio", chk.number(1.0, optional=True)),
            ("background", chk.boolean),
            ("io_threads", chk.integer(1)),
            ("compact_pass_bytes", chk.size),
            ("merge_small_files", chk.integer(2)),
        ):
            v = ssd_t.take(k, check, chk.UNSET)
            if v is not chk.UNSET:
                ssd[k] = v
        ssd_t.done()
    admit_after = t.take("admit_after", chk.integer(0), 0)
    expire_after_batches = t.take("expire_after_batches", chk.integer(1))
    dumps_in_flight = t.take("dumps_in_flight", chk.integer(1), 4)
    init_from = t.take("init_from", chk.string)
    t.done()
    if mem_rows is not None and mem_bytes is not None:
        t.fail("mem_bytes", "give either tiers.mem_rows or tiers.mem_bytes, not both")
    if ssd_path is not None and not ssd_path:
        t.fail("ssd_path", "must not be empty (leave it out for a temporary directory)")
    if ssd_path is not None and chk.is_uri(ssd_path):
        t.fail("ssd_path", f"must be a local directory (SSD-PS files live on the node's disk), got {ssd_path!r}")
    ssd_dir = chk.resolve_path(ssd_path, base) if ssd_path else None
    if init_from is not None and (not init_from or chk.is_uri(init_from)):
        t.fail("init_from", f"must be a local directory of Parquet rows, got {init_from!r}")
    init_dir = chk.resolve_path(init_from, base) if init_from else None
    if init_dir is not None and not os.path.isdir(init_dir):
        t.fail("init_from", f"{init_dir}: no such directory")
    return TiersSection(
        mem_rows, mem_bytes, ssd_dir, mem, ssd, admit_after, expire_after_batches, dumps_in_flight, init_dir
    )


def parse_pipeline(t: chk.Table) -> PipelineSection:
    p = PipelineSection(
        batch_size=t.take("batch_size", chk.integer(1), 65536),
        minibatch_size=t.take("minibatch_size", chk.integer(1), 1024),
        read_queue=t.take("read_queue", chk.integer(1), 2),
        pull_queue=t.take("pull_queue", chk.integer(1), 2),
        load_queue=t.take("load_queue", chk.integer(1), 2),
        write_back_queue=t.take("write_back_queue", chk.integer(1), 2),
        n_devices=t.take("n_devices", chk.integer(1), 1),
        device=t.take("device", chk.choice(DEVICES), "cpu"),
        threads=t.take("threads", chk.integer(1)),
        hbm_rows=t.take("hbm_rows", chk.integer(1)),
        progress_seconds=t.take("progress_seconds", chk.number(0.0)),
        passes=t.take("passes", chk.integer(1), 1),
    )
    t.done()
    return p


def parse_eval(t: chk.Table) -> EvalSettings:
    """``[eval]``: ``every_batches`` and ``early_stopping = { metric, patience }`` (docs/operations.md:
    Passes and evaluation)."""
    every = t.take("every_batches", chk.integer(0), 0)
    stop = t.sub("early_stopping")
    metric, patience = "auc", None
    if stop is not None:
        metric = stop.take("metric", chk.choice(tuple(METRICS)), "auc")
        patience = stop.take("patience", chk.integer(1))
        stop.done()  # a misspelled key first: "did you mean"
        if patience is None:
            stop.fail("patience", "missing (required): evaluations without improvement before stopping")
    t.done()
    return EvalSettings(every_batches=every, metric=metric, patience=patience)


def parse_report(t: chk.Table, base: str) -> ReportSection:
    board = t.take("tensorboard", chk.string)
    t.done()
    return ReportSection(tensorboard=chk.resolve_path(board, base) if board else None)


def parse_cluster(t: chk.Table) -> ClusterSection:
    c = ClusterSection(
        address=t.take("address", chk.string) or None,
        nodes=t.take("nodes", chk.integer(0), 1),
        consistency=t.take("consistency", chk.choice(CONSISTENCY_MODES), "bsp"),
        staleness=t.take("staleness", chk.integer(0), 2),
        dense_staleness=t.take("dense_staleness", chk.integer(0)),
        work_per_clock=t.take("work_per_clock", chk.integer(1), 4),
        propagation=t.take("propagation", chk.choice(PROPAGATIONS), "push"),
        dense_sync=t.take("dense_sync", chk.choice(DENSE_SYNC), "allreduce"),
        chunk_bytes=t.take("chunk_bytes", chk.size, 32768),
        fault_timeout_s=t.take("fault_timeout_s", chk.number(0.0, lo_open=True), ClusterSection.fault_timeout_s),
    )
    t.done()
    return c


def parse_checkpoint(t: chk.Table, base: str) -> CheckpointSection:
    directory = t.take("dir", chk.string, required=True)
    every_batches = t.take("every_batches", chk.integer(1), 50)
    keep = t.take("keep", chk.integer(1), 2)
    max_failures = t.take("max_failures", chk.integer(0), 3)
    t.done()
    if not directory.strip():
        t.fail("dir", "must not be empty (leave out the [checkpoint] section for no checkpoints)")
    # a directory every node mounts at the same path, or object storage (s3://...: checkpoint/remote.py)
    return CheckpointSection(chk.resolve_path(directory, base), every_batches, keep, max_failures)


def optimizer_params(name: str) -> tuple[str, ...]:
    """Extra parameters (besides ``lr``) the named sparse optimizer takes."""
    opt = make_optimizer(name)
    return tuple(f.name for f in dc_fields(opt) if f.init and f.name not in ("lr", "kind", "per_row"))
