"""The sample a plan is made from: the job's first examples, read by the job's own readers.

Generated data (``[data.synthetic]``) comes from the job's :class:`~hpsray.data.PlantedCTR`
exactly as the pipeline's ``SyntheticSource`` produces it; files are read by
:class:`~hpsray.data.DataReader` with the job's schema and bad-input policy, so the sample's keys
are the keys training will see; with several ``[[tables]]`` they are tagged with their table as
the pipeline's readers tag them (:func:`hpsray.tables.key_tagging`). The input's size is exact
for generated data and counted or estimated by the input's format (:meth:`hpsray.data.formats.Format.count_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hpsray.data import LENIENT, Batch, DataReader
from hpsray.data.formats import RowCount
from hpsray.data.readers import count_rows
from hpsray.kernels.distinct import distinct_sorted
from hpsray.tables import key_tagging, with_first_order

if TYPE_CHECKING:
    from hpsray.job import JobConfig

__all__ = ["InputSize", "Sample", "input_size", "read_sample"]


InputSize = RowCount
"""How much the job reads: ``rows`` (``exact`` or estimated), ``files`` and their ``bytes``."""


@dataclass
class Sample:
    """The first ``examples`` of the input as the pipeline batches them.

    ``batch_keys[t]``: distinct sorted keys of batch ``t`` (``batch_size`` examples, the last may
    be shorter; tagged with their table when the job has several: ``n_tables``); ``batches``: the
    first few batches whole (for calibration); ``read_s``: the seconds reading and decoding
    ``read_examples`` took (every batch but the first, which pays the one-time costs; the read
    stage's cost), ``read_cpu_s`` its CPU seconds.
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
    n_tables: int = 1

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
    cfg = with_first_order(job.train_config(), n_slots)  # a model of first-order rows: their table too
    tagging = key_tagging(cfg, n_slots)
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
        for tag in tagging:
            batch = tag(batch)
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
        n_tables=len(cfg.tables) or 1,
    )


def input_size(job: JobConfig) -> InputSize:
    """The number of training examples the job reads (counted where the format records it, else
    estimated from bytes: :meth:`hpsray.data.formats.Format.count_rows`)."""
    syn = job.data.synthetic
    if syn is not None:
        return InputSize(syn.rows, True, how="data.synthetic.rows")
    schema = job.schema()
    assert schema is not None  # files have a schema
    return count_rows(list(job.data.paths), schema)
