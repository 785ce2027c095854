"""SSP, A-BSP and ASP between trainers: how mini-batch updates propagate (docs/architecture.md:
Consistency, after Lapser).

Under ``bsp`` the trainers combine updates in the collective group after every mini-batch
(:mod:`hpsray.cluster.collective`). Under the relaxed modes each trainer instead *publishes* its
update of mini-batch ``c`` (keys, sparse gradients, flat dense gradient; one object in the object
store) under its clock ``c``, and before computing a mini-batch it *fetches* the updates of the
others it needs. Lapser's ``get(item, clock, slack)`` is the one rule: a trainer computing
mini-batch ``c`` of an item with slack ``s`` must hold every other trainer's updates of it up to
``c - 1 - s``, and waits otherwise:

- ``ssp(s)``: slack ``s`` mini-batches;
- ``absp(k)`` (A-BSP, "arbitrarily-sized BSP": more work per clock, fewer barriers): a clock is
  ``k`` mini-batches; a trainer publishes the sum of its ``k`` updates at the clock's end and
  waits for everyone's at the next clock's start, so it runs at most ``k - 1`` mini-batches on
  its own updates alone;
- ``asp``: slack without bound, never waits.

**Per-item slack.** Updates travel on two *channels*: ``"all"`` (the sparse update, with the
dense gradient unless it has its own slack) and ``"dense"``. ``SyncStage(dense_staleness=d)``
gives the dense parameters their own slack: with ``d = 0`` a trainer's dense step of clock ``c``
waits for every trainer's dense gradient of clock ``c`` and sums them in rank order, so the
dense weights are bit-identical on every node at every clock (BSP for the dense item) while the
embeddings stay ``ssp(s)``.

**Propagation** (``SyncStage(propagation=...)``), three interchangeable :class:`Exchange`\\ s:

- ``"push"`` (the default, Lapser's eager variant): the producer sends every new version to
  each consumer's :class:`Mailbox` (an async actor on the consumer's node) at once; a fetch is a
  call to the consumer's own mailbox.
- ``"pull"`` (Lapser's lazy variant): the producer leaves each version in its own mailbox; a
  consumer asks a producer's mailbox only when its copy of that producer is too old for the
  slack (and at the batch-end barrier). The producer's mailbox sums the versions a consumer takes
  at once (sparse rows by key, dense by element) into one object, so a lazy consumer moves fewer
  bytes: applying a summed update equals applying its parts in one call, which is what a consumer
  does with the parts anyway (the tables sum duplicate keys into one optimizer step).
- ``"relay"``: every update passes through one :class:`ClockBoard` actor (the first design;
  kept as the baseline of ``hpsray bench consistency``).

Push and pull exchange directly between the trainers' nodes: object refs travel trainer → mailbox
→ trainer and the payload moves node to node in the object store; the pipeline's
``ClockBoard`` then only stands by (no update passes through it).

**Across batch ends** (:func:`crosses_batches`: ``ssp`` and ``asp``; A-BSP and BSP keep a
barrier at every batch end) a trainer's clock runs on: at a batch end it waits only as the
bound requires for the next clock (every other trainer's ``c - s``, ``c`` its last clock), returns
its rows stamped with that clock and the oldest clock it holds of the others
(:class:`~hpsray.tiers.lending.Returned`), and goes on; updates that arrive later reach the rows
it still holds. :class:`CarryOver` keeps the others' updates of the batch before, which it
replays on the rows a new batch borrows (lent before that batch's write-back, so without
them). The owner keeps the freshest copy of each row (:meth:`~hpsray.tiers.lending.Lender.take_back`),
so the rows it ends a batch with lack at most ``s`` mini-batches of any trainer's updates; the
updates no returned copy holds are not applied at the owner later (they are bounded by the same
``s``, and counted as the owner's staleness). The last batch of a pass ends with a full barrier
(``Trainer.settle``), so export and evaluation see every update.

The trainer records the staleness it observed: ``c - 1`` minus the oldest latest clock it has
from any other trainer; across batches, the same while another trainer is still in an earlier
batch. A trainer that fails a batch under ``ssp``/``asp`` says so through the exchange
(:meth:`Exchange.fail`) instead of the collective, and every wait for its versions raises
:class:`~hpsray.errors.PeerFailedError`.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from hpsray.config import PROPAGATIONS
from hpsray.errors import PeerFailedError

Payload = tuple  # (keys uint64[n], grads float32[n, dim], dense float32[m] | None)


def merge_payloads(parts: list[Payload]) -> Payload:
    """One update equal to applying ``parts`` together: sparse gradients summed per key (sorted
    keys), dense gradients summed in the order given."""
    keys = [p[0] for p in parts if p[0] is not None and p[0].size]
    dense = None
    for p in parts:
        if p[2] is not None:
            dense = p[2].copy() if dense is None else dense + p[2]
    if not keys:
        first = parts[0]
        return first[0], first[1], dense
    k = np.concatenate(keys)
    g = np.concatenate([p[1] for p in parts if p[0] is not None and p[0].size])
    uniq, inverse = np.unique(k, return_inverse=True)
    summed = np.zeros((uniq.size, g.shape[1]), np.float32)
    np.add.at(summed, inverse, g)
    return uniq, summed, dense


def payload_bytes(payload: Payload) -> int:
    return sum(int(a.nbytes) for a in payload if a is not None)


def crosses_batches(sync) -> bool:
    """Whether a trainer's clock runs on across batch ends (``ssp``, ``asp``) instead of meeting
    a barrier there (``bsp``, ``absp``): the schedule then skips ``refresh`` and ends the pass
    with ``Trainer.settle``."""
    return sync is not None and getattr(sync, "consistency", "bsp") in ("ssp", "asp")


class CarryOver:
    """A trainer's state across batch ends under :func:`crosses_batches` (engine side, no Ray).

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

    def record(self, clock: int, keys: np.ndarray, grads: np.ndarray) -> None:
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


