"""One interface per data format, and the registry that names them.

A :class:`Format` is all that hpsray knows of a file layout: how to read a split of a file into
batches, whether a file may be cut into byte ranges, how many rows the input holds (counted, or
estimated from bytes), and which schemas fit it. Code outside ``hpsray.data`` asks the format
(:func:`format_of`), never which format it has.

Adding a format takes one module in ``hpsray/data/`` with a :class:`Format` subclass and one line
in ``_BUILTIN`` below (or :func:`register` for a format outside hpsray). The built-in formats are
imported on first use, so this module imports no reader.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from hpsray.data.bad_input import BadInputPolicy, BadInputReport
    from hpsray.data.batch import Batch
    from hpsray.data.split import Split

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Format",
    "RowCount",
    "SplitRead",
    "format_names",
    "format_of",
    "get_format",
    "register",
]

DEFAULT_BLOCK_SIZE = 4 << 20  # bytes a streaming reader parses at a time


class Named(Protocol):
    """A schema as the registry sees it: the name of its format."""

    @property
    def format(self) -> str: ...


S = TypeVar("S", bound=Named)
"""The schema type a format reads with (:class:`hpsray.data.schema.Schema` for every built-in one;
a type variable, so that this module does not import the schema module, which imports this one)."""


@dataclass(frozen=True)
class RowCount:
    """How many rows an input holds: ``rows``, ``exact`` (counted) or estimated from bytes, over
    ``files`` files of ``bytes`` bytes; ``how`` says how it was found."""

    rows: int
    exact: bool
    files: int = 0
    bytes: int = 0
    how: str = ""


@dataclass(frozen=True)
class SplitRead(Generic[S]):
    """One split to read: its ``schema``, the bad-input ``policy`` and the ``report`` bad input
    goes to, the bytes a streaming reader parses at a time and the rows a reader's batch holds."""

    split: Split
    schema: S
    policy: BadInputPolicy
    report: BadInputReport
    block_size: int = DEFAULT_BLOCK_SIZE
    batch_size: int = 65536


class Format(ABC, Generic[S]):
    """A file layout: reading, splitting, counting rows and checking a schema (module docstring)."""

    name: str = ""

    @abstractmethod
    def read(self, r: SplitRead[S]) -> Iterator[Batch]:
        """The good rows of ``r.split`` in file order as variable-size batches; bad rows and files
        go to ``r.report`` under ``r.policy`` (strict mode raises a ``DataError`` naming file and
        line/row)."""

    @abstractmethod
    def splits(self, path: str, compression: str) -> bool:
        """Whether byte ranges of the file at ``path`` (``compression`` as in the schema) can be
        read separately; ``False``: the file is read whole by one reader."""

    @abstractmethod
    def count_rows(self, files: Sequence[Split], schema: S) -> RowCount:
        """The rows of ``files`` (whole-file splits of listed, readable files): counted where the
        format records them, else estimated from bytes; never reads more than a bounded prefix."""

    def validate(self, schema: S) -> None:  # noqa: B027 - most formats accept every schema
        """Raise ``ValueError("schema.<key>: why")`` for a schema this format cannot read."""

    def file_columns(self, split: Split, schema: S) -> list[str] | None:
        """The column names the file of ``split`` declares (a header line, a Parquet schema), to
        check the schema against before reading; ``None`` when the file declares none. Raises
        ``OSError``/``pyarrow.ArrowException`` when the file cannot be read."""
        return None

    def column_names(self, schema: S) -> list[str] | None:
        """The file's column names when the schema alone gives them (a headerless text file's
        ``c0, c1, …``), else ``None`` (the file names its columns)."""
        return None

    def preset(self) -> S | None:
        """The schema a job gets when it names only this format (Criteo's), else ``None``."""
        return None


_BUILTIN = {
    "criteo": "hpsray.data.text:CRITEO",
    "csv": "hpsray.data.text:CSV",
    "parquet": "hpsray.data.parquet:PARQUET",
    "jsonl": "hpsray.data.jsonl:JSONL",
}
_registered: dict[str, Format[Any]] = {}


def register(fmt: Format[Any]) -> None:
    """Make ``fmt`` known under ``fmt.name`` (replacing a format of that name)."""
    if not fmt.name:
        raise ValueError("a Format needs a name")
    _registered[fmt.name] = fmt


def format_names() -> tuple[str, ...]:
    """The names a schema's ``format`` may take."""
    return tuple(dict.fromkeys([*_BUILTIN, *_registered]))


def get_format(name: str) -> Format[Any]:
    """The format called ``name``; ``ValueError`` naming the known ones otherwise."""
    fmt = _registered.get(name)
    if fmt is not None:
        return fmt
    where = _BUILTIN.get(name) if isinstance(name, str) else None
    if where is None:
        raise ValueError(f"schema.format: must be one of {', '.join(format_names())}, got {name!r}")
    module, attr = where.split(":")
    fmt = getattr(importlib.import_module(module), attr)
    _registered[name] = fmt
    return fmt


def format_of(schema: Named) -> Format[Any]:
    """The format that reads files under ``schema``."""
    return get_format(schema.format)
