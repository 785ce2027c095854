"""The run report of one training run: typed sections, one constructor, one JSON form.

:class:`RunReport` is built by :func:`hpsray.pipelines.summary.run_report` (``Pipeline.fit()``)
and :func:`hpsray.reference_job.train_reference`; the commands fill in what they add (evaluation,
export, configuration). :meth:`RunReport.as_dict` is its only serialisation: each field's name is
its JSON key, a nested dataclass a nested object; a field marked :data:`OMIT` is left out while
``None`` (the run had no such section), a field marked :data:`EMPTY` is ``{}`` while ``None``,
and the keys of a field marked ``flat`` (:class:`Evaluation`) sit at the top level. The JSON's
keys are a contract (the CLI's ``--report``/``--json``, the stage table, the benches read them).
Writing and plotting it: :mod:`hpsray.pipelines.report`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import Any

__all__ = [
    "Demo",
    "EdgeFill",
    "Evaluation",
    "NodeFigures",
    "Overlap",
    "ResumedFrom",
    "RunReport",
    "SsdTotals",
    "Start",
    "Sync",
    "TableFigures",
    "json_keys",
]

OMIT = {"none": "omit"}  # metadata: the key is absent while the value is None
EMPTY = {"none": "empty"}  # metadata: the value is {} while None


def _optional(meta: dict[str, Any] = OMIT) -> Any:
    return field(default=None, metadata=meta)


@dataclass
class EdgeFill:
    """One bounded edge between two stages: its capacity, deepest fill and producer stalls."""

    capacity: int
    max_depth: int
    stalls: int


@dataclass
class Overlap:
    """How often the stages ran on consecutive batches at once (:func:`~hpsray.pipelines.summary.overlap`)."""

    batches: int
    load_during_train: float
    read_load_train: float


@dataclass
class SsdTotals:
    """SSD-PS figures summed over nodes; ``space_ratio`` is disk over live bytes (0 without live bytes)."""

    bytes_read: int
    bytes_written: int
    files: int
    disk_bytes: int
    live_bytes: int
    compactions: int
    load_seconds: float
    dump_seconds: float
    space_ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.space_ratio = self.disk_bytes / self.live_bytes if self.live_bytes else 0.0


@dataclass
class Sync:
    """How several nodes' trainers kept consistent, and the staleness they saw."""

    consistency: str
    staleness_bound: int | None  # 0 under BSP, k - 1 under A-BSP, None (unbounded) under ASP
    propagation: str | None  # None under BSP
    max_staleness_observed: int
    # ssp/asp: the largest of it while another trainer was still in an earlier batch (0 where
    # batch ends are barriers), and the most mini-batches of updates a row its owner kept at a
    # batch end lacked (0 under bsp/absp and at a pass's end)
    max_staleness_across_batches: int
    max_owner_staleness: int
    dense: str
    exchanged_bytes_per_minibatch: float


@dataclass
class TableFigures:
    """One table's figures of a run of several tables (summed over nodes): MEM-PS ``lookups`` of
    its distinct keys per batch and their ``hit_rate``; the rows the load stage brought in,
    ``ssd_rows_loaded`` from SSD-PS files (``ssd_bytes_loaded`` at the table's ``row_bytes``) and
    ``rows_created`` (new keys: initial rows; ``bytes_created`` at ``row_bytes``); the rows its
    SSD-PS parameter files hold at the report, ``ssd_live_rows`` (all of them after an export or a
    checkpoint flushed MEM-PS), taking ``ssd_live_bytes`` (each row its key, version and floats)."""

    row_bytes: int
    lookups: int
    hits: int
    hit_rate: float
    ssd_rows_loaded: int
    ssd_bytes_loaded: int
    rows_created: int
    bytes_created: int
    ssd_live_rows: int = 0
    ssd_live_bytes: int = 0


@dataclass
class NodeFigures:
    """One node's own figures where several trained."""

    node: int
    stage_busy_s: dict[str, float]
    examples: int
    cache: dict[str, Any]


@dataclass
class Start:
    """Where the time to the first batch went: Ray's start, the actors', the rest, and when
    each stage's slowest actor was up."""

    ray_init_s: float
    actors_s: float
    other_s: float
    ready_s: dict[str, float]


