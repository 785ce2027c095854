"""SSP, A-BSP and ASP between trainers, the Ray side: how a trainer's update of each clock reaches
the others (docs/architecture.md: One batch across nodes, and Consistency).

A trainer's :class:`Exchange` (:func:`join_exchange` makes the kind) ``publish``\\ es its update
of clock ``c`` on a channel (``"all"``, or ``"dense"`` when the dense item has its own slack) and
``fetch``\\ es the others' versions once every other trainer has published the clock its slack
needs. ``"push"`` sends each version to every consumer over a TCP stream of its own
(:mod:`hpsray.cluster.push_stream`; the :class:`Mailbox`, an async actor on the trainer's node,
only hands out the stream's address and stands for the trainer's liveness), ``"pull"`` leaves
it in the producer's mailbox until a consumer's copy is too old, ``"relay"`` sends everything
through one :class:`ClockBoard`. ``fail`` makes every wait of the others raise
:class:`~hpsray.errors.PeerFailedError`. The payloads and what a trainer carries across batch
ends are Ray-free, in :mod:`hpsray.cluster.updates`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from typing import Any

import ray

from hpsray.cluster.propagation import Exchange
from hpsray.cluster.push_stream import Listener, StreamPushExchange
from hpsray.cluster.runtime import on_node
from hpsray.cluster.updates import Payload, Versions, merge_payloads, payload_bytes
from hpsray.config import PROPAGATIONS
from hpsray.errors import PeerFailedError

Actor = Any
"""A Ray actor handle. Not ``ray.actor.ActorHandle``: its ``__getattr__`` returns ``Never``, so mypy
would take every line after ``handle.method.remote(...)`` as unreachable and check none of it."""

Version = tuple[int, int, list[Any]]
"""``(producer rank, clock, [ref])``: one version as a mailbox or the board hands it out."""


class ClockBoard:
    """Async Ray actor: the latest clock of each trainer and the updates not yet fetched by all
    (``propagation = "relay"``; under push and pull the trainers do not call it)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.versions = Versions(world)
        self._changed = asyncio.Condition()
        self.failed: tuple[int, Hashable] | None = None  # (rank, batch id) of a trainer that failed a batch

    def __repr__(self) -> str:
        return f"ClockBoard[{self.world} trainers]"

    async def fail(self, rank: int, batch_id: Hashable) -> None:
        """``rank`` failed ``batch_id``: every wait here raises :class:`PeerFailedError` from now."""
        async with self._changed:
            self.failed = (rank, batch_id)
            self._changed.notify_all()

    async def publish(self, rank: int, clock: int, update: list[ray.ObjectRef], channel: str = "all") -> None:
        """Record ``rank``'s update of mini-batch ``clock`` (``[ref]``: the ref itself, unresolved)."""
        async with self._changed:
            self.versions.put(channel, rank, clock, update)
            self._changed.notify_all()

    async def fetch(self, rank: int, oldest: int, channel: str = "all", upto: int | None = None) -> list[Version]:
        """Once every other trainer has published clock ``oldest`` or later on ``channel``, every
        update of theirs that ``rank`` has not fetched yet (up to clock ``upto``), as
        ``(rank, clock, [ref])`` oldest first."""
        v = self.versions
        others = [r for r in range(self.world) if r != rank]
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.failed is not None or all(v.newest(channel, r) >= oldest for r in others)
            )
            _raise_failed(self.failed)
            out = [u for r in others for u in v.take(channel, rank, r, upto)]
            v.forget(lambda r: [q for q in range(self.world) if q != r])
            return sorted(out, key=lambda u: (u[1], u[0]))


def _raise_failed(failed: tuple[int, Hashable] | None) -> None:
    if failed is not None:
        raise PeerFailedError(failed[1])


