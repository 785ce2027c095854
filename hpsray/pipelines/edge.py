"""A bounded edge between two stages: at most ``capacity`` batches between producer and consumer.

A batch *enters* the edge when the driver submits its producer task(s) and *leaves* once the
consumer task(s) that take it are done, so ``capacity`` bounds how far the producer may run
ahead of the consumer, and with it what waits in the object store (docs/architecture.md:
invariant 6). This is Ray Core's "limit pending tasks" pattern over ObjectRefs: before
submitting, the driver calls :meth:`BoundedEdge.wait_room`, which blocks in ``ray.wait`` on the
oldest batch's consumers while the edge is full (a *stall*). It is preferred to
``ray.util.queue.Queue``, which adds an actor hop per item and copies values
(docs/benchmarks.md, "Notes from the code").

Every wait here is bounded by the fault timeout (:mod:`hpsray.cluster.faults`): a consumer that
does not finish within ``fault_timeout_s`` of the last one raises
:class:`~hpsray.errors.FaultTimeout` naming the edge and who is missing, never a silent wait.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import ray

from hpsray.actors.livemetrics import LiveGauges
from hpsray.cluster import faults


@dataclass
class _Batch:
    producers: list
    consumers: list | None = None


@dataclass
class BoundedEdge:
    """FIFO of the batches between two stages, at most ``capacity`` (>= 1) of them.

    Per batch, in order: :meth:`wait_room`, submit the producer, :meth:`put` its refs; later,
    submit the consumer and :meth:`taken` its refs. ``max_depth`` is the most batches it held,
    ``stalls`` how often the producer had to wait for room, ``left`` how many batches left it
    (their consumers done without error).
    """

    name: str
    capacity: int
    max_depth: int = 0
    stalls: int = 0
    left: int = 0
    _batches: deque = field(default_factory=deque, repr=False)
    _gauges: LiveGauges = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"edge {self.name!r}: capacity must be >= 1, got {self.capacity}")
        self._gauges = LiveGauges(edge=self.name)

    def __len__(self) -> int:
        return len(self._batches)

    def _reap(self) -> None:
        """Let the oldest batches whose consumers are done leave (raising a consumer's error)."""
        while self._batches and self._batches[0].consumers is not None:
            refs = self._batches[0].consumers
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(done) < len(refs):
                return
            ray.get(refs)
            self._batches.popleft()
            self.left += 1

    def wait_room(self) -> None:
        """Block while the edge is full, until its oldest batch's consumers are done. Raises
        their error (the batch leaves here: dropping it unread would let the run go on without
        it), or ``RuntimeError`` when the oldest has no consumer yet (a schedule that would
        wait for itself)."""
        self._reap()
        stalled = False
        while len(self._batches) >= self.capacity:
            oldest = self._batches[0]
            if oldest.consumers is None:
                raise RuntimeError(f"edge {self.name!r} is full and its oldest batch has no consumer yet")
            stalled = True
            wait_all(oldest.consumers, f"the consumers of the oldest batch on edge {self.name!r}")
            self._reap()
        self.stalls += stalled

    def put(self, refs: list) -> None:
        """A new batch, from the producer's ``refs`` (after :meth:`wait_room`, which this repeats)."""
        self.wait_room()
        self._batches.append(_Batch(list(refs)))
        self.max_depth = max(self.max_depth, len(self._batches))
        self._gauges.set(queue_depth=len(self._batches))

    def taken(self, refs: list) -> None:
        """The consumer ``refs`` of the oldest batch that has none yet: it leaves once they are done."""
        for batch in self._batches:
            if batch.consumers is None:
                batch.consumers = list(refs)
                return
        raise RuntimeError(f"edge {self.name!r}: no batch waits for a consumer")

    def in_flight(self) -> list:
        """The consumer refs of the batches still held, oldest first."""
        return [ref for b in self._batches if b.consumers is not None for ref in b.consumers]

    def drain(self) -> list:
        """Wait until every batch given a consumer is done (raises their errors) and return the
        consumers' values; batches still waiting for a consumer stay."""
        held = [b for b in self._batches if b.consumers is not None]
        refs = [ref for b in held for ref in (b.consumers or [])]
        wait_all(refs, f"the consumers of the batches on edge {self.name!r}")
        values = ray.get(refs)
        self._batches = deque(b for b in self._batches if b.consumers is None)
        self.left += len(held)
        return values


def wait_all(refs: list, waited_for: str = "Ray calls", timeout_s: float | None = None) -> None:
    """Wait until every ref is done, raising the first failure as soon as it is known: a dead
    consumer's error must not wait behind another consumer that may wait for it forever (a
    trainer under SSP waiting for a dead peer's updates). When none finishes for ``timeout_s``
    (``None``: the fault timeout), :class:`~hpsray.errors.FaultTimeout` names ``waited_for``
    and who is missing."""
    faults.wait_all(refs, waited_for, timeout_s)