@dataclass
class Evaluation:
    """Held-out AUC and log-loss (``None`` and 0 examples without held-out data)."""

    auc: float | None
    logloss: float | None
    eval_examples: int


@dataclass
class ResumedFrom:
    """The checkpoint a ``--resume`` continued from."""

    checkpoint: str
    batch: int


@dataclass
class Demo:
    """``hpsray demo``'s figures: the MEM-PS budget against the model, rows to SSD-PS and back."""

    distinct_keys: int
    mem_rows: int
    rows_evicted: int
    rows_loaded_from_ssd: int


@dataclass(kw_only=True)
class RunReport:
    """The report of one run. ``examples_per_s`` and ``pipeline_efficiency`` (the busiest
    stage's share of wall time: of its busy seconds, those ``busy_in_wall`` counts inside the
    timed wall where given, else ``stage_busy_s``; at most 1 then) are derived at construction.

    Per-batch maps are keyed by the batch id as a string (as JSON has them); ``cache``,
    ``working_set``, ``bad_input``, ``checkpoints``, ``recovery``, ``reshaped``, ``evaluations``, ``export``,
    ``config`` and ``compare`` are the dicts their producers return.
    """

    mode: str  # bsp / ssp / asp / absp, or "reference"
    nodes: int
    devices_per_node: int | None = _optional()
    batches: int
    examples: int
    wall_s: float
    examples_per_s: float = field(init=False)
    stage_busy_s: dict[str, float]
    # CPU seconds each stage's process used (every thread) while busy; the node's largest
    stage_cpu_s: dict[str, float] | None = _optional()
    pipeline_efficiency: float = field(init=False)
    per_batch_s: dict[str, dict[str, float]]
    cache_hit_rate: dict[str, float]
    ssd: SsdTotals | None = _optional(EMPTY)
    cache: dict[str, Any] | None = _optional()
    loss: dict[str, float]
    queues: dict[str, EdgeFill] | None = _optional()
    overlap: Overlap | None = _optional()
    working_set: dict[str, Any] | None = _optional()
    bad_input: dict[str, Any]
    time_to_first_batch_s: float | None = _optional()
    sync: Sync | None = _optional()
    tables: dict[str, TableFigures] | None = _optional()  # a model of several tables: per table name
    per_node: list[NodeFigures] | None = _optional()
    startup_s: float | None = _optional()
    start: Start | None = _optional()
    checkpoints: dict[str, Any] | None = _optional()
    recovery: list[dict[str, Any]] | None = _optional()
    reshaped: dict[str, Any] | None = _optional()
    evaluations: dict[str, Any] | None = _optional()  # evaluation while training: EvalTrack.as_dict + seconds
    # added by the commands (hpsray train, hpsray demo)
    trainer: str | None = _optional()  # "hpsray" or "reference"
    evaluation: Evaluation | None = field(default=None, metadata={**OMIT, "flat": Evaluation})  # keys at top level
    export: dict[str, Any] | None = _optional()
    rows: int | None = _optional()
    bad_rows: int | None = _optional()
    config: dict[str, Any] | None = _optional()
    config_file: str | None = _optional()
    resumed_from: ResumedFrom | None = _optional()
    compare: dict[str, Any] | None = _optional()
    demo: Demo | None = _optional()

    busy_in_wall: InitVar[dict[str, float] | None] = None

    def __post_init__(self, busy_in_wall: dict[str, float] | None) -> None:
        wall = self.wall_s
        self.examples_per_s = self.examples / wall if wall > 0 else 0.0
        busy = self.stage_busy_s if busy_in_wall is None else busy_in_wall
        self.pipeline_efficiency = max(busy.values(), default=0.0) / wall if wall > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (the module docstring's rules); a new dict each call."""
        return _as_dict(self)


def _as_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            rule = f.metadata.get("none")
            if rule == "omit":
                continue
            if rule == "empty":
                out[f.name] = {}
                continue
        if f.metadata.get("flat"):
            out.update(_plain(value))
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _as_dict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def json_keys(cls: type = RunReport) -> set[str]:
    """Every top-level key ``cls.as_dict()`` can yield: its fields, a flat section's own."""
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.metadata.get("flat"):
            keys |= {g.name for g in dataclasses.fields(f.metadata["flat"])}
        else:
            keys.add(f.name)
    return keys
