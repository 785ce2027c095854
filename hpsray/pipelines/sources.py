"""Where a pipeline's examples come from: generated (planted synthetic) or files.

A source is a small picklable description; each ``Reader`` actor calls :meth:`open` with its
index to stream its own share (docs/architecture.md: The pipeline: different nodes receive different training data).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from hpsray.data.batch import Batch
from hpsray.data.synthetic import PlantedCTR

if TYPE_CHECKING:
    from hpsray.data.readers import DataReader


class PipelineSource(Protocol):
    """What a pipeline reads: a :class:`~hpsray.reference.ShardedSource` that also names the
    shape of its batches (the sources below are such)."""

    @property
    def n_slots(self) -> int: ...

    @property
    def n_dense(self) -> int: ...

    def open(self, batch_size: int, reader_index: int = 0, num_readers: int = 1) -> Iterator[Batch]: ...


@dataclass(frozen=True)
class SyntheticSource:
    """``rows`` examples of a planted synthetic stream, starting at ``start_row``.

    Reader ``i`` of ``n`` takes every ``n``-th batch, starting with batch ``i``.
    """

    generator: PlantedCTR
    rows: int
    start_row: int = 0

    @property
    def n_slots(self) -> int:
        return self.generator.n_slots

    @property
    def n_dense(self) -> int:
        return self.generator.n_dense

    def open(self, batch_size: int, reader_index: int = 0, num_readers: int = 1) -> Iterator[Batch]:
        n_batches = -(-self.rows // batch_size)
        for b in range(reader_index, n_batches, num_readers):
            lo = b * batch_size
            yield self.generator.generate(min(batch_size, self.rows - lo), start_row=self.start_row + lo)


@dataclass(frozen=True)
class FileSource:
    """Files (paths, globs or URIs that ``pyarrow.fs``/fsspec open) read with a declared schema.

    ``schema`` is a :class:`hpsray.data.Schema`; ``policy`` a :class:`hpsray.data.BadInputPolicy`
    (lenient by default: bad rows are skipped, counted and reported).
    """

    paths: Sequence[str] | str
    schema: Any
    policy: Any = None
    options: dict = field(default_factory=dict)

    @property
    def n_slots(self) -> int:
        return self.schema.n_slots

    @property
    def n_dense(self) -> int:
        return self.schema.n_dense

    def reader(self, batch_size: int, reader_index: int = 0, num_readers: int = 1) -> DataReader:
        from hpsray.data import LENIENT, DataReader

        return DataReader(
            self.paths,
            self.schema,
            reader_index=reader_index,
            num_readers=num_readers,
            batch_size=batch_size,
            policy=self.policy or LENIENT,
            **self.options,
        )

    def open(self, batch_size: int, reader_index: int = 0, num_readers: int = 1) -> Iterator[Batch]:
        return iter(self.reader(batch_size, reader_index, num_readers))
