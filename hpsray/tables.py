"""Embedding tables of their own (issue 43): each a set of slots with its own width, pooling and
sparse optimizer.

:class:`TableSpec` names one table; :class:`Tables` is a model's set of them, resolved for a
number of slots (each slot in exactly one table) against a :class:`~hpsray.config.TrainConfig`,
which gives every setting a table leaves out. No tables given means ONE table of every slot with
the config's ``dim``, optimizer and learning rate and sum pooling: the jobs before tables.

**The key contract** (docs/architecture.md, "Keys and partitioning"): a key stays the 64-bit mix
of (slot, value) (:mod:`hpsray.data.keys`). With more than one table, :meth:`Tables.tag` puts the
table's index in the key's top 8 bits (the low 56 bits are the mix's), so keys of two tables never
collide, even for equal raw values, and :meth:`Tables.table_of` reads a key's table (hence its row
width) from the key alone. One table tags nothing: its keys are the mix's, unchanged. At most
255 tables, so a tagged key's top byte is at most ``0xFE`` and never the reserved all-ones
``EMPTY_KEY``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hpsray.admission_rules import check_admission
from hpsray.errors import ConfigError
from hpsray.first_order import FIRST_ORDER, expand, needs_first_order
from hpsray.kernels.hashing import EMPTY_KEY
from hpsray.kernels.init import RowInit
from hpsray.kernels.optim import SPARSE_OPTIMIZERS, SparseOptimizer, make_optimizer

if TYPE_CHECKING:
    from hpsray.data.batch import Batch

__all__ = [
    "MAX_TABLES",
    "POOLINGS",
    "TAG_SHIFT",
    "TableSpec",
    "Tables",
    "TagKeys",
    "admits_late",
    "key_tagging",
    "layout_of",
    "mixed_layouts",
    "check_tables",
    "export_columns",
    "table_admission",
    "table_layouts",
    "tag_keys",
    "with_first_order",
]


class RowDefaults(Protocol):
    """What a table leaves out comes from here (a :class:`~hpsray.config.TrainConfig`; typed
    apart so that this module does not import the config, which imports it)."""

    @property
    def dim(self) -> int: ...
    @property
    def sparse_optimizer(self) -> str: ...
    @property
    def sparse_lr(self) -> float: ...
    @property
    def sparse_params(self) -> dict: ...
    @property
    def init_scale(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def tables(self) -> tuple[TableSpec, ...]: ...


POOLINGS = ("sum", "mean")
"""How a slot's keys of one example pool: summed, or summed and divided by their count."""
MAX_TABLES = 255
"""At most this many tables: a tagged key's top byte stays below ``0xFF`` (never ``EMPTY_KEY``)."""
TAG_SHIFT = np.uint64(56)
_LOW = np.uint64((1 << 56) - 1)


def _fail(field: str, name: object, reason: str) -> ConfigError:
    return ConfigError("TableSpec", field, f"table {name!r}: {reason}")


