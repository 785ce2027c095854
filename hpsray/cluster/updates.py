"""Relaxed-consistency updates without Ray: the payload a trainer publishes per clock, the
version book an exchange keeps, and what a trainer carries across batch ends (docs/architecture.md:
Consistency). The Ray side (mailboxes, the clock board, the exchanges) is
:mod:`hpsray.cluster.consistency`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Payload = tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]
"""One trainer's update of one clock: ``(keys uint64[n], grads float32[n, dim], dense float32[m])``;
the sparse pair is ``None`` on the ``"dense"`` channel, the dense part ``None`` when it has its own."""


def merge_payloads(parts: list[Payload]) -> Payload:
    """One update equal to applying ``parts`` together: sparse gradients summed per key (sorted
    keys), dense gradients summed in the order given."""
    keys: list[np.ndarray] = []
    grads: list[np.ndarray] = []
    dense: np.ndarray | None = None
    for k, g, d in parts:
        if k is not None and k.size:
            assert g is not None, "a payload with keys has their gradients"
            keys.append(k)
            grads.append(g)
        if d is not None:
            dense = d.copy() if dense is None else dense + d
    if not keys:
        first = parts[0]
        return first[0], first[1], dense
    g_all = np.concatenate(grads)
    uniq, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    summed = np.zeros((uniq.size, g_all.shape[1]), np.float32)
    np.add.at(summed, inverse, g_all)
    return uniq, summed, dense


def payload_bytes(payload: Payload) -> int:
    return sum(int(a.nbytes) for a in payload if a is not None)


def crosses_batches(sync: object) -> bool:
    """Whether a trainer's clock runs on across batch ends (``ssp``, ``asp``) instead of meeting
    a barrier there (``bsp``, ``absp``): the schedule then skips ``refresh`` and ends the pass
    with ``Trainer.settle``. ``sync``: the pipeline's sync settings (their ``consistency``) or ``None``."""
    return sync is not None and getattr(sync, "consistency", "bsp") in ("ssp", "asp")


class CarryOver:
    """A trainer's state across batch ends under :func:`crosses_batches`.

    ``log`` holds the others' sparse updates ``(clock, keys, grads)`` received since the end of
    the batch before last (``base``): a row borrowed anew was lent from its owner's value as of
    that batch's write-back, so :meth:`replay` applies them to it. ``held``: the keys resident
    at the last batch end; ``parts``: that batch's keys by owner (for ``settle``).
    """

    def __init__(self) -> None:
        self.log: list[tuple[int, np.ndarray, np.ndarray]] = []
        self.held = np.empty(0, np.uint64)
        self.base = 0  # clock of the end of the batch before last
        self.last = 0  # clock of the last batch end
        self.first = 1  # first clock of the batch in training
        self.parts: list[np.ndarray] = []
        self.max_across = 0  # largest staleness seen while another trainer was in an earlier batch
        self.max_return = 0  # largest staleness of a copy returned at a batch end

    def record(self, clock: int, keys: np.ndarray | None, grads: np.ndarray) -> None:
        if keys is not None and keys.size:
            self.log.append((clock, keys, grads))

    def replay(self, resident: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, grads)`` to apply at a batch start: the logged updates newer than ``base`` of
        the resident keys that were not held at the last batch end; then forgets what the next
        batch start will not need (clocks up to ``last``) and moves ``base`` to ``last``."""
        new = resident[~np.isin(resident, self.held)] if self.held.size else resident
        keys, grads = [], []
        if new.size:
            for clock, k, g in self.log:
                if clock > self.base:
                    m = np.isin(k, new)
                    if m.any():
                        keys.append(k[m])
                        grads.append(g[m])
        self.log = [u for u in self.log if u[0] > self.last]
        self.base = self.last
        if not keys:
            return np.empty(0, np.uint64), np.empty((0, 0), np.float32)
        return np.concatenate(keys), np.concatenate(grads)

    def batch_end(self, clock: int, resident: np.ndarray) -> None:
        self.last, self.held, self.first = clock, resident, clock + 1

    def settled(self, clock: int, resident: np.ndarray) -> None:
        """After a full barrier: every row is complete at its owner; nothing to replay."""
        self.log, self.base = [], clock
        self.batch_end(clock, resident)


class Versions:
    """Per channel and producer: the versions held (``[ref]`` each), the newest clock, and what
    each consumer took. The book of a :class:`~hpsray.cluster.consistency.Mailbox` or
    :class:`~hpsray.cluster.consistency.ClockBoard`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.clock: dict[tuple[str, int], int] = {}  # (channel, rank) -> newest clock
        self.updates: dict[tuple[str, int, int], list[Any]] = {}  # (channel, rank, clock) -> [ref]
        self.taken: dict[tuple[str, int, int], int] = {}  # (channel, consumer, producer) -> newest clock taken

    def put(self, channel: str, rank: int, clock: int, update: list[Any]) -> None:
        self.updates[(channel, rank, clock)] = update
        self.clock[(channel, rank)] = max(self.clock.get((channel, rank), 0), clock)

    def newest(self, channel: str, rank: int) -> int:
        return self.clock.get((channel, rank), 0)

    def take(self, channel: str, consumer: int, producer: int, upto: int | None) -> list[tuple[int, int, list[Any]]]:
        """``(producer, clock, [ref])`` of every version ``consumer`` has not taken, up to ``upto``."""
        last = self.newest(channel, producer) if upto is None else min(self.newest(channel, producer), upto)
        first = self.taken.get((channel, consumer, producer), 0) + 1
        out = [
            (producer, c, self.updates[(channel, producer, c)])
            for c in range(first, last + 1)
            if (channel, producer, c) in self.updates
        ]
        self.taken[(channel, consumer, producer)] = max(last, first - 1)
        return out

    def forget(self, consumers_of: Callable[[int], list[int]]) -> None:
        """Drop versions every consumer has taken (their objects can then be freed)."""
        for key in list(self.updates):
            channel, producer, c = key
            if all(self.taken.get((channel, q, producer), 0) >= c for q in consumers_of(producer)):
                del self.updates[key]
