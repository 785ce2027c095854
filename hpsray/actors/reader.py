"""``Reader``: streams one share of a source as Batches, with optional transforms."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import ray

from hpsray.data.batch import Batch
from hpsray.actors.timing import StageClock

Transform = Callable[[Batch], Batch]


class Reader:
    """Reader ``index`` of ``count`` on node ``node``; :meth:`read` returns the next batch.

    ``transforms`` (e.g. feature engineering) run here, on the reader's CPU, in order.
    """

    def __init__(self, source, batch_size: int, node: int = 0, index: int = 0, count: int = 1,
                 transforms: Sequence[Transform] = ()) -> None:
        self.node, self.index = node, index
        self.source = source
        # file sources expose their DataReader, whose report counts bad rows
        self._data_reader = source.reader(batch_size, index, count) if hasattr(source, "reader") else None
        self._it = iter(self._data_reader) if self._data_reader is not None else source.open(batch_size, index, count)
        self.transforms = list(transforms)
        self.clock = StageClock("read", node)
        self.examples = 0

    def __repr__(self) -> str:
        return f"Reader[node {self.node}, #{self.index}]"

    @ray.method(num_returns=3)
    def read(self, batch_id: int):
        """``(batch, unique keys, examples)`` of the next batch; ``(None, None, 0)`` at the end."""
        with self.clock.timed(batch_id):
            batch = next(self._it, None)
            if batch is None:
                return None, None, 0
            for transform in self.transforms:
                batch = transform(batch)
                if not isinstance(batch, Batch):
                    raise TypeError(f"transform {transform!r} returned {type(batch).__name__}, not a Batch")
            self.examples += len(batch)
            return batch, np.unique(batch.keys), len(batch)

    def bad_input(self) -> dict:
        """Bad-row counts of file sources (empty for generated data)."""
        return self._data_reader.report.to_dict() if self._data_reader is not None else {}

    def stats(self) -> dict:
        return {**self.clock.snapshot(), "examples": self.examples}
