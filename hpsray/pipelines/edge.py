"""A bounded edge between two stages: the ObjectRefs of at most ``capacity`` in-flight items.

This is Ray Core's "limit pending tasks" pattern: the producer keeps the refs of the items it
has submitted and, once the edge holds ``capacity`` of them, blocks in ``ray.wait`` until the
oldest is done. A slow consumer therefore stalls its producer instead of letting results pile
up in the object store (docs/architecture.md: invariant 6). It is preferred to
``ray.util.queue.Queue``, which adds an actor hop per item and copies values (docs/benchmarks.md,
"Notes from the code").
"""

from __future__ import annotations

from collections import deque

import ray

from hpsray.actors.livemetrics import LiveGauges


class BoundedEdge:
    """FIFO of in-flight ObjectRefs holding at most ``capacity`` (>= 1) of them."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"edge {name!r}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._refs: deque = deque()
        self.max_depth = 0
        self.stalls = 0  # how often the producer had to wait
        self._gauges = LiveGauges(edge=name)

    def __len__(self) -> int:
        return len(self._refs)

    def put(self, ref: ray.ObjectRef) -> None:
        """Add an item; first wait while the edge is full. Raises the error of an item that failed
        (it leaves the edge here: dropping it unread would let the run go on without it)."""
        while len(self._refs) >= self.capacity:
            self.stalls += 1
            ray.wait([self._refs[0]], num_returns=1)
            ray.get(self._refs.popleft())
        self._refs.append(ref)
        self.max_depth = max(self.max_depth, len(self._refs))
        self._gauges.set(queue_depth=len(self._refs))

    def in_flight(self) -> list:
        """The refs still held, oldest first."""
        return list(self._refs)

    def drain(self) -> list:
        """Wait for every item still in flight and return their values (raises their errors)."""
        values = ray.get(list(self._refs))
        self._refs.clear()
        return values