class Mailbox:
    """Async Ray actor on a trainer's node (push and pull propagation).

    Push: it holds the address of the trainer's stream listener
    (:mod:`hpsray.cluster.push_stream`) and stands for the trainer's liveness. Pull: the owner
    ``put``\\ s its own versions here and the others call ``since``, which waits for the version
    a consumer needs and returns the versions it has not taken, summed into one object.
    """

    def __init__(self, world: int, rank: int, address: tuple[str, int] | None = None, key: bytes | None = None) -> None:
        self.world, self.rank, self._address, self._key = world, rank, address, key
        self.versions = Versions(world)
        self._changed = asyncio.Condition()
        self.failed: tuple[int, Hashable] | None = None  # (rank, batch id) of a trainer that failed a batch

    def __repr__(self) -> str:
        return f"Mailbox[rank {self.rank}]"

    def ready(self) -> int:
        return self.rank

    def address(self) -> tuple[str, int] | None:
        return self._address

    def stream(self) -> tuple[tuple[str, int] | None, bytes | None]:
        """The push listener's address and key (handed out through Ray only)."""
        return self._address, self._key

    async def fail(self, rank: int, batch_id: Hashable) -> None:
        """``rank`` failed ``batch_id``: every wait here raises :class:`PeerFailedError` from now."""
        async with self._changed:
            self.failed = (rank, batch_id)
            self._changed.notify_all()

    async def put(self, channel: str, rank: int, clock: int, update: list[ray.ObjectRef]) -> None:
        async with self._changed:
            self.versions.put(channel, rank, clock, update)
            self._changed.notify_all()

    async def since(
        self, channel: str, consumer: int, oldest: int, upto: int | None
    ) -> tuple[int, list[ray.ObjectRef] | None, int]:
        """Pull: once the owner has published version ``oldest``, the versions ``consumer`` has
        not taken (up to ``upto``) summed into one object: ``(newest clock, [ref] or None, bytes)``."""
        v = self.versions
        async with self._changed:
            await self._changed.wait_for(lambda: self.failed is not None or v.newest(channel, self.rank) >= oldest)
            _raise_failed(self.failed)
            got = v.take(channel, consumer, self.rank, upto)
            newest = v.taken[(channel, consumer, self.rank)]
            v.forget(lambda r: [q for q in range(self.world) if q != r])
        if not got:
            return newest, None, 0
        if len(got) == 1:
            ref = got[0][2][0]
            return newest, [ref], payload_bytes(await ref)
        merged = merge_payloads(list(await asyncio.gather(*[u[2][0] for u in got])))
        return newest, [ray.put(merged)], payload_bytes(merged)


class _StoreExchange(Exchange):
    """An exchange whose versions travel as object-store references (relay, pull)."""

    def _resolve(self, got: list[Version]) -> list[tuple[int, int, Payload]]:
        values = ray.get([ref for _, _, (ref,) in got]) if got else []
        self.received_bytes += sum(payload_bytes(p) for p in values)
        return [(r, c, p) for (r, c, _), p in zip(got, values, strict=True)]


class RelayExchange(_StoreExchange):
    """Every update through the one :class:`ClockBoard`."""

    def __init__(self, rank: int, world: int, board: Actor) -> None:
        super().__init__(rank, world)
        self.board = board

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        self.board.publish.remote(self.rank, clock, [ray.put(payload)], channel)

    def fail(self, batch_id: Hashable) -> None:
        ray.get(self.board.fail.remote(self.rank, batch_id))

    def fetch(
        self, channel: str, oldest: int, upto: int | None, seen: dict[int, int]
    ) -> list[tuple[int, int, Payload]]:
        t0 = time.perf_counter()
        got = ray.get(self.board.fetch.remote(self.rank, oldest, channel, upto))
        self.wait_s += time.perf_counter() - t0
        return self._resolve(got)


