"""Reading a source into fixed-size batches: the entry point the pipeline's readers use.

::

    splits = open_source("s3://bucket/clicks/*.tsv.gz", reader_index=i, num_readers=n)
    report = BadInputReport()
    for batch in read_batches(splits, Schema.criteo(), batch_size=65536, report=report):
        ...
    print(report.summary())

or, the same in one object, ``DataReader(sources, schema, reader_index=i, num_readers=n)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hpsray.data.bad_input import LENIENT, BadInputPolicy, BadInputReport, log
from hpsray.data.batch import Batch
from hpsray.data.formats import DEFAULT_BLOCK_SIZE, RowCount, SplitRead, format_of
from hpsray.data.schema import Schema
from hpsray.data.sources import Split, list_files, open_source

Transform = Callable[[Batch], Batch]


def read_split(
    split: Split,
    schema: Schema,
    policy: BadInputPolicy = LENIENT,
    report: BadInputReport | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    batch_size: int = 65536,
) -> Iterator[Batch]:
    """The good rows of one split in file order, as variable-size batches."""
    report = report if report is not None else BadInputReport()
    return format_of(schema).read(SplitRead(split, schema, policy, report, block_size, batch_size))


def count_rows(sources: str | Sequence[str], schema: Schema, filesystem: Any = None) -> RowCount:
    """The rows of the files ``sources`` names under ``schema``: counted where the format records
    them (Parquet), else estimated from bytes (``RowCount.exact`` says which). Files that cannot be
    listed are left out; raises ``DataError``/``OSError`` when nothing can be listed or read."""
    files = [f for f in list_files(sources, filesystem) if f.size is not None]
    if not files:
        return RowCount(0, False, 0, 0, "no readable files")
    return format_of(schema).count_rows(files, schema)


def read_batches(
    splits: Sequence[Split],
    schema: Schema,
    batch_size: int = 65536,
    policy: BadInputPolicy = LENIENT,
    report: BadInputReport | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    transform: Transform | None = None,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Batches of exactly ``batch_size`` good rows (the last may be shorter unless ``drop_last``).

    Rows come in split order, file order within a split, and batches span split boundaries.
    Bad input goes to ``report`` under ``policy``; lenient mode raises
    :class:`~hpsray.data.bad_input.TooMuchBadInput` once the bad fraction passes the policy's limit.
    ``transform`` (e.g. :class:`~hpsray.data.osrp.OPOSRP`) is applied to each output batch.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    report = report if report is not None else BadInputReport()
    pending: list[Batch] = []
    have = 0

    def emit(b: Batch) -> Batch:
        return transform(b) if transform is not None else b

    for split in splits:
        for piece in read_split(split, schema, policy, report, block_size=block_size, batch_size=batch_size):
            report.check(policy)
            pending.append(piece)
            have += len(piece)
            if have < batch_size:
                continue
            merged = Batch.concat(pending) if len(pending) > 1 else pending[0]
            start = 0
            while have - start >= batch_size:
                yield emit(merged.slice(start, start + batch_size))
                start += batch_size
            rest = merged.slice(start, len(merged))
            pending = [rest] if len(rest) else []
            have = len(rest)
    report.check(policy, final=True)
    if report.rows_bad or report.files_bad:
        log.warning("bad input: %s", report.summary())
    if have and not drop_last:
        yield emit(Batch.concat(pending) if len(pending) > 1 else pending[0])


class DataReader:
    """Reader ``reader_index`` of ``num_readers`` over ``sources``: its splits, batches and report.

    Iterating gives one pass (epoch) over the reader's share; ``report`` accumulates over passes.
    """

    def __init__(
        self,
        sources: str | Sequence[str],
        schema: Schema,
        *,
        reader_index: int = 0,
        num_readers: int = 1,
        batch_size: int = 65536,
        policy: BadInputPolicy = LENIENT,
        filesystem: Any = None,
        split_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        transform: Transform | None = None,
    ) -> None:
        self.schema = schema
        self.batch_size = batch_size
        self.policy = policy
        self.block_size = block_size
        self.transform = transform
        self.report = BadInputReport()
        self.splits = open_source(
            sources,
            reader_index,
            num_readers,
            format=schema.format,
            compression=schema.compression,
            filesystem=filesystem,
            split_bytes=split_bytes,
        )

    def __iter__(self) -> Iterator[Batch]:
        return read_batches(
            self.splits,
            self.schema,
            self.batch_size,
            self.policy,
            self.report,
            block_size=self.block_size,
            transform=self.transform,
        )

    def __repr__(self) -> str:
        return f"DataReader({len(self.splits)} splits, format={self.schema.format})"
