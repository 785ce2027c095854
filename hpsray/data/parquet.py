"""Streaming reader for Parquet click logs under a declared :class:`~hpsray.data.schema.Schema`.

Row groups are read ``batch_size`` rows at a time (bounded memory), only the declared columns.
Categorical columns may be integers (used as the raw value), strings (hashed or parsed per
``schema.encoding``) or lists of either (multi-hot slots). A byte-range split reads the row
groups whose first byte lies inside it. Bad rows are named by their 1-based row in the file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from hpsray.data.bad_input import (
    CORRUPT_FILE,
    EMPTY_FILE,
    MISSING_COLUMN,
    UNREADABLE_PATH,
    BadInputPolicy,
    BadInputReport,
)
from hpsray.data.batch import Batch
from hpsray.data.convert import Converter
from hpsray.data.formats import Format, RowCount, SplitRead
from hpsray.data.schema import Schema
from hpsray.data.sources import Split
from hpsray.errors import DataError


def _row_group_start(md: pq.FileMetaData, i: int) -> int:
    rg = md.row_group(i)
    starts = []
    for c in range(rg.num_columns):
        col = rg.column(c)
        starts.append(col.data_page_offset)
        if col.has_dictionary_page and col.dictionary_page_offset is not None:
            starts.append(col.dictionary_page_offset)
    return min(starts) if starts else 0


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def read_parquet_split(
    split: Split,
    schema: Schema,
    policy: BadInputPolicy,
    report: BadInputReport,
    batch_size: int = 65536,
) -> Iterator[Batch]:
    """Batches of the good rows of one Parquet split, recording bad rows and files in ``report``."""

    def file_error(reason: str, detail: str) -> None:
        report.add(DataError(split.uri, reason, detail), policy, file_level=True)

    try:
        f = split.filesystem.open_input_file(split.path)
    except (OSError, pa.ArrowException) as e:
        file_error(UNREADABLE_PATH, _first_line(e))
        return
    try:
        try:
            if f.size() == 0:
                file_error(EMPTY_FILE, "the file is empty")
                return
            pf = pq.ParquetFile(f)
        except (OSError, pa.ArrowException) as e:
            file_error(CORRUPT_FILE, f"not a readable Parquet file (truncated?): {_first_line(e)}")
            return
        names = pf.schema_arrow.names
        try:
            conv = Converter(schema, names)
        except KeyError as e:
            file_error(MISSING_COLUMN, f"{e.args[0]} (columns: {', '.join(names[:50])})")
            return
        md = pf.metadata
        groups = list(range(md.num_row_groups))
        first_row = [0]
        for i in groups:
            first_row.append(first_row[-1] + md.row_group(i).num_rows)
        if not split.whole:
            end = split.end if split.end is not None else 1 << 62
            groups = [i for i in groups if split.start <= _row_group_start(md, i) < end]
        if md.num_rows == 0:
            if split.start == 0:
                file_error(EMPTY_FILE, "no rows")
            return
        for g in groups:
            row = first_row[g]
            try:
                it = pf.iter_batches(batch_size=batch_size, row_groups=[g], columns=conv.used, use_threads=False)
                for rb in it:
                    out = conv.convert(rb)
                    room = max(0, policy.max_examples - len(report.examples))
                    for k, (i, reason) in enumerate(zip(out.bad_index, out.bad_reason)):
                        if policy.strict or k < room:
                            detail = conv.describe(rb, int(i), reason)
                            report.add(DataError(split.uri, reason, detail, row=row + int(i) + 1), policy)
                        else:
                            report.add_rows(reason, 1)
                    report.rows_ok += len(out.batch)
                    row += rb.num_rows
                    if len(out.batch):
                        yield out.batch
            except (OSError, pa.ArrowException) as e:
                file_error(CORRUPT_FILE, f"{_first_line(e)} (in row group {g}, after row {row})")
                return
        report.files_ok += 1
    finally:
        f.close()


class ParquetFormat(Format[Schema]):
    """Parquet: typed columns by name, split at row groups, rows counted from the file metadata."""

    name = "parquet"

    def read(self, r: SplitRead[Schema]) -> Iterator[Batch]:
        return read_parquet_split(r.split, r.schema, r.policy, r.report, r.batch_size)

    def splits(self, path: str, compression: str) -> bool:
        return True

    def file_columns(self, split: Split, schema: Schema) -> list[str] | None:
        with split.filesystem.open_input_file(split.path) as f:
            return list(pq.read_schema(f).names)

    def count_rows(self, files: Sequence[Split], schema: Schema) -> RowCount:
        n = 0
        for s in files:
            with s.filesystem.open_input_file(s.path) as f:
                n += pq.ParquetFile(f).metadata.num_rows
        return RowCount(n, True, len(files), sum(s.nbytes for s in files), "Parquet metadata")


PARQUET = ParquetFormat()