class _Versions:
    """Per channel and producer: the versions held, the newest clock, what each consumer took."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.clock: dict = {}  # (channel, rank) -> newest clock
        self.updates: dict = {}  # (channel, rank, clock) -> [ObjectRef]
        self.taken: dict = {}  # (channel, consumer, producer) -> newest clock taken

    def put(self, channel: str, rank: int, clock: int, update: list) -> None:
        self.updates[(channel, rank, clock)] = update
        self.clock[(channel, rank)] = max(self.clock.get((channel, rank), 0), clock)

    def newest(self, channel: str, rank: int) -> int:
        return self.clock.get((channel, rank), 0)

    def take(self, channel: str, consumer: int, producer: int, upto: int | None) -> list:
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

    def forget(self, consumers_of) -> None:
        """Drop versions every consumer has taken (their objects can then be freed)."""
        for key in list(self.updates):
            channel, producer, c = key
            if all(self.taken.get((channel, q, producer), 0) >= c for q in consumers_of(producer)):
                del self.updates[key]


class ClockBoard:
    """Async Ray actor: the latest clock of each trainer and the updates not yet fetched by all
    (``propagation = "relay"``; under push and pull the trainers do not call it)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.versions = _Versions(world)
        self._changed = asyncio.Condition()
        self.failed: tuple | None = None  # (rank, batch id) of a trainer that failed a batch

    def __repr__(self) -> str:
        return f"ClockBoard[{self.world} trainers]"

    async def fail(self, rank: int, batch_id) -> None:
        """``rank`` failed ``batch_id``: every wait here raises :class:`PeerFailedError` from now."""
        async with self._changed:
            self.failed = (rank, batch_id)
            self._changed.notify_all()

    async def publish(self, rank: int, clock: int, update: list, channel: str = "all") -> None:
        """Record ``rank``'s update of mini-batch ``clock`` (``[ref]``: the ref itself, unresolved)."""
        async with self._changed:
            self.versions.put(channel, rank, clock, update)
            self._changed.notify_all()

    async def fetch(self, rank: int, oldest: int, channel: str = "all", upto: int | None = None) -> list:
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


