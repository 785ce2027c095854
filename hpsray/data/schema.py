"""The declared layout of a click log: which column is the label, which are dense, which categorical.

A :class:`Schema` is the ``[data.schema]`` table of the TOML config, so any click log in CSV/TSV,
Parquet or JSON lines can be trained without code::

    [data.schema]
    format = "csv"              # "criteo" | "csv" | "parquet" | "jsonl" (hpsray.data.formats)
    header = true
    delimiter = ","
    label = "click"
    dense = ["price", "age"]
    categorical = ["user", "ad", "tags"]
    multi_hot_separator = "|"   # several values in one categorical field
    encoding = "string"         # how raw categorical text becomes a uint64: string | hex | int

``Schema.criteo()`` (``format = "criteo"``) is the Criteo TSV preset: label, 13 integer and 26
hex categorical columns, no header. Categorical slot ``i`` is ``categorical[i]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from hpsray.data.formats import get_format

Column = str | int
"""A column by header/Parquet name or by 0-based position."""

ENCODINGS = ("string", "hex", "int")
DENSE_TRANSFORMS = ("none", "log1p")
COMPRESSIONS = ("auto", "none", "gzip", "zstd", "bz2")

CRITEO_N_DENSE = 13
CRITEO_N_CATEGORICAL = 26


@dataclass(frozen=True)
class Schema:
    """Declared columns of a CSV/TSV/Parquet click log (see the module docstring).

    - ``label``, ``dense``, ``categorical``: columns by name or 0-based index.
    - ``columns``: names of all columns of a headerless text file (optional); ``n_columns``: the
      expected column count of a headerless file (default: 1 + the largest index referenced).
      Rows with another column count are bad (``wrong_column_count``).
    - ``header``: the first line of each text file holds the column names.
    - ``delimiter``, ``quote_char`` (``""`` for none): text syntax.
    - ``multi_hot_separator``: splits a categorical text field into several values (Parquet uses
      list columns instead).
    - ``encoding``: categorical text → ``uint64`` before the (slot, value) key mix: ``"string"``
      hashes the bytes, ``"hex"`` / ``"int"`` parse the number. Parquet integer columns are used
      as they are.
    - ``dense_transform``: ``"log1p"`` maps x to ``log(1 + max(x, 0))``; missing dense values are 0.
    - ``compression``: ``"auto"`` picks from the file extension (``.gz``, ``.zst``, ``.bz2``).
    """

    format: str = "csv"
    label: Column = 0
    dense: tuple[Column, ...] = ()
    categorical: tuple[Column, ...] = ()
    columns: tuple[str, ...] | None = None
    n_columns: int | None = None
    header: bool = False
    delimiter: str = ","
    quote_char: str = '"'
    multi_hot_separator: str = ""
    encoding: str = "string"
    dense_transform: str = "none"
    compression: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense", tuple(self.dense))
        object.__setattr__(self, "categorical", tuple(self.categorical))
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
        self.validate()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def criteo(
        cls,
        n_dense: int = CRITEO_N_DENSE,
        n_categorical: int = CRITEO_N_CATEGORICAL,
        *,
        dense_transform: str = "log1p",
        multi_hot_separator: str = "",
        compression: str = "auto",
    ) -> Schema:
        """Criteo TSV: label, ``n_dense`` integer and ``n_categorical`` hex columns, no header."""
        for name, v in (("n_dense", n_dense), ("n_categorical", n_categorical)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"schema.{name}: must be a non-negative integer, got {v!r}")
        return cls(
            format="criteo",
            label=0,
            dense=tuple(range(1, 1 + n_dense)),
            categorical=tuple(range(1 + n_dense, 1 + n_dense + n_categorical)),
            n_columns=1 + n_dense + n_categorical,
            header=False,
            delimiter="\t",
            quote_char="",
            multi_hot_separator=multi_hot_separator,
            encoding="hex",
            dense_transform=dense_transform,
            compression=compression,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "schema") -> Schema:
        """Build from a TOML table. Errors are ``ValueError`` naming ``where.key`` and the reason."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: must be a table, got {type(d).__name__}")
        fmt = d.get("format", "csv")
        if fmt == "criteo":
            allowed = {"format", "n_dense", "n_categorical", "dense_transform", "multi_hot_separator", "compression"}
            for key in d:
                if key not in allowed:
                    raise ValueError(
                        f"{where}.{key}: not allowed with format = 'criteo' (allowed: {', '.join(sorted(allowed))})"
                    )
            kwargs = {k: v for k, v in d.items() if k != "format"}
            try:
                return cls.criteo(**kwargs)
            except ValueError as e:
                raise ValueError(str(e).replace("schema.", f"{where}.", 1)) from None
        names = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key not in names:
                raise ValueError(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
            if key in ("dense", "categorical", "columns"):
                if not isinstance(value, (list, tuple)):
                    raise ValueError(f"{where}.{key}: must be a list, got {type(value).__name__}")
                value = tuple(value)
            kwargs[key] = value
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(str(e).replace("schema.", f"{where}.", 1)) from None

    def to_dict(self) -> dict[str, Any]:
        """The TOML table that :meth:`from_dict` turns back into this schema."""
        if self.format == "criteo":
            d: dict[str, Any] = {
                "format": "criteo",
                "n_dense": self.n_dense,
                "n_categorical": self.n_slots,
                "dense_transform": self.dense_transform,
            }
            if self.multi_hot_separator:
                d["multi_hot_separator"] = self.multi_hot_separator
            if self.compression != "auto":
                d["compression"] = self.compression
            return d
        out = {}
        for k, v in asdict(self).items():
            if v is None:
                continue
            out[k] = list(v) if isinstance(v, tuple) else v
        return out

    # -- validation ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending key and why."""

        def bad(key: str, why: str) -> None:
            raise ValueError(f"schema.{key}: {why}")

        fmt = get_format(self.format)  # ValueError naming the known formats
        if self.encoding not in ENCODINGS:
            bad("encoding", f"must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.dense_transform not in DENSE_TRANSFORMS:
            bad("dense_transform", f"must be one of {', '.join(DENSE_TRANSFORMS)}, got {self.dense_transform!r}")
        if self.compression not in COMPRESSIONS:
            bad("compression", f"must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if not isinstance(self.header, bool):
            bad("header", f"must be true or false, got {self.header!r}")
        for key in ("delimiter", "quote_char", "multi_hot_separator"):
            v = getattr(self, key)
            if not isinstance(v, str) or len(v.encode()) > 1 or v in ("\n", "\r"):
                bad(key, f"must be a single one-byte character other than a newline, got {v!r}")
        if not self.delimiter:
            bad("delimiter", "must not be empty")
        if self.multi_hot_separator and self.multi_hot_separator == self.delimiter:
            bad("multi_hot_separator", "must differ from the delimiter")
        if self.quote_char and self.quote_char == self.delimiter:
            bad("quote_char", "must differ from the delimiter")

        refs = self.column_refs()
        seen: dict[Column, str] = {}
        for key, c in refs:
            if isinstance(c, bool) or not isinstance(c, (str, int)):
                bad(key, f"must be a column name or 0-based index, got {c!r}")
            if isinstance(c, int) and c < 0:
                bad(key, f"column index must be >= 0, got {c}")
            if isinstance(c, str) and not c:
                bad(key, "column name must not be empty")
            if c in seen:
                bad(key, f"column {c!r} is already used as {seen[c]}")
            seen[c] = key
        if self.columns is not None:
            if not all(isinstance(c, str) and c for c in self.columns):
                bad("columns", "must be a list of non-empty names")
            if len(set(self.columns)) != len(self.columns):
                bad("columns", "names must be unique")
        if self.n_columns is not None:
            if isinstance(self.n_columns, bool) or not isinstance(self.n_columns, int) or self.n_columns < 1:
                bad("n_columns", f"must be a positive integer, got {self.n_columns!r}")
            if self.columns is not None and len(self.columns) != self.n_columns:
                bad("n_columns", f"is {self.n_columns} but columns names {len(self.columns)}")
        fmt.validate(self)

    # -- derived ------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return len(self.categorical)

    @property
    def n_dense(self) -> int:
        return len(self.dense)

    def column_refs(self) -> list[tuple[str, Column]]:
        """Every referenced column with the key that names it: ``("label", …), ("dense[0]", …)``."""
        refs: list[tuple[str, Column]] = [("label", self.label)]
        refs += [(f"dense[{i}]", c) for i, c in enumerate(self.dense)]
        refs += [(f"categorical[{i}]", c) for i, c in enumerate(self.categorical)]
        return refs

    def known_column_names(self) -> list[str] | None:
        """The file's column names when this schema alone gives them (a headerless text file), else
        ``None``: the file names its columns (see :meth:`hpsray.data.formats.Format.column_names`)."""
        return get_format(self.format).column_names(self)

    def expected_columns(self) -> int:
        """Columns per row of a headerless text file."""
        if self.columns is not None:
            return len(self.columns)
        if self.n_columns is not None:
            return self.n_columns
        idx = [c for c in (self.label, *self.dense, *self.categorical) if isinstance(c, int)]
        return max(idx) + 1 if idx else 1

    def column_names(self) -> list[str]:
        """Names for the columns of a headerless text file (``c0``, ``c1`` ... when not given)."""
        if self.columns is not None:
            return list(self.columns)
        return [f"c{i}" for i in range(self.expected_columns())]

    def resolve(self, names: list[str]) -> tuple[int, list[int], list[int]]:
        """Positions of (label, dense, categorical) among ``names``; ``KeyError`` names a missing one."""
        pos = {n: i for i, n in enumerate(names)}

        def find(c: Column) -> int:
            if isinstance(c, int):
                if c >= len(names):
                    raise KeyError(f"column index {c} but the file has {len(names)} columns")
                return c
            if c not in pos:
                raise KeyError(f"column {c!r} not in the file's columns")
            return pos[c]

        return find(self.label), [find(c) for c in self.dense], [find(c) for c in self.categorical]
