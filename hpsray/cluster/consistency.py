"""SSP and ASP between trainers: a clock board through which mini-batch updates propagate.

docs/architecture.md: Consistency, after Lapser. Under ``bsp`` the trainers combine updates in the collective group
after every mini-batch (:mod:`hpsray.cluster.collective`). Under ``ssp(s)`` and ``asp`` each
trainer instead *publishes* its update of mini-batch ``c`` (keys, sparse gradients, flat dense
gradient; one object in the object store) under its clock ``c``, and before computing mini-batch
``c`` it *fetches* every update the others have published since its last fetch:

- ``ssp``: the fetch names the oldest clock it accepts, ``c - 1 - s``, and waits until every
  other trainer has published at least that one, so a trainer never runs more than ``s``
  mini-batches ahead of the slowest (Lapser's per-get slack);
- ``asp``: the fetch never waits.

Fetched updates are applied to the rows the trainer holds and summed into its next dense step.
Batch ends are barriers in both modes (every update of the batch is applied before its rows go
back to their owners), so staleness is bounded within a batch. The trainer records the
staleness it observed: ``c - 1`` minus the oldest latest clock it has from any other trainer.
"""

from __future__ import annotations

import asyncio


class ClockBoard:
    """Async Ray actor: the latest clock of each trainer and the updates not yet fetched by all."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.clock = [0] * world  # latest clock published per rank (clocks count from 1)
        self.updates: dict = {}  # (rank, clock) -> [ObjectRef of the update]
        self.fetched = [[0] * world for _ in range(world)]  # fetched[q][r]: newest clock of r that q took
        self._changed = asyncio.Condition()

    def __repr__(self) -> str:
        return f"ClockBoard[{self.world} trainers]"

    async def publish(self, rank: int, clock: int, update: list) -> None:
        """Record ``rank``'s update of mini-batch ``clock`` (``[ref]``: the ref itself, unresolved)."""
        async with self._changed:
            self.updates[(rank, clock)] = update
            self.clock[rank] = max(self.clock[rank], clock)
            self._changed.notify_all()

    async def fetch(self, rank: int, oldest: int) -> list:
        """Once every other trainer has published clock ``oldest`` or later, every update of
        theirs that ``rank`` has not fetched yet, as ``(rank, clock, [ref])`` oldest first."""
        others = [r for r in range(self.world) if r != rank]
        async with self._changed:
            await self._changed.wait_for(lambda: all(self.clock[r] >= oldest for r in others))
            out = []
            for r in others:
                for c in range(self.fetched[rank][r] + 1, self.clock[r] + 1):
                    if (r, c) in self.updates:
                        out.append((r, c, self.updates[(r, c)]))
                self.fetched[rank][r] = self.clock[r]
            self._forget()
            return sorted(out, key=lambda u: (u[1], u[0]))

    def _forget(self) -> None:
        """Drop updates every other trainer has fetched (their objects can then be freed)."""
        done = [min(self.fetched[q][r] for q in range(self.world) if q != r) for r in range(self.world)]
        for key in [k for k in self.updates if k[1] <= done[k[0]]]:
            del self.updates[key]