def _raise_failed(failed: tuple | None) -> None:
    if failed is not None:
        raise PeerFailedError(failed[1])


class Mailbox:
    """Async Ray actor on a trainer's node (push and pull propagation).

    Push: the other trainers ``put`` their versions here and the owner ``take``\\ s them. Pull:
    the owner ``put``\\ s its own versions here and the others call ``since``, which waits for the
    version a consumer needs and returns the versions it has not taken, summed into one object.
    """

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.versions = _Versions(world)
        self._changed = asyncio.Condition()
        self.failed: tuple | None = None  # (rank, batch id) of a trainer that failed a batch

    def __repr__(self) -> str:
        return f"Mailbox[rank {self.rank}]"

    def ready(self) -> int:
        return self.rank

    async def fail(self, rank: int, batch_id) -> None:
        """``rank`` failed ``batch_id``: every wait here raises :class:`PeerFailedError` from now."""
        async with self._changed:
            self.failed = (rank, batch_id)
            self._changed.notify_all()

    async def put(self, channel: str, rank: int, clock: int, update: list) -> None:
        async with self._changed:
            self.versions.put(channel, rank, clock, update)
            self._changed.notify_all()

    async def take(self, channel: str, oldest: int, upto: int | None) -> list:
        """Push: once every other trainer's version ``oldest`` has arrived, all versions not
        taken yet (up to ``upto``), ``(rank, clock, [ref])`` oldest first."""
        v = self.versions
        others = [r for r in range(self.world) if r != self.rank]
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.failed is not None or all(v.newest(channel, r) >= oldest for r in others)
            )
            _raise_failed(self.failed)
            out = [u for r in others for u in v.take(channel, self.rank, r, upto)]
            v.forget(lambda r: [self.rank])
            return sorted(out, key=lambda u: (u[1], u[0]))

    async def since(self, channel: str, consumer: int, oldest: int, upto: int | None) -> tuple:
        """Pull: once the owner has published version ``oldest``, the versions ``consumer`` has
        not taken (up to ``upto``) summed into one object: ``(newest clock, [ref] or None, bytes)``."""
        import ray

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


