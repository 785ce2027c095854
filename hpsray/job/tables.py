"""``[[tables]]`` of a job file: embedding tables of their own (:mod:`hpsray.tables`).

Each entry: ``name``; ``slots = [0, 3]`` or ``columns = ["user", "ad"]`` (categorical column
names of the job's schema, resolved to slots); ``dim`` (default ``[model] dim``); ``pooling =
"sum" | "mean"``; optionally ``optimizer``, ``lr``, ``[tables.sparse_params]``, ``admit_after``
and ``expire_after_batches`` (those left out: ``[optimizer]``'s and ``[tiers]``'s). Every
rejection is a :class:`~hpsray.errors.ConfigError` naming the file and the entry's key, e.g.
``job.toml: tables[1].dim: must be a positive integer, got 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpsray.config import SPARSE_OPTIMIZERS
from hpsray.errors import ConfigError
from hpsray.job import validate as chk
from hpsray.tables import POOLINGS, TableSpec

__all__ = ["TableEntry", "parse_tables", "resolve_tables"]


@dataclass(frozen=True)
class TableEntry:
    """One ``[[tables]]`` entry as written: its slots or its column names, and the
    :class:`~hpsray.tables.TableSpec` settings."""

    index: int
    name: str
    slots: tuple[int, ...] | None
    columns: tuple[str, ...] | None
    dim: int | None
    pooling: str
    optimizer: str | None
    lr: float | None
    sparse_params: dict | None
    admit_after: int | None
    expire_after_batches: int | None


def parse_tables(v: Any, where: str, default_optimizer: str) -> tuple[TableEntry, ...]:
    """The ``tables`` array of a job file, each entry checked on its own (see the module docstring)."""
    from hpsray.job.sections import optimizer_params

    if not isinstance(v, list) or not v:
        raise ConfigError(where, "tables", f"must be [[tables]] entries, got {chk.type_name(v)} {v!r}")
    out = []
    for i, d in enumerate(v):
        t = chk.Table(d, f"tables[{i}]", where)
        name = t.take("name", chk.string, required=True)
        slots = t.take("slots", chk.slot_list)
        columns = t.take("columns", chk.string_list)
        if (slots is None) == (columns is None):
            t.fail("slots", "give slots = [...] or columns = [...], one of them")
        optimizer = t.take("optimizer", chk.choice(SPARSE_OPTIMIZERS))
        params = None
        params_t = t.sub("sparse_params")
        if params_t is not None:
            opt = optimizer or default_optimizer
            allowed = optimizer_params(opt)
            params = {}
            for k, value in params_t.d.items():
                if k not in allowed:
                    params_t.fail(k, f"not a parameter of the {opt} optimizer (known: {', '.join(allowed) or 'none'})")
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    params_t.fail(k, f"must be a number, got {value!r}")
                params[k] = float(value)
        entry = TableEntry(
            index=i,
            name=name,
            slots=slots,
            columns=columns,
            dim=t.take("dim", chk.integer(1)),
            pooling=t.take("pooling", chk.choice(POOLINGS), "sum"),
            optimizer=optimizer,
            lr=t.take("lr", chk.number(0.0, lo_open=True)),
            sparse_params=params,
            admit_after=t.take("admit_after", chk.integer(0)),
            expire_after_batches=t.take("expire_after_batches", chk.integer(1)),
        )
        t.done()
        out.append(entry)
    return tuple(out)


def resolve_tables(entries: tuple[TableEntry, ...], where: str, default_dim: int, schema: Any) -> tuple[TableSpec, ...]:
    """The :class:`~hpsray.tables.TableSpec` of each entry, its ``columns`` resolved to slots by
    ``schema``'s categorical columns (``None``: generated data, whose entries give ``slots``)."""
    names = _categorical_names(schema) if schema is not None else None
    specs = []
    for e in entries:
        key = f"tables[{e.index}]"
        slots = e.slots
        if e.columns is not None:
            if names is None:
                raise ConfigError(where, f"{key}.columns", "generated data has no column names; give slots = [...]")
            unknown = [c for c in e.columns if c not in names]
            if unknown:
                raise ConfigError(
                    where, f"{key}.columns", f"{unknown} are not categorical columns of the schema (those: {names})"
                )
            slots = tuple(names.index(c) for c in e.columns)
        assert slots is not None
        try:
            specs.append(
                TableSpec(
                    e.name,
                    slots,
                    e.dim if e.dim is not None else default_dim,
                    e.pooling,
                    e.optimizer,
                    e.lr,
                    e.sparse_params,
                    e.admit_after,
                    e.expire_after_batches,
                )
            )
        except ConfigError as err:  # names the field; the job names its file and entry
            raise ConfigError(where, f"{key}.{err.key}", err.reason) from None
    return tuple(specs)


def _categorical_names(schema: Any) -> list[str | None]:
    """The name of each categorical column (slot order): its own, or the file's column names'."""
    known = schema.known_column_names()
    out: list[str | None] = []
    for c in schema.categorical:
        if isinstance(c, str):
            out.append(c)
        else:
            out.append(known[c] if known is not None and c < len(known) else None)
    return out
