"""The sample a plan is made from: the job's first examples, read by the job's own readers.

Generated data (``[data.synthetic]``) comes from the job's :class:`~hpsray.data.PlantedCTR`
exactly as the pipeline's ``SyntheticSource`` produces it; files are read by
:class:`~hpsray.data.DataReader` with the job's schema and bad-input policy, so the sample's keys
are the keys training will see. The input's size is exact for generated data and Parquet
(row-group metadata) and estimated for text from the line density of the first file.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hpsray.data import LENIENT, Batch, DataReader, list_files
from hpsray.data.sources import compression_of
from hpsray.kernels.distinct import distinct_sorted

if TYPE_CHECKING:
    from hpsray.data.sources import Split
    from hpsray.job import JobConfig

__all__ = ["InputSize", "Sample", "input_size", "read_sample"]

_COUNT_BYTES = 64 << 20  # decompressed bytes read to measure a text file's lines per byte


@dataclass(frozen=True)
class InputSize:
    """How much the job reads: ``rows`` (``exact`` or estimated), ``files`` and their ``bytes``."""

    rows: int
    exact: bool
    files: int = 0
    bytes: int = 0
    how: str = ""


@dataclass
class Sample:
    """The first ``examples`` of the input as the pipeline batches them.

    ``batch_keys[t]``: distinct sorted keys of batch ``t`` (``batch_size`` examples, the last may
    be shorter); ``batches``: the first few batches whole (for calibration); ``read_s``: the
    seconds reading and decoding ``read_examples`` took (every batch but the first, which pays the
    one-time costs; the read stage's cost), ``read_cpu_s`` its CPU seconds.
    """

    batch_keys: list[np.ndarray]
    batch_examples: list[int]
    batches: list[Batch]
    n_slots: int
    n_dense: int
    read_s: float
    keys_per_example: float
    size: InputSize
    complete: bool = False  # the sample is the whole input
    read_cpu_s: float = 0.0
    read_examples: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def examples(self) -> int:
        return int(sum(self.batch_examples))


def _source_batches(job: JobConfig, batch_size: int) -> tuple[Iterator[Batch], int, int]:
    """The batches one reader of one node reads, and the schema's slot/dense counts."""
    syn = job.data.synthetic
    if syn is not None:
        gen = syn.generator()

        def generated() -> Iterator[Batch]:
            for lo in range(0, syn.rows, batch_size):
                yield gen.generate(min(batch_size, syn.rows - lo), start_row=lo)

        return generated(), gen.n_slots, gen.n_dense
    schema = job.schema()
    reader = DataReader(list(job.data.paths), schema, batch_size=batch_size, policy=job.data.bad_input or LENIENT)
    return iter(reader), schema.n_slots, schema.n_dense


def read_sample(job: JobConfig, rows: int, keep_batches: int = 3) -> Sample:
    """Read at least ``rows`` examples (whole batches; all of them if the input is smaller)."""
    bs = job.pipeline.batch_size
    it, n_slots, n_dense = _source_batches(job, bs)
    keys: list[np.ndarray] = []
    examples: list[int] = []
    kept: list[Batch] = []
    nnz = 0
    complete = True
    read_s = read_cpu_s = 0.0
    first = (0.0, 0.0)
    while sum(examples) < rows:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = next(it, None)
        if batch is None:
            break
        keys.append(distinct_sorted(batch.keys))
        took = (time.perf_counter() - t0, time.process_time() - c0)
        if examples:  # the first batch pays the one-time costs (imports, opening files, kernels)
            read_s, read_cpu_s = read_s + took[0], read_cpu_s + took[1]
        else:
            first = took
        examples.append(len(batch))
        nnz += batch.nnz
        if len(kept) < keep_batches:
            kept.append(batch)
    else:
        complete = next(it, None) is None
    timed = sum(examples[1:])
    if not timed and examples:  # a single batch: its time is all there is
        (read_s, read_cpu_s), timed = first, examples[0]
    if not examples:
        raise ValueError(f"{job.where}: the job's data produced no examples")
    size = input_size(job)
    if complete:
        size = InputSize(sum(examples), True, size.files, size.bytes, "the whole input was sampled")
    return Sample(
        keys,
        examples,
        kept,
        n_slots,
        n_dense,
        read_s,
        nnz / sum(examples),
        size,
        complete,
        read_cpu_s=read_cpu_s,
        read_examples=timed,
    )


def input_size(job: JobConfig) -> InputSize:
    """The number of training examples the job reads (exact where the format records it)."""
    syn = job.data.synthetic
    if syn is not None:
        return InputSize(syn.rows, True, how="data.synthetic.rows")
    splits = [s for s in list_files(list(job.data.paths)) if s.size is not None]
    total = sum(s.nbytes for s in splits)
    if not splits:
        return InputSize(0, False, 0, 0, "no readable files")
    schema = job.schema()
    if schema.format == "parquet":
        import pyarrow.parquet as pq

        n = 0
        for s in splits:
            with s.filesystem.open_input_file(s.path) as f:
                n += pq.ParquetFile(f).metadata.num_rows
        return InputSize(n, True, len(splits), total, "Parquet metadata")
    first = max(splits, key=lambda s: s.nbytes)
    lines, raw_bytes = _count_lines(first, schema.compression)
    per_byte = lines / max(raw_bytes, 1)
    return InputSize(
        int(round(per_byte * total)),
        raw_bytes >= first.nbytes and len(splits) == 1,
        len(splits),
        total,
        f"lines per byte of {first.uri} × bytes of all files",
    )


def _count_lines(split: Split, declared: str) -> tuple[int, int]:
    """Lines in the first ``_COUNT_BYTES`` decompressed bytes of ``split``, and how many bytes of
    the file (compressed, as stored) held them. Counting is ``bytes.count``: no per-line Python."""
    import pyarrow as pa

    codec = compression_of(split.uri, declared)
    raw = split.filesystem.open_input_stream(split.path, compression=None)
    stream = pa.CompressedInputStream(raw, codec) if codec else raw
    lines = read = 0
    last = b"\n"
    try:
        while read < _COUNT_BYTES:
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
        return lines, (split.nbytes if whole else used)
    finally:
        stream.close()
