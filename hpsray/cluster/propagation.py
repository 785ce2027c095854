"""The contract of update propagation between trainers (Ray-free): :class:`Exchange`, which
the kinds in :mod:`hpsray.cluster.consistency` (relay, pull) and
:mod:`hpsray.cluster.push_stream` (push) implement."""

from __future__ import annotations

from collections.abc import Hashable

from hpsray.cluster.updates import Payload

__all__ = ["Exchange"]


class Exchange:
    """A trainer's side of update propagation; :func:`~hpsray.cluster.consistency.join_exchange`
    makes the kind.

    ``publish`` sends this trainer's version ``clock`` of ``channel`` on its way and returns at
    once. ``fetch`` returns the others' versions ``(rank, clock, payload)`` this trainer has not
    received yet, up to clock ``upto``, after waiting until it holds every other trainer's
    version ``oldest`` or newer; ``seen`` is the newest clock held per other rank (pull asks only
    the producers older than ``oldest``). ``received_bytes`` counts the payload bytes fetched.
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.received_bytes = 0
        self.wait_s = 0.0

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        raise NotImplementedError

    def fetch(
        self, channel: str, oldest: int, upto: int | None, seen: dict[int, int]
    ) -> list[tuple[int, int, Payload]]:
        raise NotImplementedError

    def fail(self, batch_id: Hashable) -> None:
        """Tell every other trainer that this one failed ``batch_id`` (their waits then raise
        :class:`~hpsray.errors.PeerFailedError`); returns once they can see it."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the exchange holds (a re-formed group makes a new one)."""