class PullExchange(_StoreExchange):
    """Versions stay with their producer until a consumer's copy is too old."""

    def __init__(self, rank: int, world: int, mailboxes: list[Actor]) -> None:
        super().__init__(rank, world)
        self.mailboxes = mailboxes

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        self.mailboxes[self.rank].put.remote(channel, self.rank, clock, [ray.put(payload)])

    def fetch(
        self, channel: str, oldest: int, upto: int | None, seen: dict[int, int]
    ) -> list[tuple[int, int, Payload]]:
        stale = [r for r in range(self.world) if r != self.rank and seen.get(r, 0) < max(oldest, 0)]
        if not stale:
            return []
        t0 = time.perf_counter()
        answers = ray.get([self.mailboxes[r].since.remote(channel, self.rank, oldest, upto) for r in stale])
        self.wait_s += time.perf_counter() - t0
        got = [(r, newest, ref) for r, (newest, ref, _) in zip(stale, answers, strict=True) if ref is not None]
        return self._resolve(got)

    def fail(self, batch_id: Hashable) -> None:
        ray.get([box.fail.remote(self.rank, batch_id) for box in self.mailboxes])


def start_mailbox(
    group: str, world: int, rank: int, address: tuple[str, int] | None = None, key: bytes | None = None
) -> Actor:
    """This trainer's mailbox, on this process's node (called from the trainer's ``join``);
    ``address`` and ``key``: its push stream listener's."""
    node_id = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(Mailbox)
        .options(
            name=f"{group}:Mailbox[{rank}]",
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=on_node(node_id),
        )
        .remote(world, rank, address, key)
    )


def find_mailboxes(group: str, world: int, timeout_s: float = 120.0) -> list[Actor]:
    """Every trainer's mailbox by name (each trainer starts its own in ``join``)."""
    deadline = time.monotonic() + timeout_s
    boxes = []
    for r in range(world):
        while True:
            try:
                box = ray.get_actor(f"{group}:Mailbox[{r}]")
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer {r}'s mailbox did not appear within {timeout_s:.0f} s") from None
                time.sleep(0.05)
        boxes.append(box)
    ray.get([b.ready.remote() for b in boxes])
    return boxes


def join_exchange(propagation: str, group: str, world: int, rank: int, board: Actor | None) -> tuple[Exchange, Actor]:
    """This trainer's exchange of ``propagation`` and its mailbox (``None`` under relay); every
    trainer of the group calls this at once (push connects the trainers' streams)."""
    if propagation == "relay":
        return make_exchange(propagation, rank, world, board), None
    if propagation != "push":
        mailbox = start_mailbox(group, world, rank)
        return make_exchange(propagation, rank, world, board, find_mailboxes(group, world)), mailbox
    listener = Listener()
    mailbox = start_mailbox(group, world, rank, listener.address, listener.key)
    boxes = find_mailboxes(group, world)
    streams = ray.get([b.stream.remote() for b in boxes])
    addresses, keys = [a for a, _ in streams], [k for _, k in streams]
    return StreamPushExchange(rank, world, listener, addresses, boxes, keys=keys), mailbox


def make_exchange(
    propagation: str,
    rank: int,
    world: int,
    board: Actor | None = None,
    mailboxes: list[Actor] | None = None,
) -> Exchange:
    """The exchange of ``propagation`` (``"relay"``, needing the ``board``, or ``"pull"``, needing
    every trainer's ``mailboxes`` in rank order); push connects streams: :func:`join_exchange`."""
    if propagation == "relay":
        if board is None:
            raise ValueError("propagation 'relay' needs the ClockBoard")
        return RelayExchange(rank, world, board)
    if propagation not in PROPAGATIONS:
        raise ValueError(f"propagation must be one of {PROPAGATIONS}, got {propagation!r}")
    if propagation == "push":
        raise ValueError("propagation 'push' connects the trainers' streams: use join_exchange")
    if mailboxes is None:
        raise ValueError(f"propagation {propagation!r} needs every trainer's mailbox")
    return PullExchange(rank, world, mailboxes)