def _int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclass(frozen=True)
class TableSpec:
    """One table: its ``name``, the ``slots`` it holds, its ``dim`` and ``pooling``; and, when
    given, its own sparse ``optimizer`` (a :data:`~hpsray.config.SPARSE_OPTIMIZERS` name), ``lr``,
    ``sparse_params`` and admission/expiry (``None``: the config's or the job's).

    Raises :class:`~hpsray.errors.ConfigError` naming the field and the table.
    """

    name: str
    slots: tuple[int, ...]
    dim: int
    pooling: str = "sum"
    optimizer: str | None = None
    lr: float | None = None
    sparse_params: Mapping[str, float] | None = None
    admit_after: int | None = None
    expire_after_batches: int | None = None
    copy: bool = False
    """A copy table (:mod:`hpsray.first_order`): its slots are held by a primary table too, each
    key looked up in both; its keys are the copies' (model slots after the data's)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise _fail("name", self.name, "must be a non-empty string")
        if not isinstance(self.slots, (list, tuple)) or not self.slots or not all(_int(s) for s in self.slots):
            raise _fail("slots", self.name, f"must be a non-empty list of slot numbers, got {self.slots!r}")
        slots = tuple(int(s) for s in self.slots)
        if len(set(slots)) != len(slots):
            raise _fail("slots", self.name, f"names a slot twice: {list(slots)}")
        if min(slots) < 0:
            raise _fail("slots", self.name, f"slot numbers must be >= 0, got {min(slots)}")
        object.__setattr__(self, "slots", slots)
        if not _int(self.dim) or self.dim < 1:
            raise _fail("dim", self.name, f"must be an integer >= 1, got {self.dim!r}")
        if self.pooling not in POOLINGS:
            raise _fail("pooling", self.name, f"must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.optimizer is not None and self.optimizer not in SPARSE_OPTIMIZERS:
            raise _fail(
                "optimizer", self.name, f"must be one of {', '.join(SPARSE_OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.lr is not None and (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, (int, float))
            or not math.isfinite(self.lr)
            or self.lr <= 0
        ):
            raise _fail("lr", self.name, f"must be a number > 0, got {self.lr!r}")
        if self.sparse_params is not None:
            object.__setattr__(self, "sparse_params", dict(self.sparse_params))
        try:
            check_admission(
                0 if self.admit_after is None else self.admit_after,
                self.expire_after_batches,
            )
        except ValueError as e:
            field = "expire_after_batches" if "expire" in str(e) else "admit_after"
            raise _fail(field, self.name, str(e)) from None


class Tables:
    """A model's tables, resolved for ``n_slots`` slots against ``config`` (see the module
    docstring); build with :meth:`of` (``TrainConfig.tables_for``).

    Per table ``t``: ``specs[t]`` (every setting filled in), ``dims[t]``, ``widths[t]`` (floats
    per stored row: weights then the optimizer's state, as ``TrainConfig.row_width``),
    ``row_bytes[t]``, ``optimizers[t]`` and ``row_inits[t]``. Per model slot ``s``:
    ``slot_table[s]`` is its table, ``slot_dims[s]`` its width and ``mean_slots[s]`` whether it
    pools by the mean. ``n_slots`` counts the model's slots: the data's ``n_data_slots``, then
    one per slot of each copy table (``copy_of[j]``: the data slot model slot ``n_data_slots + j``
    copies; :mod:`hpsray.first_order`).
    """

    def __init__(self, specs: Sequence[TableSpec], n_slots: int, config: RowDefaults) -> None:
        if not _int(n_slots) or n_slots < 1:
            raise ConfigError("Tables", "n_slots", f"must be an integer >= 1, got {n_slots!r}")
        if len(specs) > MAX_TABLES:
            raise ConfigError("Tables", "tables", f"at most {MAX_TABLES} tables, got {len(specs)}")
        owner: dict[int, int] = {}
        names: dict[str, int] = {}
        resolved = []
        copies: list[tuple[int, int]] = []  # (data slot, table) of each copied slot, in model-slot order
        for i, spec in enumerate(specs):
            if not isinstance(spec, TableSpec):
                raise ConfigError("Tables", f"tables[{i}]", f"must be a TableSpec, got {type(spec).__name__}")
            if spec.name in names:
                raise ConfigError(
                    "Tables", f"tables[{i}].name", f"{spec.name!r} names tables[{names[spec.name]}] already"
                )
            names[spec.name] = i
            for s in spec.slots:
                if s >= n_slots:
                    raise ConfigError(
                        "Tables", f"tables[{i}].slots", f"table {spec.name!r}: slot {s} is out of range [0, {n_slots})"
                    )
                if spec.copy:
                    copies.append((s, i))
                    continue
                if s in owner:
                    other = specs[owner[s]].name
                    raise ConfigError(
                        "Tables", f"tables[{i}].slots", f"table {spec.name!r}: slot {s} is in table {other!r} already"
                    )
                owner[s] = i
            resolved.append(_resolve(spec, i, config))
        missing = sorted(set(range(n_slots)) - set(owner))
        if missing:
            raise ConfigError(
                "Tables", "tables", f"every slot must be in one table; slots {missing} are in none (of {n_slots})"
            )
        self.specs: tuple[TableSpec, ...] = tuple(resolved)
        self.n_data_slots = int(n_slots)
        self.n_slots = int(n_slots) + len(copies)
        self.copy_of = np.array([s for s, _ in copies], dtype=np.int64)
        self.slot_table = np.array([owner[s] for s in range(n_slots)] + [t for _, t in copies], dtype=np.int64)
        self.optimizers: tuple[SparseOptimizer, ...] = tuple(_optimizer(spec, i) for i, spec in enumerate(self.specs))
        self.dims = tuple(spec.dim for spec in self.specs)
        self.widths = tuple(d + opt.state_width(d) for d, opt in zip(self.dims, self.optimizers, strict=True))
        self.row_bytes = tuple(4 * w for w in self.widths)
        self.row_inits = tuple(
            RowInit.for_optimizer(d, opt, scale=config.init_scale, seed=config.seed)
            for d, opt in zip(self.dims, self.optimizers, strict=True)
        )
        self.slot_dims = tuple(self.dims[t] for t in self.slot_table)
        self.mean_slots = np.array([self.specs[t].pooling == "mean" for t in self.slot_table], dtype=bool)

    @classmethod
    def of(cls, config: RowDefaults, n_slots: int) -> Tables:
        """``config``'s tables for ``n_slots`` slots (its one default table when it gives none)."""
        config = with_first_order(config, n_slots)
        specs = config.tables or (TableSpec("default", tuple(range(n_slots)), config.dim),)
        return cls(specs, n_slots, config)

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def tagged(self) -> bool:
        """Whether keys carry their table in the top 8 bits (more than one table)."""
        return len(self.specs) > 1

    @property
    def uniform_dim(self) -> int | None:
        """The one width of every slot, or ``None`` when the tables' widths differ."""
        return self.dims[0] if len(set(self.dims)) == 1 else None

    @property
    def plain(self) -> bool:
        """One table, sum pooling: what the pipeline runs today."""
        return len(self.specs) == 1 and self.specs[0].pooling == "sum"

    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)

    def expand(self, batch: Batch) -> Batch:
        """``batch`` of the data's slots with the copied slots appended
        (:func:`hpsray.first_order.expand`); itself without copy tables or when expanded already."""
        if batch.n_slots == self.n_slots:
            return batch
        if batch.n_slots != self.n_data_slots:
            raise ValueError(f"batch has {batch.n_slots} slots; the tables take {self.n_data_slots}")
        return expand(batch, self.copy_of)

    def tag(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``keys`` (``uint64``, the (slot, value) mix) of (model) ``slots`` with their table's
        index in the top 8 bits; unchanged (the same array) with one table."""
        keys = np.asarray(keys, dtype=np.uint64)
        return tag_keys(keys, slots, self.slot_table) if self.tagged else keys

    def admission(self, admit_after: int, expire_after_batches: int | None) -> list[tuple[int, int | None]]:
        """Per table, its ``(admit_after, expire_after_batches)``: its own where it gives them,
        else these (the job's ``[tiers]``)."""
        return [
            (
                admit_after if spec.admit_after is None else spec.admit_after,
                expire_after_batches if spec.expire_after_batches is None else spec.expire_after_batches,
            )
            for spec in self.specs
        ]

    def manifest(self) -> list[dict]:
        """What an export records of the tables (``name``, ``slots``, ``dim``, ``pooling``, and
        ``copy`` for a copy table): enough for serving to expand, tag and pool as training did
        (:class:`~hpsray.serving.tables.SlotTables`)."""
        return [
            {
                "name": s.name,
                "slots": list(s.slots),
                "dim": s.dim,
                "pooling": s.pooling,
                **({"copy": True} if s.copy else {}),
            }
            for s in self.specs
        ]

    def table_of(self, keys: np.ndarray) -> np.ndarray:
        """``int64``: the table of each (tagged) key; zeros with one table."""
        keys = np.asarray(keys, dtype=np.uint64)
        if not self.tagged:
            return np.zeros(keys.shape, dtype=np.int64)
        return (keys >> TAG_SHIFT).astype(np.int64)

    def describe(self) -> str:
        """``name (dim D, pooling P)`` of every table, for error messages."""
        return ", ".join(f"{s.name} (dim {s.dim}, {s.pooling})" for s in self.specs)


def tag_keys(keys: np.ndarray, slots: np.ndarray, slot_table: np.ndarray) -> np.ndarray:
    """``keys`` of ``slots`` with their table's index (``slot_table[slot]``) in the top 8 bits."""
    table = slot_table[np.asarray(slots, dtype=np.int64)].astype(np.uint64)
    out = (np.asarray(keys, dtype=np.uint64) & _LOW) | (table << TAG_SHIFT)
    assert not np.any(out == EMPTY_KEY)  # the top byte is at most MAX_TABLES - 1 = 0xFE
    return out


def _resolve(spec: TableSpec, i: int, config: RowDefaults) -> TableSpec:
    """``spec`` with the settings it leaves out taken from ``config``."""
    own = spec.optimizer is not None and spec.optimizer != config.sparse_optimizer
    params = spec.sparse_params if spec.sparse_params is not None else ({} if own else dict(config.sparse_params))
    return TableSpec(
        spec.name,
        spec.slots,
        spec.dim,
        spec.pooling,
        spec.optimizer or config.sparse_optimizer,
        spec.lr if spec.lr is not None else config.sparse_lr,
        params,
        spec.admit_after,
        spec.expire_after_batches,
        spec.copy,
    )


def _optimizer(spec: TableSpec, i: int) -> SparseOptimizer:
    assert spec.optimizer is not None and spec.lr is not None and spec.sparse_params is not None
    try:
        return make_optimizer(spec.optimizer, lr=spec.lr, **spec.sparse_params)
    except (TypeError, ValueError) as e:
        raise ConfigError("Tables", f"tables[{i}].sparse_params", f"table {spec.name!r}: {e}") from None


def with_first_order(config: Any, n_slots: int) -> Any:
    """``config`` (a :class:`~hpsray.config.TrainConfig`) with the first-order table of its
    ``n_slots`` data slots added when its model kind needs one (:mod:`hpsray.first_order`);
    itself otherwise, or when it has one already."""
    if not needs_first_order(config) or any(spec.copy for spec in config.tables):
        return config
    if any(spec.name == FIRST_ORDER for spec in config.tables):
        raise ConfigError(
            "Tables", "tables", f"{FIRST_ORDER!r} names the first-order table of kind {config.model_kind!r}; rename it"
        )
    every = tuple(range(n_slots))
    primary = config.tables or (TableSpec("default", every, config.dim),)
    return replace(config, tables=(*primary, TableSpec(FIRST_ORDER, every, 1, copy=True)))


def table_layouts(config: RowDefaults) -> list[tuple[int, int, SparseOptimizer]]:
    """Per table of ``config.tables`` (in order), its ``(dim, width, sparse optimizer)``, every
    setting it leaves out taken from ``config`` (its slots unchecked: :meth:`Tables.of` checks
    them against a number of slots)."""
    out = []
    for i, spec in enumerate(config.tables):
        opt = _optimizer(_resolve(spec, i, config), i)
        out.append((spec.dim, spec.dim + opt.state_width(spec.dim), opt))
    return out


def layout_of(spec: TableSpec) -> tuple:
    """A resolved table's row layout: its dim, sparse optimizer and that optimizer's settings
    (tables of one layout share a row width and an initial row; learning rate and pooling aside)."""
    return (spec.dim, spec.optimizer, tuple(sorted((spec.sparse_params or {}).items())))


def export_columns(dims: Sequence[int], widths: Sequence[int]) -> tuple[int, int]:
    """The ``(weights, state)`` columns of an export of tables of ``dims`` and row ``widths``:
    each as wide as the widest table's part (docs/export.md, "Tables")."""
    return max(dims), max(w - d for w, d in zip(widths, dims, strict=True))


def mixed_layouts(config: RowDefaults) -> bool:
    """Whether ``config``'s tables have rows of more than one layout (:func:`layout_of`): the
    tiers then hold one store per layout, and rows cross between stages at the widest table's
    width."""
    if len(config.tables) < 2:
        return False
    return len({layout_of(_resolve(spec, i, config)) for i, spec in enumerate(config.tables)}) > 1


def table_admission(
    config: RowDefaults, n_slots: int, admit_after: int, expire_after_batches: int | None
) -> list[tuple[int, int | None]] | None:
    """Each table's ``(admit_after, expire_after_batches)`` for the pipeline's owners when a table
    of several sets its own (``None`` otherwise: the job's two numbers hold for every key)."""
    if not config.tables or len(config.tables) < 2:
        return None
    if all(spec.admit_after is None and spec.expire_after_batches is None for spec in config.tables):
        return None
    return Tables.of(config, n_slots).admission(admit_after, expire_after_batches)


def admits_late(config: RowDefaults, n_slots: int, admit_after: int) -> bool:
    """Whether some key waits for a row (``admit_after`` > 1, the job's or a table's own)."""
    own = table_admission(config, n_slots, admit_after, None)
    return admit_after > 1 if own is None else max(a for a, _ in own) > 1


class TagKeys:
    """A reader transform (``Batch -> Batch``): the batch's copied slots appended
    (:meth:`Tables.expand`) and its keys tagged with their tables (:meth:`Tables.tag`), as the
    pipeline's tiers, trainers and reports then hold them."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables

    def __call__(self, batch: Batch) -> Batch:
        batch = self.tables.expand(batch)
        return replace(batch, keys=self.tables.tag(batch.keys, batch.slots))

    def __repr__(self) -> str:
        return f"TagKeys({self.tables.describe()})"


def key_tagging(config: RowDefaults, n_slots: int) -> list[Callable[[Batch], Batch]]:
    """The transform the pipeline's readers run last: ``[TagKeys]`` with several tables (a copy
    table among them: :mod:`hpsray.first_order`), else none."""
    tables = Tables.of(config, n_slots)
    return [TagKeys(tables)] if tables.tagged else []


def import_refusal(exported: Any, tables: Tables | None) -> str | None:
    """Why rows exported with the manifest entry ``exported`` (its ``tables``; ``None``: an export
    of one table, or no hpsray export) cannot start a job of ``tables`` (``None``: one table), or
    ``None`` when they can: keys carry their table's index, so an import needs the same tables
    (names, slots and dims) in the same order, or none on either side."""
    mine = None if tables is None or len(tables) < 2 else [[s.name, list(s.slots), s.dim] for s in tables.specs]
    theirs = None
    if exported and len(exported) > 1:
        try:
            theirs = [[e["name"], [int(x) for x in e["slots"]], int(e["dim"])] for e in exported]
        except (KeyError, TypeError, ValueError) as e:
            return f"its manifest's tables are malformed ({e})"
    if mine == theirs:
        return None
    if mine is None:
        return f"holds the rows of several tables (keys tagged by table: {theirs}); this job has one table"
    if theirs is None:
        return (
            "holds rows of untagged keys (one table, or not an hpsray export); a job of several [[tables]] "
            f"imports an hpsray export of the same tables ({mine}: name, slots, dim)"
        )
    return f"was exported with the tables {theirs}; this job's are {mine} (name, slots, dim): the keys' tags differ"


def check_tables(config: RowDefaults, n_slots: int) -> None:
    """The tables' own checks against a source of ``n_slots`` slots, before Ray starts: raises
    :class:`~hpsray.errors.ConfigError` naming the table. The pipeline runs any tables (each its
    own width, pooling, sparse optimizer, learning rate and admission) in every consistency mode
    and on any number of devices."""
    Tables.of(config, n_slots)
