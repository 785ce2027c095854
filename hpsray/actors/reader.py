"""``Reader``: streams one share of a source as Batches, with optional transforms."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import ray

from hpsray.actors.messages import ReadBatch
from hpsray.actors.timing import StageClock
from hpsray.data.batch import Batch
from hpsray.kernels.distinct import distinct_sorted
from hpsray.tiers.partition import owner_of

if TYPE_CHECKING:
    from hpsray.reference import ShardedSource
    from hpsray.training.layout import BatchIndex

Transform = Callable[[Batch], Batch]


class Reader:
    """Reader ``index`` of ``count`` on node ``node``; :meth:`read` returns the next batch.

    ``transforms`` (e.g. feature engineering) run here, on the reader's CPU, in order. With
    ``n_nodes`` > 1 the batch's distinct keys come split by owner node (docs/architecture.md: Keys and
    partitioning), so each
    owner's MEM-PS gets exactly the keys it serves. With ``minibatch_size`` a training batch
    also comes with its layout over those keys' positions (``ReadBatch.layout``): the trainer's
    index, made here, off the train stage's time. :meth:`open` starts another pass (the next
    epoch, an evaluation) in the same actor: a new actor costs seconds of process start.
    """

    def __init__(
        self,
        source: ShardedSource,
        batch_size: int,
        node: int = 0,
        index: int = 0,
        count: int = 1,
        transforms: Sequence[Transform] = (),
        n_nodes: int = 1,
        skip: int = 0,
        minibatch_size: int | None = None,
    ) -> None:
        self.node, self.n_nodes, self.minibatch_size = node, n_nodes, minibatch_size
        self.transforms = list(transforms)
        self.clock = StageClock("read", node)
        self.open(source, batch_size, index, count, skip)
        self._warm_up(source, index, count)

    def open(self, source: ShardedSource, batch_size: int, index: int = 0, count: int = 1, skip: int = 0) -> None:
        """Read ``source`` from now on (share ``index`` of ``count``), counting examples and
        bad rows afresh; busy times stay per batch id. ``skip``: batches of the share already
        trained (a resume): they are read and dropped, before any transform runs."""
        self.source, self.index = source, index
        # file sources expose their DataReader, whose report counts bad rows
        self._data_reader = source.reader(batch_size, index, count) if hasattr(source, "reader") else None
        self._it = iter(self._data_reader) if self._data_reader is not None else source.open(batch_size, index, count)
        for _ in range(skip):
            if next(self._it, None) is None:
                break
        self.examples = 0

    def __repr__(self) -> str:
        return f"Reader[node {self.node}, #{self.index}]"

    def _warm_up(self, source: ShardedSource, index: int, count: int) -> None:
        """Read the first few rows of the share through a separate pass and drop them, so the
        format's numba decoders (and the layout's index kernel, where this reader makes it)
        compile before the pipeline's clock starts. Transforms do not
        run; an error here is left for the real pass to raise in its place and order."""
        data_log = logging.getLogger("hpsray.data")  # its bad rows: the real pass reports them, once
        was, data_log.disabled = data_log.disabled, True
        try:
            it = source.reader(64, index, count) if hasattr(source, "reader") else source.open(64, index, count)
            batch = next(iter(it), None)
            if batch is not None:
                keys = distinct_sorted(batch.keys)
                owner_of(keys, max(self.n_nodes, 1))
                if self.minibatch_size is not None:  # this reader makes the layout: its index kernel too
                    self._layout(batch)
        except Exception:  # noqa: BLE001,S110 - the real read reports it, as it always did
            pass
        finally:
            data_log.disabled = was

    def _layout(self, batch: Batch) -> tuple[list[np.ndarray], BatchIndex]:
        """The batch's distinct keys per owner and its layout over their positions."""
        # imported here: a reader that makes no layout never loads torch (seconds of import)
        from hpsray.training.layout import index_positions, positions_of

        assert self.minibatch_size is not None
        parts, positions = positions_of(batch.keys, max(self.n_nodes, 1))
        return parts, index_positions(batch, self.minibatch_size, positions, sum(map(len, parts)))

    def read(self, batch_id: int | None) -> ReadBatch:
        """The next batch of the share (``batch_id`` tags its busy time; ``None``: not a
        training batch), its keys distinct, sorted and split by owner node; at the end of the
        share a :class:`ReadBatch` of 0 examples. The batch and the keys go to the object store
        here, so each consumer fetches only its part."""
        with self.clock.timed(batch_id):
            batch = next(self._it, None)
            if batch is None:
                return ReadBatch(0, ray.put(None), [ray.put(np.empty(0, np.uint64))] * self.n_nodes)
            for transform in self.transforms:
                batch = transform(batch)
                if not isinstance(batch, Batch):
                    raise TypeError(f"transform {transform!r} returned {type(batch).__name__}, not a Batch")
            self.examples += len(batch)
            layout = None
            if self.minibatch_size is not None and batch_id is not None:  # the trainer's index but its slots
                parts, index = self._layout(batch)
                layout = ray.put(index)
            else:
                keys = distinct_sorted(batch.keys)
                if self.n_nodes == 1:
                    parts = [keys]
                else:
                    owners = owner_of(keys, self.n_nodes)
                    parts = [keys[owners == o] for o in range(self.n_nodes)]
            return ReadBatch(len(batch), ray.put(batch), [ray.put(p) for p in parts], layout)

    def bad_input(self) -> dict:
        """Bad-row counts of file sources (empty for generated data)."""
        return self._data_reader.report.to_dict() if self._data_reader is not None else {}

    def stats(self) -> dict:
        return {**self.clock.snapshot(), "examples": self.examples}
