"""The input's configuration checked before anything runs: every path exists and every declared
column is in every file.

A path that does not exist or a column the files do not have is a mistake in the job, not bad
input: :func:`check_inputs` raises :class:`~hpsray.errors.ConfigError` naming the job file, the
key, the file and the path or column, whatever the bad-input mode (lenient mode would otherwise
skip every file and report ``too_much_bad_input``). Reads only each file's header line (text) or
footer schema (Parquet); URIs (``s3://`` ...) are left to the readers.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpsray.errors import ConfigError, DataError

if TYPE_CHECKING:
    from hpsray.data import Schema
    from hpsray.job import JobConfig

__all__ = ["check_inputs", "check_sources"]

MAX_FILES = 1000  # files whose columns are checked (a header each); the rest are the readers'


def check_inputs(job: JobConfig) -> None:
    """:func:`check_sources` for the job's ``data.paths`` and ``data.eval_paths`` (none for
    ``[data.synthetic]``)."""
    if job.data.synthetic is not None:
        return
    schema = job.schema()
    for key, paths in (("data.paths", job.data.paths), ("data.eval_paths", job.data.eval_paths)):
        if paths:
            check_sources(list(paths), schema, job.where, key)


def check_sources(paths: Sequence[str], schema: Schema, where: str, key: str = "data.paths") -> None:
    """Raise :class:`ConfigError` (``where: key: reason``) for a local path that does not exist,
    a pattern or directory without files, or a declared column missing from a file's header
    (or Parquet schema): the reason names the file and the path or column."""
    from hpsray.data.sources import list_files

    local = [p for p in paths if "://" not in p or p.startswith("file://")]
    if not local:
        return
    try:
        files = list_files(local)
    except DataError as e:
        raise ConfigError(where, key, f"{e.file}: {e.detail}" if e.file else str(e)) from None
    for f in files:
        if f.size is None:
            raise ConfigError(where, key, f"{f.uri}: no such file or directory")
    for f in files[:MAX_FILES]:
        names = _columns(f, schema)
        if names is not None:
            _check_columns(names, schema, f.uri, where)
        else:
            _check_width(f, schema, where)


def _columns(split: object, schema: Schema) -> list[str] | None:
    """The file's column names (its header line, or its Parquet schema: the format's
    :meth:`~hpsray.data.formats.Format.file_columns`); ``None`` when the file declares none, or
    cannot be read (the readers then report it under the bad-input policy)."""
    import pyarrow as pa

    from hpsray.data.formats import format_of

    try:
        return format_of(schema).file_columns(split, schema)  # type: ignore[arg-type]
    except (OSError, pa.ArrowException):
        return None


def _check_columns(names: list[str], schema: Schema, uri: str, where: str) -> None:
    declared = [("label", schema.label)] + [("dense", c) for c in schema.dense]
    declared += [("categorical", c) for c in schema.categorical]
    for field, column in declared:
        if isinstance(column, int):
            if column >= len(names):
                raise ConfigError(
                    where, f"data.schema.{field}", f"column index {column}, but {uri} has {len(names)} columns"
                )
            continue
        if column not in names:
            close = difflib.get_close_matches(column, names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            shown = ", ".join(names[:50]) + (" ..." if len(names) > 50 else "")
            raise ConfigError(
                where, f"data.schema.{field}", f"column {column!r} is not in {uri} (its columns: {shown}){hint}"
            )


FIRST_LINES = 5  # lines of a headerless text file whose fields are counted


def _check_width(split: object, schema: Schema, where: str) -> None:
    """A headerless text file whose first lines all have fewer fields than the schema reads
    (every row would be a bad row): the schema's mistake, naming the file and the column."""
    import pyarrow as pa

    from hpsray.data.formats import format_of
    from hpsray.data.sources import compression_of
    from hpsray.data.text import TextFormat

    if schema.header or not isinstance(format_of(schema), TextFormat):
        return
    fs, path = split.filesystem, split.path  # type: ignore[attr-defined]
    try:
        with fs.open_input_stream(path, compression=compression_of(path, schema.compression)) as f:
            head = f.read(1 << 16)
    except (OSError, pa.ArrowException):
        return  # the readers report an unreadable file under the bad-input policy
    lines = [line for line in head.split(b"\n")[:-1] if line.strip()][:FIRST_LINES]
    if not lines:
        return
    fields = max(len(line.split(schema.delimiter.encode())) for line in lines)
    need = schema.expected_columns()
    if fields >= need:
        return
    uri = split.uri  # type: ignore[attr-defined]
    declared = [("label", schema.label)] + [("dense", c) for c in schema.dense]
    declared += [("categorical", c) for c in schema.categorical]
    beyond = [(k, c) for k, c in declared if isinstance(c, int) and c >= fields]
    if schema.columns is None and schema.n_columns is None and beyond:
        key, column = beyond[0]
        raise ConfigError(
            where, f"data.schema.{key}", f"column index {column}, but the lines of {uri} have {fields} fields"
        )
    raise ConfigError(
        where, "data.schema", f"{uri}: its lines have {fields} fields, the schema reads {need} columns per line"
    )
