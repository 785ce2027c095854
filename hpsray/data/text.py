"""Streaming reader for delimited text click logs: CSV/TSV with a declared schema, and Criteo TSV.

pyarrow's streaming CSV reader parses ``block_size`` bytes at a time (bounded memory) with
every used column as a string; :class:`~hpsray.data.convert.Converter` turns each block into a
``Batch``. Rows with the wrong column count reach pyarrow's ``invalid_row_handler``, which
records their physical line number; the line of any other bad row follows from the records
and invalid lines seen so far, because with ``newlines_in_values`` off each record is one line.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv

from hpsray.data.bad_input import (
    CORRUPT_FILE,
    EMPTY_FILE,
    MISSING_COLUMN,
    TRUNCATED_FILE,
    UNREADABLE_PATH,
    WRONG_COLUMN_COUNT,
    BadInputPolicy,
    BadInputReport,
)
from hpsray.data.batch import Batch
from hpsray.data.convert import Converter
from hpsray.data.formats import DEFAULT_BLOCK_SIZE, Format, RowCount, SplitRead
from hpsray.data.schema import Schema
from hpsray.data.sources import (
    RangeStream,
    Split,
    WholeLineStream,
    compression_of,
    count_lines_before,
    next_line_start,
    open_lines,
)
from hpsray.errors import DataError

COUNT_BYTES = 64 << 20  # decompressed bytes read to measure a line-per-row file's lines per byte


def _split_header(line: bytes, schema: Schema) -> list[str]:
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    names = text.split(schema.delimiter)
    if schema.quote_char:
        q = schema.quote_char
        names = [n[1:-1] if len(n) >= 2 and n[0] == q and n[-1] == q else n for n in names]
    return names


class _TextSplitReader:
    """Reads one split; yields batches of its good rows and records the bad ones."""

    def __init__(self, split: Split, schema: Schema, policy: BadInputPolicy, report: BadInputReport, block_size: int):
        self.split = split
        self.schema = schema
        self.policy = policy
        self.report = report
        self.block_size = block_size
        self._line_base: int | None = None
        self._real_start = 0
        self.pending: list[tuple[int, str]] = []  # (line, detail) of rows pyarrow found malformed
        self.cursor = 1  # line number (within the stream) of the next record
        self.bad_rows_here = 0

    # -- errors ------------------------------------------------------------------------------

    def _abs_line(self, line: int) -> int:
        if self._real_start == 0:
            return line
        if self._line_base is None:
            self._line_base = count_lines_before(self.split, self._real_start)
        return self._line_base + line

    def _file_error(self, reason: str, detail: str) -> None:
        self.report.add(DataError(self.split.uri, reason, detail), self.policy, file_level=True)

    def _row_error(self, line: int, reason: str, detail: str) -> None:
        self.report.add(DataError(self.split.uri, reason, detail, line=self._abs_line(line)), self.policy)

    def _bad_rows(self, items: list[tuple[int, str, str]]) -> None:
        """Report bad rows ``(line, reason, detail)`` in line order (strict: the first raises)."""
        items.sort(key=lambda t: t[0])
        room = max(0, self.policy.max_examples - len(self.report.examples))
        for k, (line, reason, detail) in enumerate(items):
            if self.policy.strict or k < room:
                self._row_error(line, reason, detail)
            else:
                self.report.add_rows(reason, 1)

    # -- reading -----------------------------------------------------------------------------

    def _open(self) -> tuple[RangeStream | WholeLineStream, bool]:
        stream, self._real_start, no_lines = open_lines(self.split, self.schema.compression)
        return stream, no_lines

    def _header_names(self) -> list[str]:
        with self.split.filesystem.open_input_file(self.split.path) as f:
            end = next_line_start(f, 0, f.size())
            return _split_header(f.read_at(end, 0), self.schema)

    def __iter__(self) -> Iterator[Batch]:
        s, sp = self.schema, self.split
        try:
            stream, no_lines = self._open()
        except (OSError, pa.ArrowException) as e:
            self._file_error(UNREADABLE_PATH, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        if no_lines:  # an empty file, or a byte range in which no line starts
            stream.close()
            if sp.start == 0:
                self._file_error(EMPTY_FILE, "the file is empty")
            return

        names: list[str] | None
        if not s.header:
            names = s.column_names()
        elif self._real_start > 0:
            try:
                names = self._header_names()
            except (OSError, pa.ArrowException) as e:
                stream.close()
                self._file_error(UNREADABLE_PATH, f"cannot read the header: {e}")
                return
            self.cursor = 1  # the split's own lines; the header is counted by the line base
        else:
            names = None  # pyarrow reads the header
            self.cursor = 2

        def on_invalid(row: Any) -> str:
            self.pending.append((row.number, f"expected {row.expected_columns} columns, got {row.actual_columns}"))
            return "skip"

        read_opts = pcsv.ReadOptions(use_threads=False, block_size=self.block_size, column_names=names)
        parse_opts = pcsv.ParseOptions(
            delimiter=s.delimiter,
            quote_char=s.quote_char or False,
            ignore_empty_lines=False,
            newlines_in_values=False,
            invalid_row_handler=on_invalid,
        )
        rows_here = 0
        try:
            try:
                if names is None:
                    # The header first, to learn the names that the column types refer to.
                    head = pcsv.open_csv(
                        stream,
                        read_options=pcsv.ReadOptions(use_threads=False, block_size=self.block_size),
                        parse_options=parse_opts,
                        convert_options=pcsv.ConvertOptions(include_columns=[], check_utf8=False),
                    )
                    names = head.schema.names
                    head.close()
                    stream.close()
                    stream, _ = self._open()
                try:
                    conv = Converter(s, names)
                except KeyError as e:
                    self._file_error(MISSING_COLUMN, f"{e.args[0]} (columns: {', '.join(names[:50])})")
                    return
                types = {name: pa.string() for name in conv.used}
                reader = pcsv.open_csv(
                    stream,
                    read_options=read_opts,
                    parse_options=parse_opts,
                    convert_options=pcsv.ConvertOptions(
                        column_types=types,
                        include_columns=conv.used,
                        strings_can_be_null=True,
                        null_values=[""],
                        quoted_strings_can_be_null=False,
                        check_utf8=False,
                    ),
                )
            except pa.ArrowInvalid as e:
                damaged = stream.error if isinstance(stream, WholeLineStream) else None
                if damaged is not None:
                    self._file_error(TRUNCATED_FILE, f"{str(damaged).splitlines()[0]} (before the first line)")
                elif "Empty CSV file" in str(e):
                    self._file_error(EMPTY_FILE, "the file is empty")
                else:
                    self._file_error(CORRUPT_FILE, str(e))
                return
            while True:
                try:
                    rb = reader.read_next_batch()
                except StopIteration:
                    break
                batch = self._block(conv, rb)
                rows_here += len(batch)
                if len(batch):
                    yield batch
            self._bad_rows(self._take_pending(None))
            if isinstance(stream, WholeLineStream) and stream.error is not None:
                raise stream.error
        except OSError as e:
            # pyarrow reports a truncated gzip/zstd stream as OSError mid-read; the rows before
            # it have been yielded already (nothing trained is lost).
            self._bad_rows(self._take_pending(None))
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            reason = TRUNCATED_FILE if "runcated" in msg or "compress" in msg.lower() else UNREADABLE_PATH
            self._file_error(reason, f"{msg} (after line {self._abs_line(self.cursor - 1)})")
            return
        except pa.ArrowInvalid as e:
            self._bad_rows(self._take_pending(None))
            self._file_error(CORRUPT_FILE, f"{e} (after line {self._abs_line(self.cursor - 1)})")
            return
        finally:
            stream.close()
        if rows_here == 0 and self.bad_rows_here == 0:
            if sp.start == 0:
                self._file_error(EMPTY_FILE, "no rows" if s.header else "the file is empty")
            return
        self.report.files_ok += 1

    def _take_pending(self, last_line: int | None) -> list[tuple[int, str, str]]:
        """The malformed lines up to ``last_line`` (all when ``None``) as bad-row items."""
        if not self.pending:
            return []
        self.pending.sort()
        k = len(self.pending) if last_line is None else bisect.bisect_right(self.pending, (last_line, "\uffff"))
        items = [(line, WRONG_COLUMN_COUNT, detail) for line, detail in self.pending[:k]]
        del self.pending[:k]
        self.bad_rows_here += len(items)
        if last_line is None and items:
            self.cursor = max(self.cursor, items[-1][0] + 1)
        return items

    def _block(self, conv: Converter, rb: pa.RecordBatch) -> Batch:
        n = rb.num_rows
        self.pending.sort()
        # The n records of this block are the first n lines >= cursor that pyarrow did not reject.
        first = self.cursor
        last = first + n - 1
        j = bisect.bisect_left(self.pending, (first, ""))
        inv_lines = []
        while j < len(self.pending) and self.pending[j][0] <= last:
            inv_lines.append(self.pending[j][0])
            last += 1
            j += 1
        out = conv.convert(rb)
        items: list[tuple[int, str, str]] = []
        if len(out.bad_index):
            span = np.arange(first, last + 1)
            lines = span[~np.isin(span, inv_lines)] if inv_lines else span
            room = max(0, self.policy.max_examples - len(self.report.examples))
            for k, (i, reason) in enumerate(zip(out.bad_index, out.bad_reason)):
                detail = conv.describe(rb, int(i), reason) if (self.policy.strict or k < room) else ""
                items.append((int(lines[i]), reason, detail))
            self.bad_rows_here += len(items)
        if inv_lines:
            items += self._take_pending(last)
        self.cursor = last + 1
        self._bad_rows(items)
        self.report.rows_ok += len(out.batch)
        return out.batch


def read_text_split(
    split: Split,
    schema: Schema,
    policy: BadInputPolicy,
    report: BadInputReport,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Iterator[Batch]:
    """Batches of the good rows of one text split (one per parsed block), recording bad input."""
    return iter(_TextSplitReader(split, schema, policy, report, block_size))


def count_lines(split: Split, declared: str, limit: int = COUNT_BYTES) -> tuple[int, int, bool]:
    """Lines in the first ``limit`` decompressed bytes of ``split``, how many bytes of the file
    (compressed, as stored) held them, and whether that was the whole file. Counting is
    ``bytes.count``: no per-line Python."""
    codec = compression_of(split.uri, declared)
    raw = split.filesystem.open_input_stream(split.path, compression=None)
    stream = pa.CompressedInputStream(raw, codec) if codec else raw
    lines = read = 0
    last = b"\n"
    try:
        while read < limit:
            chunk = stream.read(1 << 22)
            if not chunk:
                break
            lines += chunk.count(b"\n")
            read += len(chunk)
            last = chunk[-1:]
        whole = not stream.read(1)
        if whole and last != b"\n":
            lines += 1  # a last line without its newline
        used = raw.tell() if codec else read
        return lines, (split.nbytes if whole else used), whole
    finally:
        stream.close()


def estimate_lines(files: Sequence[Split], compression: str, header_lines: int = 0) -> RowCount:
    """Rows of line-per-row ``files``: the lines per byte of the largest file times the bytes of
    all, less ``header_lines`` per file; exact when there is one file and it was read whole."""
    if not files:
        return RowCount(0, False, 0, 0, "no readable files")
    total = sum(f.nbytes for f in files)
    first = max(files, key=lambda f: f.nbytes)
    lines, raw_bytes, whole = count_lines(first, compression)
    rows = int(round(lines / max(raw_bytes, 1) * total)) - header_lines * len(files)
    exact = whole and len(files) == 1
    how = "lines of the file" if exact else f"lines per byte of {first.uri} × bytes of all files"
    return RowCount(max(rows, 0), exact, len(files), total, how)


class TextFormat(Format[Schema]):
    """Delimited text, one row per line: ``csv`` (the schema's columns) and ``criteo`` (its preset)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def read(self, r: SplitRead[Schema]) -> Iterator[Batch]:
        return read_text_split(r.split, r.schema, r.policy, r.report, r.block_size)

    def splits(self, path: str, compression: str) -> bool:
        return compression_of(path, compression) is None

    def count_rows(self, files: Sequence[Split], schema: Schema) -> RowCount:
        return estimate_lines(files, schema.compression, 1 if schema.header else 0)

    def validate(self, schema: Schema) -> None:
        if schema.header:
            return
        names = set(schema.columns or ())
        refs = schema.column_refs()
        for key, c in refs:
            if isinstance(c, str) and c not in names:
                raise ValueError(
                    f"schema.{key}: column {c!r} is not named in schema.columns (a headerless file has no names)"
                )
        width = schema.expected_columns()
        for key, c in refs:
            if isinstance(c, int) and c >= width:
                raise ValueError(f"schema.{key}: column index {c} is outside the {width} columns of each row")

    def file_columns(self, split: Split, schema: Schema) -> list[str] | None:
        if not schema.header:
            return None
        codec = compression_of(split.path, schema.compression)
        with split.filesystem.open_input_stream(split.path, compression=codec) as f:
            return _split_header(f.read(1 << 16).split(b"\n", 1)[0], schema)

    def column_names(self, schema: Schema) -> list[str] | None:
        return None if schema.header else schema.column_names()

    def preset(self) -> Schema | None:
        return Schema.criteo() if self.name == "criteo" else None


CSV = TextFormat("csv")
CRITEO = TextFormat("criteo")
