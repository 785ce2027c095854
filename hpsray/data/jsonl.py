"""JSON lines (``format = "jsonl"``): one JSON object per line, columns by the schema's names.

A value maps as a Parquet value does: a number is used as it is (a categorical one must be an
integer below ``2**64``), a string is parsed or hashed per ``schema.encoding``, a list is a
multi-hot categorical; a missing key or ``null`` is a missing value.

Each block of ``block_size`` bytes is parsed at once by pyarrow's JSON reader; a block it refuses
(a line that is not a JSON object, a blank line, a column whose values change type, a
categorical number it would read as a double) is parsed again line by line with ``orjson`` (or
the standard ``json``) to name each bad line, and only its good lines are used. Uncompressed
files split at line boundaries.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from hpsray.data.bad_input import (
    EMPTY_FILE,
    EMPTY_LINE,
    INVALID_CATEGORICAL,
    INVALID_LABEL,
    MISSING_COLUMN,
    NON_NUMERIC_DENSE,
    TRUNCATED_FILE,
    UNREADABLE_PATH,
    BadInputPolicy,
    BadInputReport,
)
from hpsray.data.batch import Batch
from hpsray.data.convert import Converter
from hpsray.data.formats import Format, RowCount, SplitRead
from hpsray.data.schema import Schema
from hpsray.data.sources import Split, WholeLineStream, compression_of, count_lines_before, open_lines
from hpsray.data.text import estimate_lines
from hpsray.errors import DataError

try:
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # orjson is optional (the test extra installs it)
    import json

    _loads = json.loads
    _JSONError = (ValueError,)

INVALID_JSON = "invalid_json"  # a line that is not one JSON object


def _kind(v: Any) -> str:
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


def _array(values: list) -> pa.Array | None:
    """``values`` as one Arrow column (integers past ``2**63`` as ``uint64``), or ``None`` when no
    type holds them all."""
    for kind in (None, pa.uint64()):
        try:
            return pa.array(values, type=kind)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            continue
    return None


class _JsonLinesSplitReader:
    """Reads one split; yields batches of its good rows and records the bad ones."""

    def __init__(self, split: Split, schema: Schema, policy: BadInputPolicy, report: BadInputReport, block_size: int):
        self.split, self.schema, self.policy, self.report = split, schema, policy, report
        self.block_size = block_size
        self.conv = Converter(schema, [str(c) for _, c in schema.column_refs()])  # validate(): all named
        self.start = 0  # byte offset of the split's first line
        self._line_base: int | None = None
        self.rows_here = self.bad_here = 0

    def _line(self, k: int) -> int:
        """The file's 1-based line number of the split's ``k``-th (0-based) line."""
        if self._line_base is None:
            self._line_base = 0 if self.start == 0 else count_lines_before(self.split, self.start)
        return self._line_base + k + 1

    def _file_error(self, reason: str, detail: str) -> None:
        self.report.add(DataError(self.split.uri, reason, detail), self.policy, file_level=True)

    def _bad_rows(self, items: list[tuple[int, str, str]]) -> None:
        """Report bad lines ``(k, reason, detail)`` in line order (strict: the first raises)."""
        items.sort(key=lambda t: t[0])
        room = max(0, self.policy.max_examples - len(self.report.examples))
        for j, (k, reason, detail) in enumerate(items):
            if self.policy.strict or j < room:
                self.report.add(DataError(self.split.uri, reason, detail, line=self._line(k)), self.policy)
            else:
                self.report.add_rows(reason, 1)
        self.bad_here += len(items)

    def __iter__(self) -> Iterator[Batch]:
        try:
            stream, self.start, no_lines = open_lines(self.split, self.schema.compression)
        except (OSError, pa.ArrowException) as e:
            self._file_error(UNREADABLE_PATH, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        first = 0  # the split's index of the block's first line
        tail = b""
        try:
            while not no_lines:
                data = stream.read(self.block_size)
                if not data:
                    break
                data = tail + data
                cut = data.rfind(b"\n")
                if cut < 0:
                    tail = data
                    continue
                tail = data[cut + 1 :]
                lines = data[:cut].split(b"\n")
                batch = self._block(lines, first)
                first += len(lines)
                if batch is not None and len(batch):
                    yield batch
            if tail.strip():
                batch = self._block([tail], first)
                if batch is not None and len(batch):
                    yield batch
            damaged = stream.error if isinstance(stream, WholeLineStream) else None
            if damaged is not None:
                msg = str(damaged).splitlines()[0] if str(damaged) else type(damaged).__name__
                self._file_error(TRUNCATED_FILE, f"{msg} (after line {self._line(first - 1)})")
                return
        except OSError as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            self._file_error(UNREADABLE_PATH, f"{msg} (after line {self._line(first - 1)})")
            return
        finally:
            stream.close()
        if self.rows_here == 0 and self.bad_here == 0:
            if self.split.start == 0:
                self._file_error(EMPTY_FILE, "the file is empty")
            return
        self.report.files_ok += 1

    def _block(self, lines: list[bytes], first: int) -> Batch | None:
        """The good rows of ``lines`` (the split's lines ``first``, ``first + 1``, …)."""
        used = self.conv.used
        table = self._parse_fast(lines)
        if table is not None:
            line_of = np.arange(len(lines))
            present = set(table.column_names)
        else:
            table, line_of, present = self._parse_slow(lines)
        missing = [name for name in used if name not in present]
        if first == 0 and missing and (table.num_rows or present):
            keys = ", ".join(sorted(present)[:50])
            self._file_error(MISSING_COLUMN, f"column {missing[0]!r} is in none of the first objects (keys: {keys})")
            return None
        n = table.num_rows
        cols = [table.column(name).combine_chunks() if name in table.column_names else pa.nulls(n) for name in used]
        rb = pa.RecordBatch.from_arrays(cols, names=used)
        out = self.conv.convert(rb)
        if len(out.bad_index):
            room = max(0, self.policy.max_examples - len(self.report.examples))
            self._bad_rows(
                [
                    (
                        int(line_of[i]),
                        reason,
                        self.conv.describe(rb, int(i), reason) if (self.policy.strict or j < room) else "",
                    )
                    for j, (i, reason) in enumerate(zip(out.bad_index, out.bad_reason))
                ]
            )
        self.report.rows_ok += len(out.batch)
        self.rows_here += len(out.batch)
        return out.batch

    def _parse_fast(self, lines: list[bytes]) -> pa.Table | None:
        """The block parsed by pyarrow, or ``None`` when it is refused or its rows are not its lines."""
        body = b"\n".join(lines)
        try:
            table = pajson.read_json(
                io.BytesIO(body),
                read_options=pajson.ReadOptions(use_threads=False, block_size=max(len(body) + 1, 1 << 16)),
            )
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            return None
        if table.num_rows != len(lines):
            return None
        for name in self.conv.cat_names:  # pyarrow reads integers past 2**63 as doubles: keys would be wrong
            if name in table.column_names and pa.types.is_floating(table.column(name).type):
                return None
        return table

    def _parse_slow(self, lines: list[bytes]) -> tuple[pa.Table, np.ndarray, set[str]]:
        """The good objects of ``lines`` as a table, and the line index of each; bad lines and
        values whose type differs from the column's first are reported."""
        bad: list[tuple[int, str, str]] = []
        objects: list[dict] = []
        line_of: list[int] = []
        for k, line in enumerate(lines):
            if not line.strip():
                bad.append((k, EMPTY_LINE, "empty line (no object)"))
                continue
            try:
                obj = _loads(line)
            except _JSONError as e:
                bad.append((k, INVALID_JSON, f"not JSON: {e}"))
                continue
            if not isinstance(obj, dict):
                bad.append((k, INVALID_JSON, f"a JSON {type(obj).__name__}, not an object"))
                continue
            objects.append(obj)
            line_of.append(k)
        present = {key for o in objects for key in o}
        role = {self.conv.label_name: INVALID_LABEL}
        role.update(dict.fromkeys(self.conv.dense_names, NON_NUMERIC_DENSE))
        role.update(dict.fromkeys(self.conv.cat_names, INVALID_CATEGORICAL))
        keep = np.ones(len(objects), np.bool_)
        for name in self.conv.used:
            values = [o.get(name) for o in objects]
            kinds = [_kind(v) for v in values if v is not None]
            if len(set(kinds)) <= 1:
                continue
            want = kinds[0]
            for i, v in enumerate(values):
                if v is not None and _kind(v) != want and keep[i]:
                    keep[i] = False
                    bad.append((line_of[i], role[name], f"column {name!r} value {v!r} is a {_kind(v)}, not a {want}"))
        for name in self.conv.cat_names:  # a categorical number is an integer (a key's raw value)
            for i, o in enumerate(objects):
                v = o.get(name)
                if keep[i] and isinstance(v, float):
                    keep[i] = False
                    bad.append((line_of[i], INVALID_CATEGORICAL, f"column {name!r} value {v!r} is not an integer"))
        for name in self.conv.used:  # integers no one 64-bit type holds: beyond uint64, or big beside negatives
            values = [o.get(name) for o in objects]
            if _array(values) is None:
                for i, v in enumerate(values):
                    if keep[i] and isinstance(v, int) and not -(1 << 63) <= v < (1 << 63):
                        keep[i] = False
                        bad.append((line_of[i], role[name], f"column {name!r} value {v} is beyond 64-bit integers"))
        self._bad_rows(bad)
        good = [o for o, k in zip(objects, keep) if k]
        arrays = [_array([o.get(name) for o in good]) for name in self.conv.used]
        if any(a is None for a in arrays):  # nothing left that a row could be blamed for alone
            raise DataError(self.split.uri, INVALID_JSON, "a block's values fit no column type")
        return pa.table(dict(zip(self.conv.used, arrays))), np.asarray(line_of, np.int64)[keep], present


class JsonLinesFormat(Format[Schema]):
    """JSON lines: one object per line, columns by name (module docstring)."""

    name = "jsonl"

    def read(self, r: SplitRead[Schema]) -> Iterator[Batch]:
        return iter(_JsonLinesSplitReader(r.split, r.schema, r.policy, r.report, r.block_size))

    def splits(self, path: str, compression: str) -> bool:
        return compression_of(path, compression) is None

    def count_rows(self, files: Sequence[Split], schema: Schema) -> RowCount:
        return estimate_lines(files, schema.compression)

    def validate(self, schema: Schema) -> None:
        for key, c in schema.column_refs():
            if not isinstance(c, str):
                raise ValueError(f"schema.{key}: a JSON-lines column is named, got the position {c!r}")


JSONL = JsonLinesFormat()