class Exchange:
    """A trainer's side of update propagation; :func:`make_exchange` picks the kind.

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

    def fetch(self, channel: str, oldest: int, upto: int | None, seen: dict) -> list:
        raise NotImplementedError

    def fail(self, batch_id) -> None:
        """Tell every other trainer that this one failed ``batch_id`` (their waits then raise
        :class:`PeerFailedError`); returns once they can see it."""
        raise NotImplementedError

    def _resolve(self, got: list) -> list:
        import ray

        values = ray.get([ref for _, _, (ref,) in got]) if got else []
        self.received_bytes += sum(payload_bytes(p) for p in values)
        return [(r, c, p) for (r, c, _), p in zip(got, values, strict=True)]


class RelayExchange(Exchange):
    """Every update through the one :class:`ClockBoard`."""

    def __init__(self, rank: int, world: int, board) -> None:
        super().__init__(rank, world)
        self.board = board

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        import ray

        self.board.publish.remote(self.rank, clock, [ray.put(payload)], channel)

    def fail(self, batch_id) -> None:
        import ray

        ray.get(self.board.fail.remote(self.rank, batch_id))

    def fetch(self, channel: str, oldest: int, upto: int | None, seen: dict) -> list:
        import ray

        t0 = time.perf_counter()
        got = ray.get(self.board.fetch.remote(self.rank, oldest, channel, upto))
        self.wait_s += time.perf_counter() - t0
        return self._resolve(got)


class PushExchange(Exchange):
    """Every version to every other trainer's mailbox at once."""

    def __init__(self, rank: int, world: int, mailboxes: list) -> None:
        super().__init__(rank, world)
        self.mailboxes = mailboxes

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        import ray

        ref = ray.put(payload)
        for q, box in enumerate(self.mailboxes):
            if q != self.rank:
                box.put.remote(channel, self.rank, clock, [ref])

    def fetch(self, channel: str, oldest: int, upto: int | None, seen: dict) -> list:

        t0 = time.perf_counter()
        got = self._watching(self.mailboxes[self.rank].take.remote(channel, oldest, upto), oldest)
        self.wait_s += time.perf_counter() - t0
        return self._resolve(got)

    def _watching(self, ref, clock: int, every_s: float = 2.0):
        """``ray.get(ref)``, checking every ``every_s`` while it waits that the other trainers'
        mailboxes are alive: a mailbox dies with its trainer, and a dead trainer's versions never
        come (:class:`PeerFailedError`, so the driver restarts the group instead of waiting)."""
        import ray

        while not ray.wait([ref], timeout=every_s)[0]:
            others = [box for q, box in enumerate(self.mailboxes) if q != self.rank]
            probes = [box.__ray_ready__.remote() for box in others]
            for probe in probes:
                try:
                    ray.get(probe, timeout=every_s)
                except ray.exceptions.GetTimeoutError:
                    continue  # busy, not dead
                except ray.exceptions.RayActorError:
                    raise PeerFailedError(f"(clock {clock}: another trainer's mailbox is gone)") from None
        return ray.get(ref)

    def fail(self, batch_id) -> None:
        import ray

        ray.get([box.fail.remote(self.rank, batch_id) for box in self.mailboxes])


class PullExchange(Exchange):
    """Versions stay with their producer until a consumer's copy is too old."""

    def __init__(self, rank: int, world: int, mailboxes: list) -> None:
        super().__init__(rank, world)
        self.mailboxes = mailboxes

    def publish(self, channel: str, clock: int, payload: Payload) -> None:
        import ray

        self.mailboxes[self.rank].put.remote(channel, self.rank, clock, [ray.put(payload)])

    def fetch(self, channel: str, oldest: int, upto: int | None, seen: dict) -> list:
        import ray

        stale = [r for r in range(self.world) if r != self.rank and seen.get(r, 0) < max(oldest, 0)]
        if not stale:
            return []
        t0 = time.perf_counter()
        answers = ray.get([self.mailboxes[r].since.remote(channel, self.rank, oldest, upto) for r in stale])
        self.wait_s += time.perf_counter() - t0
        got = [(r, newest, ref) for r, (newest, ref, _) in zip(stale, answers, strict=True) if ref is not None]
        return self._resolve(got)

    def fail(self, batch_id) -> None:
        import ray

        ray.get([box.fail.remote(self.rank, batch_id) for box in self.mailboxes])


def start_mailbox(group: str, world: int, rank: int):
    """This trainer's mailbox, on this process's node (called from the trainer's ``join``)."""
    import ray

    from hpsray.cluster.runtime import on_node

    node_id = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(Mailbox)
        .options(
            name=f"{group}:Mailbox[{rank}]",
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=on_node(node_id),
        )
        .remote(world, rank)
    )


def find_mailboxes(group: str, world: int, timeout_s: float = 120.0) -> list:
    """Every trainer's mailbox by name (each trainer starts its own in ``join``)."""
    import ray

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


def make_exchange(propagation: str, rank: int, world: int, board=None, mailboxes=None) -> Exchange:
    if propagation == "relay":
        return RelayExchange(rank, world, board)
    if propagation == "push":
        return PushExchange(rank, world, mailboxes)
    if propagation == "pull":
        return PullExchange(rank, world, mailboxes)
    raise ValueError(f"propagation must be one of {PROPAGATIONS}, got {propagation!r}")
